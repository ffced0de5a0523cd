"""The generation-free probe: how much probability the policy puts on openers that meet the rule.

For each held-out task the policy (the live version, with the preference notes where the daemon
puts them when memory is on, the ones active for it, as a main call would get them) takes one forward pass over the prompt;
the probe is the probability mass of the first reply token's top-20 candidates whose text opens a
reply that meets the preference (`Scenario.good_opener`), averaged over the tasks. One forward
pass per task, so it runs on every version while greedy generation runs at a few points only. It
sees only the opening of a reply: for rules about the rest of it, it is a partial view.

With `notes=False` the same prompts go without the notes: the weights alone. Against the base
model's mass (the first probe, before any note or version) it measures what training put into the
weights more finely than greedy replies do, which flip only once the wanted opener is the most
likely token.
"""

from __future__ import annotations

import asyncio
import math

from clawback.chat import ChatRequest
from clawback.daemon.api.state import AppState
from clawback.daemon.memory import inject
from clawback.engine import Sampling
from clawback.records import Version

from .scenarios import Scenario, Task

TOP = 20


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
    tok, total = state.renderer.tokenizer, 0.0
    for task in tasks:
        messages = inject([{"role": "user", "content": task.prompt}], told, state.settings.memory_placement)
        req = ChatRequest.model_validate({"model": "clawback", "messages": messages})
        _, ids = await asyncio.to_thread(state.renderer.render, req)
        sampling = Sampling(temperature=0.0, max_tokens=1, top_logprobs=TOP)
        async for t in state.engine.generate(ids, sampling, live):
            total += sum(math.exp(lp) for i, lp in zip(t.top_ids, t.top_logprobs) if scen.good_opener(tok.decode([i])))
    return total / len(tasks)
