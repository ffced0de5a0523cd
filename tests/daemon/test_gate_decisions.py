"""The candidate gate's decisions, fast: no model, no daemon process.

The gate and the store are real; one stand-in, because what it stands for needs a model:
`FakeModels` is the engine and the renderer as the gate uses them, each version a function from a
probe's prompt to its greedy reply (a token per character, each with logprob -0.5). Only the
arithmetic and fact probes are asked, whose right answers the stand-in can give. The gate over a
real model and real adapters is in test_gate.py (slow tier); its rules alone in test_gate_rules.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from clawback.chat import ChatRequest
from clawback.daemon.config import GateConfig
from clawback.daemon.gate import CandidateGate
from clawback.daemon.probes import Probe, load_probes
from clawback.daemon.store import Store
from clawback.daemon.store.queries import HealthPoint
from clawback.engine import Sampling, Token
from clawback.records import Call, FeedbackRecord, StepRecord

PROBES = [p for p in load_probes() if p.kind in ("arithmetic", "fact")]
EOS = 0


def right_answer(probe: Probe) -> str:
    if "number" in probe.check:
        return f"The answer is {probe.check['number']}."
    return f"It is {probe.check['any_word'][0]}, as far as I know."


RIGHT = {p.prompt: right_answer(p) for p in PROBES}


class FakeModels:
    """The engine and the renderer as the gate uses them: a request renders to the code points of
    its last message, and `replies[version]` answers it greedily (None = the base model)."""

    class info:  # noqa: N801 - the engine's `info` attribute
        context_length = 4096
        eos_token_ids = (EOS,)

    def __init__(self, replies: dict[str | None, Callable[[str], str]]) -> None:
        self.replies = replies
        self.generated: list[str | None] = []  # the version of each generation, in order
        self.tokenizer = self

    def render(self, req: ChatRequest) -> tuple[str, list[int]]:
        text = str(req.messages[-1].content)
        return text, [ord(ch) for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))

    async def generate(self, prompt_ids: list[int], sampling: Sampling, version: str | None, background: bool = False):
        assert sampling.temperature == 0.0 and background  # greedy, behind the requests being served
        self.generated.append(version)
        for ch in self.replies[version]("".join(map(chr, prompt_ids)))[: sampling.max_tokens]:
            yield Token(ord(ch), -0.5)
        yield Token(EOS, -0.1)


def answers_right(prompt: str) -> str:
    return RIGHT[prompt]


def bananas(prompt: str) -> str:
    return "Bananas are great to eat."


@pytest.fixture
def store(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    yield store
    store.close()


def gate(store: Store, models: FakeModels) -> CandidateGate:
    gate = CandidateGate(models, models, store, GateConfig())  # type: ignore[arg-type]
    gate.probes = PROBES
    return gate


def review(gate: CandidateGate, version: int, live: int | None = None, **metrics: float):
    return asyncio.run(gate.review(version, live, {"loss": 0.1, "grad_norm": 1.0, **metrics}))


def test_a_candidate_that_answers_as_the_base_model_is_promoted(store):
    models = FakeModels({None: answers_right, "v1": answers_right})
    g = gate(store, models)
    verdict = review(g, 1)
    assert verdict.promote and verdict.reasons == () and g.promoted == 1
    report = verdict.report
    assert report.retention is not None and report.retention.candidate == report.retention.base == 100.0
    assert report.newly_failed == {} and report.replay is not None
    assert report.replay.margin == "skipped: no rated held-out calls"  # nothing held out yet
    assert report.collapse_own_requests is None  # nor requests of the person's to answer
    assert list(report.json()) == ["health", "retention", "collapse", "replay", "newly_failed", "check_seconds",
                                   "seconds"]
    assert list(report.check_seconds or {}) == ["probes", "your_requests", "replay", "notes"]


def test_a_candidate_that_says_one_phrase_to_everything_is_refused_for_retention_and_collapse(store):
    models = FakeModels({None: answers_right, "v1": bananas})
    g = gate(store, models)
    verdict = review(g, 1)
    assert not verdict.promote and g.refused == 1
    assert verdict.reasons[0].startswith(f"retention −100.0 points (0.0 vs base 100.0 of 100 on {len(PROBES)} probes")
    assert any(r.startswith("collapse: same reply to different prompts") for r in verdict.reasons), verdict.reasons
    assert verdict.report.newly_failed == {p.id: bananas(p.prompt) for p in PROBES}  # the replies behind the score
    assert "v1" not in g._probe_cache and None in g._probe_cache  # a refused version's results are forgotten


def test_the_base_and_live_answers_are_cached_a_candidate_costs_one_probe_pass(store):
    models = FakeModels({None: answers_right, "v1": answers_right, "v2": answers_right})
    g = gate(store, models)
    assert review(g, 1).promote
    assert models.generated.count(None) == len(PROBES) and models.generated.count("v1") == len(PROBES)
    assert review(g, 2, live=1).promote
    assert models.generated.count(None) == len(PROBES)  # the base model's replies were kept
    assert models.generated.count("v1") == len(PROBES) and models.generated.count("v2") == len(PROBES)


def test_unhealthy_training_is_refused_before_any_generation(store):
    models = FakeModels({})
    g = gate(store, models)
    g._history = [HealthPoint(loss=0.1, grad_norm=2.0)] * 5
    verdict = review(g, 3, grad_norm=556.0)
    assert not verdict.promote and "gradient norm 556" in verdict.reason and models.generated == []
    assert verdict.report.json()["health"] == {"loss": 0.1, "grad_norm": 556.0, "history": 5}
    assert list(verdict.report.json()) == ["health", "seconds"]
    nan = review(g, 4, loss=math.nan)
    assert nan.reasons == ("training health: non-finite loss",)


def test_promoted_steps_are_remembered_even_when_the_history_starts_empty(store):
    models = FakeModels({None: answers_right, "v1": answers_right, "v2": answers_right})
    g = gate(store, models)
    assert review(g, 1, loss=0.2, grad_norm=1.5).promote  # a fresh store: no healthy steps yet
    assert g._history == [HealthPoint(loss=0.2, grad_norm=1.5)]
    assert review(g, 2, live=1).promote
    assert g._history is not None and len(g._history) == 2


def test_a_gate_that_cannot_check_a_version_refuses_it(store):
    def broken(prompt: str) -> str:
        raise RuntimeError("the engine went away")

    verdict = review(gate(store, FakeModels({None: broken})), 1)
    assert not verdict.promote and verdict.reason == "gate failed: RuntimeError: the engine went away"
    assert list(verdict.report.json()) == ["seconds"]


def test_the_report_is_stored_as_the_gate_wrote_it(store):
    verdict = review(gate(store, FakeModels({None: answers_right, "v1": bananas})), 1)
    asyncio.run(store.record_step(StepRecord(version=1, parent=None, started_at=time.time(), method="binary",
                                             call_ids=(), outcome="committed", candidate=True, path="/adapters/v1")))
    asyncio.run(store.update_adapter(1, state="refused", reason=verdict.reason, gate=verdict.report.json()))
    row, = store.adapters()
    assert (row.state, row.reason) == ("refused", verdict.reason)
    assert json.dumps(row.gate) == json.dumps(verdict.report.json())  # the same keys, in the same order
    collapse = verdict.report.collapse
    assert collapse is not None and row.gate["collapse"]["candidate"]["self_similarity"] == collapse.candidate.self_similarity


EXEC = {"type": "function", "function": {"name": "exec", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
TASKS = ["Count the lines of notes.txt.", "How many .log files are in data?", "Which file mentions mirror212?"]


def tool_request(store: Store, task: str) -> None:
    """A main call of the person's that offered the exec tool and got a 👎 (so it has a sample)."""
    call_id, now = str(uuid.uuid4()), time.time()
    store.add_call(Call(call_id, "s1", None, call_id, "main", "awaiting_next_state", now, now, "m", None,
                        {"messages": [{"role": "user", "content": task}], "tools": [EXEC]}, task,
                        [ord(ch) for ch in task], [1], [-1.0], "", None, "stop"))
    asyncio.run(store.apply_feedback(FeedbackRecord.of(
        {"event_id": str(uuid.uuid4()), "kind": "thumbs_down", "session_id": "s1", "target": call_id}), now))


def calls_exec(prompt: str) -> str:
    return RIGHT.get(prompt) or '<tool_call>{"name":"exec","arguments":{"command":"ls"}}'  # one character a token: 64 at most


def invents_tools(prompt: str) -> str:
    return RIGHT.get(prompt) or '{"name": "count_lines", "arguments": "notes.txt"}'


def test_base_and_live_answer_only_the_requests_new_since_the_last_review(store):
    for task in TASKS[:2]:
        tool_request(store, task)
    models = FakeModels({None: calls_exec, "v1": calls_exec, "v2": calls_exec, "v3": calls_exec})
    g = gate(store, models)
    assert review(g, 1).promote
    assert models.generated.count(None) == len(PROBES) + 2  # the probes and the person's two requests
    tool_request(store, TASKS[2])
    models.generated.clear()
    verdict = review(g, 2, live=1)
    own = verdict.report.collapse_own_requests
    assert verdict.promote and own is not None and own.calls == 3
    # v1 answered the probes and the two old requests as a candidate, the base before it
    assert models.generated.count(None) == 1 and models.generated.count("v1") == 1
    models.generated.clear()
    assert review(g, 3, live=2).promote
    assert models.generated.count(None) == 0 and models.generated.count("v2") == 0


def test_a_candidate_whose_tool_calls_no_longer_run_is_refused(store):
    for task in TASKS:
        tool_request(store, task)
    g = gate(store, FakeModels({None: calls_exec, "v1": invents_tools, "v2": calls_exec}))
    refused = review(g, 1)
    assert refused.reasons == ("collapse (your requests): replies with no tool call that could run 100% vs 0% on base",)
    own = refused.report.collapse_own_requests
    assert own is not None and own.calls == 3 and own.live.no_working_call_rate == 0.0
    assert review(g, 2).promote  # the same requests, answered with calls that run
