"""The training loop against bad samples, with the real store, engine (tiny Llama), adapter
manager and trainer worker (in a thread instead of a Ray actor: `sim.local_worker`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from pathlib import Path

import pytest

from clawback.chat import ChatRenderer
from clawback.daemon.adapters import AdapterManager
from clawback.daemon.retirement import NoteCheck, NoteRetirement
from clawback.daemon.store import Store
from clawback.daemon.training import TrainingLoop
from clawback.engines.embedded import EmbeddedEngine
from clawback.records import Call, FeedbackRecord, JudgedSample
from clawback.sim.local_worker import in_thread_trainer
from clawback.trainer.config import TrainConfig
from tests.conftest import query


def ready_sample(store: Store, response_ids: list[int]) -> str:
    """A rated main call whose sample is ready (as a store written before replies were checked holds)."""
    call_id, now, session = f"chatcmpl-{uuid.uuid4().hex}", time.time(), uuid.uuid4().hex
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id="t", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=now, finished_at=now, model="tiny", adapter_version=None,
        request={"messages": [{"role": "user", "content": "hi"}]}, prompt_text="hi", prompt_ids=[1, 20, 30],
        response_ids=response_ids, behaviour_logprobs=[-2.0] * len(response_ids), response_text="x",
        tool_calls=None, finish_reason="stop"))
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": session,
                                      "target": "last", "source": "cli"}), now))
    asyncio.run(store.write_sample(JudgedSample(call_id=call_id, revision=0, state="ready", reward=1.0,
                                                reward_source="explicit", method="binary")))
    time.sleep(0.01)  # oldest first: keep the order of creation
    return call_id


@pytest.fixture
def parts(tiny_model_dir: Path, tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    engine = EmbeddedEngine(tiny_model_dir)
    cfg = TrainConfig(method="binary", batch_size=2, lora_rank=4, lora_alpha=8)
    adapters = AdapterManager(engine, store, tmp_path / "adapters", keep=3)
    yield store, adapters, cfg, in_thread_trainer(str(tiny_model_dir), cfg, 1)
    asyncio.run(engine.close())
    store.close()


def run_until(loop: TrainingLoop, done, timeout: float = 240) -> None:
    async def go():
        task = asyncio.create_task(loop.run())
        deadline = time.time() + timeout
        while not done() and time.time() < deadline and not task.done():
            await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await loop.close()

    asyncio.run(go())


def sample_states(store: Store) -> dict[str, tuple[str, str | None]]:
    return {r["call_id"]: (r["state"], r["reason"]) for r in query(store.db_path, "SELECT * FROM samples")}


def test_an_empty_ready_sample_is_quarantined_and_the_rest_train(parts):
    """One rated empty reply made every step fail at once, forever, and nothing ever trained."""
    store, adapters, cfg, start = parts
    empty = ready_sample(store, [])
    good = [ready_sample(store, [40 + i, 41, 42, 2]) for i in range(2)]
    loop = TrainingLoop(store, adapters, cfg, start, poll_s=0.2)
    run_until(loop, lambda: adapters.live() == 1)
    assert adapters.live() == 1
    states = sample_states(store)
    assert states[empty][0] == "quarantined" and "non-empty prompt and response" in states[empty][1]
    assert [states[c][0] for c in good] == ["consumed", "consumed"]
    assert loop.failures == 0


def test_a_sample_that_fails_every_step_is_quarantined_after_backing_off(parts):
    """A sample that passes the checks but breaks the step (a token id outside the vocabulary)
    is retried with growing pauses, then quarantined with the error; the samples after it train."""
    store, adapters, cfg, start = parts
    cfg = dataclasses.replace(cfg, batch_size=1)
    poison = ready_sample(store, [10**6, 2])
    good = ready_sample(store, [50, 51, 2])
    loop = TrainingLoop(store, adapters, cfg, start, poll_s=0.2, retry_s=0.2, retry_max_s=0.5, quarantine_after=3)
    delays = []
    step = loop.step

    async def recording_step(batch):
        result = await step(batch)
        delays.append(loop.retry_delay() if result is None else None)
        return result

    loop.step = recording_step
    run_until(loop, lambda: None in delays)  # the good sample's step has returned
    assert adapters.live() == 1
    assert delays[:4] == [0.2, 0.4, 0.5, None]  # doubling, capped, then the good sample trains
    states = sample_states(store)
    assert states[poison][0] == "quarantined" and states[poison][1].startswith("training failed 3 times: ")
    assert states[good][0] == "consumed"
    outcomes = [r[0] for r in query(store.db_path, "SELECT outcome FROM train_steps ORDER BY step")]
    assert outcomes == ["failed", "failed", "failed", "committed"]


def test_a_note_check_that_fails_never_stops_a_version_going_live(parts, tiny_model_dir, monkeypatch):
    """The preference-note check runs after the version went live; scoring that raises leaves the
    note injected and the version serving."""
    store, adapters, cfg, start = parts
    good = [ready_sample(store, [40 + i, 41, 42, 2]) for i in range(2)]
    corrected = f"chatcmpl-{uuid.uuid4().hex}"
    now = time.time()
    store.add_call(Call(corrected, "s-note", "t", corrected, "main", "awaiting_next_state", now, now, "tiny", None,
                        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "hi", [1, 20, 30], [60, 61, 2],
                        [-2.0] * 3, "x", None, "stop"))
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "s-note",
                                      "target": "last", "text": "Please answer in French."}), now))
    (_, revision), = [p for p in store.pending_samples() if p[0] == corrected]
    assert asyncio.run(store.write_sample(JudgedSample(corrected, revision, "dropped", reason="held_out",
                                                       teacher_logprobs=[-1.0, -1.0, -1.0])))
    tried = []

    async def broken(*args, **kwargs):
        tried.append(args)
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(adapters.engine, "score", broken)
    from transformers import AutoTokenizer

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    retirement = NoteRetirement(adapters.engine, renderer, store)
    trained: list[dict] = []
    loop = TrainingLoop(store, adapters, cfg, start, trained.append, poll_s=0.2, retirement=retirement)
    run_until(loop, lambda: bool(trained))  # reported once the step, its check included, is over
    assert adapters.live() == 1 and loop.failures == 0
    assert [t.version.name for t in trained] == ["v1"]  # the step completed
    assert [sample_states(store)[c][0] for c in good] == ["consumed", "consumed"]
    assert tried, "the check ran"
    note, = store.memory_notes(1)
    assert note.active and note.retired_by is None


def test_notes_are_checked_against_the_live_version_at_start_up_and_after_a_promote(parts, tiny_model_dir):
    """A version that goes live outside a step (a restart, `adapters promote`) gets its notes
    checked between steps; a version rolled back before its turn is not checked."""
    store, adapters, cfg, start = parts
    good = [ready_sample(store, [40 + i, 41, 42, 2]) for i in range(2)]
    from transformers import AutoTokenizer

    checked: list[int] = []

    class Recording(NoteRetirement):
        async def check(self, version: int) -> list[NoteCheck]:
            checked.append(version)
            return await super().check(version)

    retirement = Recording(adapters.engine, ChatRenderer(AutoTokenizer.from_pretrained(str(tiny_model_dir))), store)
    first = TrainingLoop(store, adapters, cfg, start, poll_s=0.2, retirement=retirement)
    run_until(first, lambda: adapters.live() == 1 and not first.busy)
    assert checked == [1] and [sample_states(store)[c][0] for c in good] == ["consumed", "consumed"]

    restarted = TrainingLoop(store, adapters, cfg, start, poll_s=0.2, retirement=retirement)
    path = store.adapters()[0].path

    async def until(done) -> None:
        deadline = time.time() + 120
        while not done() and time.time() < deadline:
            await asyncio.sleep(0.05)

    async def go() -> None:
        task = asyncio.create_task(restarted.run())
        await until(lambda: len(checked) == 2)
        assert checked == [1, 1]  # v1 was live at start-up
        await adapters.rollback(None)
        restarted.check_notes(1)  # rolled back before its turn: nothing to check
        await until(lambda: not restarted._notes_to_check)
        assert checked == [1, 1]
        await adapters.go_live(1, path)  # as `adapters promote` does
        restarted.check_notes(1)
        await until(lambda: len(checked) == 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert checked == [1, 1, 1]
