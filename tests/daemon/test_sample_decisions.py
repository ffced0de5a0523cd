"""The sample pipeline's decisions, fast: no model, no daemon process.

A signal (a next state, a 👍/👎, a correction) reaches the real store, which queues the call's
sample and tells its `on_sample_pending` listeners; the real pipeline, woken by them, judges it
and writes it `ready` (the store then tells `on_sample_ready`) or `dropped` with a reason. Two
stand-ins, because what they stand for needs a model: `FakeJudge` answers the judge's prompts with
a fixed verdict, and `FakeTeacher` is the engine and renderer as the teacher uses them (a prompt's
ids are its text's characters; every token scores -0.5). The pipeline over a real engine is in
test_samples.py (slow tier).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path

import pytest

from clawback.chat import ChatRequest
from clawback.daemon.config import Settings
from clawback.daemon.samples import SamplePipeline
from clawback.daemon.store import Store
from clawback.records import Call, FeedbackRecord
from tests.conftest import query

REQUEST = {"model": "clawback", "messages": [{"role": "user", "content": "Explain rain."}]}


class FakeJudge:
    """A judge backend whose every PRM vote is `score` (1, 0 or -1) and whose hint is `hint`."""

    name = "fake"

    def __init__(self, score: int = 1, hint: str = "Mention clouds.") -> None:
        self.score, self.hint, self.calls = score, hint, 0

    async def complete(self, messages, *, temperature, max_tokens, seed=None) -> str:
        self.calls += 1
        if "[HINT_START]" in messages[0]["content"]:
            return f"\\boxed{{1}} [HINT_START]{self.hint}[HINT_END]"
        return f"ok \\boxed{{{self.score}}}"


class FakeTeacher:
    """The engine and the renderer as the teacher uses them: a request renders to the code points
    of its messages' text, and every scored token has logprob -0.5."""

    class info:  # noqa: N801 - the engine's `info` attribute
        context_length = 4096
        eos_token_ids = (0,)

    def __init__(self) -> None:
        self.scored: list[tuple[list[int], list[int], str | None]] = []

    def render(self, req: ChatRequest) -> tuple[str, list[int]]:
        text = "".join(str(m.content) for m in req.messages)
        return text, [ord(ch) for ch in text]

    def loaded_versions(self) -> list[str]:
        return []

    async def score(self, prompt_ids: list[int], response_ids: list[int], version: str | None) -> list[float]:
        self.scored.append((prompt_ids, response_ids, version))
        return [-0.5] * len(response_ids)


def served_call(store: Store, session: str, response_ids: tuple[int, ...] = (40, 41, 42)) -> str:
    """A main call as capture stores it, waiting for its next state."""
    call_id, now = f"chatcmpl-{uuid.uuid4().hex}", time.time()
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id="t", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=now, finished_at=now, model="tiny", adapter_version=None,
        request=REQUEST, prompt_text="Explain rain.", prompt_ids=[1, 2, 3], response_ids=list(response_ids),
        behaviour_logprobs=[-1.0] * len(response_ids), response_text="Rain is water.", tool_calls=None,
        finish_reason="stop"))
    return call_id


def feedback(store: Store, session: str, kind: str, text: str | None = None) -> None:
    event = {"event_id": str(uuid.uuid4()), "kind": kind, "session_id": session, "target": "last", "text": text,
             "source": "cli"}
    asyncio.run(store.apply_feedback(FeedbackRecord.of(event), time.time()))


def sample(store: Store, call_id: str) -> dict:
    row, = query(store.db_path, "SELECT * FROM samples WHERE call_id = ?", call_id)
    return dict(row)


@pytest.fixture
def store(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    yield store
    store.close()


def pipeline(store: Store, judge: FakeJudge | None = None, engine: FakeTeacher | None = None,
             ready: list[dict] | None = None, **cfg) -> SamplePipeline:
    engine = engine or FakeTeacher()
    # The defaults a daemon starts with, outcome rules off (these calls carry no tool results).
    signals = dataclasses.replace(Settings().signal_config(), outcome_rules=(), **cfg)
    return SamplePipeline(store, engine, engine, judge, signals,  # type: ignore[arg-type]
                          on_ready=(ready if ready is not None else []).append)


def run_while(pipe: SamplePipeline, signal, done, timeout: float = 30.0) -> None:
    """Run the pipeline as the daemon does, then `signal()`, until `done()`: it polls once at the
    start and then only when the store wakes it."""

    async def go():
        task = asyncio.create_task(pipe.run(poll_s=600))
        await asyncio.sleep(0.1)  # its first look found nothing
        signal()
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert done(), "the pipeline did not get there"


def drain(pipe: SamplePipeline) -> None:
    async def go():
        for call_id, revision in pipe.store.pending_samples(100):
            await pipe.process(call_id, revision)

    asyncio.run(go())


def test_a_next_state_queues_a_sample_the_woken_pipeline_judges_ready(store):
    """The store tells its listeners by call id: queued for judging, then ready for training."""
    judge, ready = FakeJudge(score=1), []
    pipe = pipeline(store, judge, ready=ready, method="binary")
    pending, trainable = [], []
    store.on_sample_pending += [pending.append, lambda _: pipe.wake()]
    store.on_sample_ready.append(trainable.append)
    call_id = served_call(store, "s1")
    store.flush()
    run_while(pipe, lambda: store.add_next_state(call_id, "next", [{"role": "user", "content": "thanks, that helps"}],
                                                 True, time.time()), lambda: bool(trainable))
    assert pending == [call_id]
    row = sample(store, call_id)
    assert (row["state"], row["reward"], row["reward_source"], row["judge_score"]) == ("ready", 1.0, "judge", 1)
    assert trainable == [call_id] and judge.calls == 3  # three votes, every one kept
    assert ready == [{"call_id": call_id, "session_id": "s1", "reward": 1.0, "reward_source": "judge", "hint": False}]
    kinds = [r[0] for r in query(store.db_path, "SELECT kind FROM events WHERE subject_id = ? ORDER BY id", call_id)]
    assert kinds[-2:] == ["sample.pending_judge", "sample.ready"]  # the event log as before


def test_a_thumbs_up_is_the_reward_whatever_the_judge_says(store):
    judge = FakeJudge(score=-1)
    call_id = served_call(store, "s2")
    feedback(store, "s2", "thumbs_up")
    drain(pipeline(store, judge, method="binary"))
    row = sample(store, call_id)
    assert (row["state"], row["reward"], row["reward_source"]) == ("ready", 1.0, "explicit") and judge.calls == 0


def test_a_next_state_without_a_judge_or_a_rating_is_dropped_with_no_signal(store):
    call_id = served_call(store, "s3")
    store.add_next_state(call_id, "next", [{"role": "user", "content": "ok"}], True, time.time())
    store.flush()
    drain(pipeline(store, None, method="binary"))
    assert (sample(store, call_id)["state"], sample(store, call_id)["reason"]) == ("dropped", "no_signal")


def test_an_empty_reply_is_dropped_before_the_judge_sees_it(store):
    judge = FakeJudge()
    call_id = served_call(store, "s4", response_ids=())
    feedback(store, "s4", "thumbs_down")
    drain(pipeline(store, judge, method="binary"))
    assert (sample(store, call_id)["state"], sample(store, call_id)["reason"]) == ("dropped", "empty_reply")
    assert judge.calls == 0


def test_a_correction_without_a_judge_is_the_hint_the_teacher_scores_the_reply_under(store):
    teacher = FakeTeacher()
    call_id = served_call(store, "s5")
    feedback(store, "s5", "correction", "Mention the clouds.")
    drain(pipeline(store, None, teacher, method="opd", teacher="base"))
    row = sample(store, call_id)
    assert (row["state"], row["hint"], row["hint_source"]) == ("ready", "Mention the clouds.", "correction_raw")
    (prompt, response, version), = teacher.scored
    assert response == [40, 41, 42] and version is None  # the stored ids, under the base model
    assert "".join(map(chr, prompt)).endswith("[Hint for a better reply] Mention the clouds.")
    assert row["token_level_reason"] == "no_top_k_recorded"  # no top-K was recorded at serve time


def test_a_judged_sample_is_not_written_over_a_newer_signal(store):
    """A signal that arrives while the sample is judged re-queues it; the older verdict is discarded."""
    call_id = served_call(store, "s6")
    feedback(store, "s6", "thumbs_up")
    (queued, revision), = store.pending_samples()
    feedback(store, "s6", "thumbs_down")  # the person changed their mind meanwhile
    pipe = pipeline(store, None, method="binary")
    asyncio.run(pipe.process(queued, revision))
    assert sample(store, call_id)["state"] == "pending_judge"  # the older revision was not processed
    drain(pipe)
    assert (sample(store, call_id)["state"], sample(store, call_id)["reward"]) == ("ready", -1.0)
