"""Judge backends against real models: the embedded engine on the tiny random Llama, and a real
clawback daemon over its OpenAI-compatible API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from clawback.chat import ChatRenderer, ChatRequest
from clawback.engine import Sampling
from clawback.engines.embedded import EmbeddedEngine
from clawback.judge.backends import EngineBackend, JudgeBackendError, OpenAIBackend, PromptTooLongError
from clawback.judge.prm import judge_prm
from tests.conftest import DaemonProcess, free_port

MESSAGES = [{"role": "system", "content": "You are a judge."}, {"role": "user", "content": "Was that reply good?"}]
LONG_REQUEST = [{"role": "user", "content": "please " * 1000}]  # the tiny model's context is 512 tokens


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    e = EmbeddedEngine(tiny_model_dir, device="cpu")
    yield e
    run(e.close())


async def greedy_text(engine: EmbeddedEngine, tokenizer, adapter: str | None, max_tokens: int) -> str:
    """What the engine itself generates greedily for MESSAGES, up to the first end token."""
    _, ids = ChatRenderer(tokenizer).render(ChatRequest(model="x", messages=MESSAGES))
    out = []
    async for tok in engine.generate(ids, Sampling(temperature=0, max_tokens=max_tokens), adapter):
        if tok.id in engine.info.eos_token_ids:
            break
        out.append(tok.id)
    return tokenizer.decode(out, skip_special_tokens=True)


def test_engine_backend_returns_the_engines_text(engine, tokenizer):
    backend = EngineBackend(engine, ChatRenderer(tokenizer), tokenizer)
    text = run(backend.complete(MESSAGES, temperature=0, max_tokens=12))
    assert text and text == run(greedy_text(engine, tokenizer, None, 12))
    assert backend.name == f"engine:{engine.info.name}"


def test_engine_backend_fails_a_vote_whose_prompt_exceeds_the_context(engine, tokenizer):
    backend = EngineBackend(engine, ChatRenderer(tokenizer), tokenizer)
    with pytest.raises(PromptTooLongError, match="context of 512 tokens"):
        run(backend.complete(LONG_REQUEST, temperature=0, max_tokens=12))
    verdict = run(judge_prm(backend, LONG_REQUEST, "ok", [{"role": "user", "content": "thanks"}], m=3, retries=2))
    assert verdict.score is None and verdict.failed_votes == 3
    assert all("context" in v.error and v.attempts == 1 for v in verdict.votes)


def test_engine_backend_judges_with_the_base_model_while_an_adapter_is_active(tiny_model_dir, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
        LoraConfig(r=4, lora_alpha=64, target_modules="all-linear", init_lora_weights=False),
    )
    lora.save_pretrained(str(tmp_path / "adapter"))

    async def go():
        engine = EmbeddedEngine(tiny_model_dir, device="cpu")
        try:
            base = await greedy_text(engine, tokenizer, None, 12)
            await engine.load_adapter("v1", str(tmp_path / "adapter"))
            await engine.activate("v1")
            tuned = await greedy_text(engine, tokenizer, "v1", 12)
            judged = await EngineBackend(engine, ChatRenderer(tokenizer), tokenizer).complete(
                MESSAGES, temperature=0, max_tokens=12)
            return base, tuned, judged
        finally:
            await engine.close()

    base, tuned, judged = run(go())
    assert tuned != base  # the adapter really changes the output, so the check below means something
    assert judged == base


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("judge-daemon"), tiny_model_dir, "--no-auth").start()
    yield d
    d.stop()


def test_openai_backend_against_a_clawback_daemon(daemon: DaemonProcess):
    async def go():
        async with OpenAIBackend(f"{daemon.url}/v1", None, "clawback", timeout_s=60) as backend:
            return await backend.complete(MESSAGES, temperature=0, max_tokens=12, seed=1), backend.name

    text, name = run(go())
    assert isinstance(text, str) and text
    assert name == "openai:clawback"


def test_openai_backend_bad_model_id_raises_a_clear_error(daemon: DaemonProcess):
    async def go():
        async with OpenAIBackend(f"{daemon.url}/v1", None, "no-such-model", timeout_s=60) as backend:
            await backend.complete(MESSAGES, temperature=0, max_tokens=12)

    with pytest.raises(JudgeBackendError, match=r"HTTP 404 for model 'no-such-model': model 'no-such-model' does not exist"):
        run(go())


def test_openai_backend_maps_context_overflow_to_prompt_too_long(daemon: DaemonProcess):
    async def go():
        async with OpenAIBackend(f"{daemon.url}/v1", None, "clawback", timeout_s=60) as backend:
            await backend.complete(LONG_REQUEST, temperature=0, max_tokens=12)

    with pytest.raises(PromptTooLongError, match="HTTP 400"):
        run(go())


def test_openai_backend_unreachable_server_raises_a_clear_error():
    async def go():
        async with OpenAIBackend(f"http://127.0.0.1:{free_port()}/v1", None, "clawback", timeout_s=5) as backend:
            await backend.complete(MESSAGES, temperature=0, max_tokens=4)

    with pytest.raises(JudgeBackendError, match="unreachable"):
        run(go())
