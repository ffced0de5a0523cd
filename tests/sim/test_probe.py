"""The opener probe's first-token mass on the tiny embedded model: the whole vocabulary, exact."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

from transformers import AutoTokenizer

from clawback.engine import Sampling
from clawback.engines.embedded import EmbeddedEngine
from clawback.sim.probe import first_token_mass, opener_ids

PROMPT = [1, 520, 33, 4481, 28, 2, 198, 77, 9000]


def test_first_token_mass_covers_the_whole_vocabulary(tiny_model_dir: Path):
    """Every token: mass 1. The greedy first token alone: its own probability, as generation
    reports it. A token outside the top 20 still counts (the top-20 probe read it as 0)."""
    engine = EmbeddedEngine(tiny_model_dir)

    async def go():
        vocab = list(range(int(engine.model.config.vocab_size)))
        everything = await first_token_mass(engine, PROMPT, vocab, None)
        sampling = Sampling(temperature=0.0, max_tokens=1, top_logprobs=20)
        first = [t async for t in engine.generate(PROMPT, sampling)][0]
        greedy = await first_token_mass(engine, PROMPT, [first.id], None)
        rare = next(i for i in vocab if i not in first.top_ids)
        rare_mass = await first_token_mass(engine, PROMPT, [rare], None)
        none = await first_token_mass(engine, PROMPT, [], None)
        await engine.close()
        return everything, first, greedy, rare_mass, none

    everything, first, greedy, rare_mass, none = asyncio.run(asyncio.wait_for(go(), 600))
    assert abs(everything - 1.0) < 1e-4
    assert abs(greedy - math.exp(first.logprob)) < 1e-5
    assert 0.0 < rare_mass < math.exp(min(first.top_logprobs))
    assert none == 0.0


def test_opener_ids_are_the_tokens_whose_text_opens_the_reply(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = opener_ids(tok, "great", lambda text: text.strip().lower().startswith("great"))
    assert ids and all(tok.decode([i]).strip().lower().startswith("great") for i in ids)
    assert opener_ids(tok, "great", lambda text: False) is ids, "decoded once per scenario and tokenizer"
