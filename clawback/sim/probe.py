"""The generation-free probe: how much probability the policy puts on openers that meet the rule.

For each held-out task the policy (the live version, with the preference notes where the daemon
puts them when memory is on, the ones active for it, as a main call would get them) takes one forward pass over the prompt;
the probe is the probability mass of every vocabulary token whose text opens a reply that meets
the preference (`Scenario.good_opener`) as the first reply token, averaged over the tasks. The
whole vocabulary, not the most likely tokens only: a wanted opener far down the list (1e-4 and
rising) is what training moves first. One forward pass per task, so it runs on every version while
greedy generation runs at a few points only. It sees only the opening of a reply: for rules about
the rest of it, it is a partial view.

With `notes=False` the same prompts go without the notes: the weights alone. Against the base
model's mass (the first probe, before any note or version) it measures what training put into the
weights more finely than greedy replies do, which flip only once the wanted opener is the most
likely token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence

from clawback.chat import ChatRequest
from clawback.daemon.api.state import AppState
from clawback.daemon.memory import inject
from clawback.engine import Engine
from clawback.records import Version

from .scenarios import Scenario, Task

_OPENER_IDS: dict[tuple[str, str, int], list[int]] = {}  # (scenario, tokenizer, its size) -> opener token ids


def opener_ids(tokenizer, name: str, good_opener: Callable[[str], bool]) -> list[int]:
    """Every token id whose text opens a reply that meets the preference (decoded once per run)."""
    key = (name, tokenizer.name_or_path, len(tokenizer))
    if key not in _OPENER_IDS:
        _OPENER_IDS[key] = [i for i in range(len(tokenizer)) if good_opener(tokenizer.decode([i]))]
    return _OPENER_IDS[key]


async def first_token_mass(engine: Engine, prompt_ids: Sequence[int], ids: Sequence[int], version: str | None) -> float:
    """The probability that the reply to `prompt_ids` starts with one of `ids`."""
    if not ids:
        return 0.0
    logprobs = await engine.score_candidates(prompt_ids, [ids[0]], [list(ids)], version)
    return min(1.0, sum(math.exp(lp) for lp in logprobs[0]))  # a sum of rounded terms may pass 1


async def active_notes(state: AppState, live: str | None = None) -> list[str]:
    """The preference notes a main call to the live version gets now in a new conversation (none
    with memory off): the general ones."""
    if not state.settings.memory:
        return []
    version = Version.of(live if live is not None else state.engine.active_version())
    return [n.text for n in await asyncio.to_thread(state.store.memory_notes, version)
            if n.active and n.scope == "general"]


async def opener_mass(state: AppState, scen: Scenario, tasks: tuple[Task, ...], notes: bool = True) -> float | None:
    if scen.good_opener is None:
        return None
    live = state.engine.active_version()
    told = await active_notes(state, live) if notes else []
    good = await asyncio.to_thread(opener_ids, state.renderer.tokenizer, scen.name, scen.good_opener)
    total = 0.0
    for task in tasks:
        messages = inject([{"role": "user", "content": task.prompt}], told, state.settings.memory_placement)
        req = ChatRequest.model_validate({"model": "clawback", "messages": messages})
        _, ids = await asyncio.to_thread(state.renderer.render, req)
        total += await first_token_mass(state.engine, ids, good, live)
    return total / len(tasks)
