"""The training loop's and the adapter manager's decisions, fast: no model, no daemon process.

The store, the adapter files (a 1-layer LoRA published by `adapter_format`), the loop and the
manager are real. Two stand-ins, because what they stand for needs a model: `Slots` keeps an
engine's adapter slots (load, activate, unload) without weights behind them, and `ScriptedTrainer`
publishes a real (tiny, random) adapter per step without computing a loss. The real engine and
trainer under the same loop are in test_training.py and test_adapters.py (slow tier).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from clawback.adapter_format import publish, read_files
from clawback.daemon.adapters import AdapterError, AdapterManager
from clawback.daemon.gate import Verdict
from clawback.daemon.store import Store
from clawback.daemon.training import Refused, Trained, TrainingLoop
from clawback.records import Call, FeedbackRecord, JudgedSample, ReadySample, StepRecord, TrainResult, Version
from clawback.trainer.config import TrainConfig
from tests.conftest import query
from tests.daemon.engine_slots import Slots

CFG = TrainConfig(method="binary", batch_size=2, lora_rank=2, lora_alpha=4)


def tiny_lora(root: Path, version: int) -> Path:
    """A real published adapter version of a 1-layer random Llama (no tokenizer, no model dir)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from clawback.trainer.step import make_lora_model, make_optimizer

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = make_lora_model(LlamaForCausalLM(config), CFG)
    return publish(root, version, model, make_optimizer(model, CFG), {"method": "binary"})


class ScriptedTrainer:
    """A `TrainerHandle` that stands on a version, as the worker does, and publishes a tiny adapter
    per step; `fail` makes the next steps raise."""

    def __init__(self, root: Path) -> None:
        self.root, self.version, self.fail = root, None, 0
        self.resumed: list[int | None] = []
        self.trained: list[tuple[int, list[str]]] = []

    async def resume(self, version: int | None, files: dict[str, bytes] | None) -> int | None:
        assert (version is None) == (files is None)
        self.resumed.append(version)
        self.version = version
        return version

    async def ping(self) -> int | None:
        return self.version

    async def train(self, samples: Sequence[ReadySample], version: int, meta: dict[str, Any]) -> TrainResult:
        if self.fail:
            self.fail -= 1
            self.version = 999  # a failed step leaves weights no version holds
            raise RuntimeError("loss is NaN")
        self.trained.append((version, [s.call_id for s in samples]))
        parent, self.version = self.version, version
        files = read_files(tiny_lora(self.root / uuid.uuid4().hex, version))
        return TrainResult(version=version, parent=parent, node=None, metrics={"loss": 0.5}, files=files)

    async def close(self) -> None:
        pass


class ScriptedGate:
    """The candidate gate's decision, scripted per version (its checks are tested in test_gate*.py)."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse, self.reviewed = refuse, []

    def holds_out(self, sample: ReadySample) -> bool:
        return False

    async def review(self, version: int, live: int | None, metrics: dict[str, Any]) -> Verdict:
        self.reviewed.append((version, live))
        return Verdict(False, ("replies collapsed",)) if version in self.refuse else Verdict(True)


def ready_sample(store: Store, served_by: int | None = None) -> str:
    """A main call with a 👍 whose sample the pipeline made ready."""
    call_id, now, session = f"chatcmpl-{uuid.uuid4().hex}", time.time(), uuid.uuid4().hex
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id="t", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=now, finished_at=now, model="tiny", adapter_version=served_by,
        request={"messages": [{"role": "user", "content": "hi"}]}, prompt_text="hi", prompt_ids=[1, 20, 30],
        response_ids=[40, 41, 2], behaviour_logprobs=[-2.0] * 3, response_text="x", tool_calls=None,
        finish_reason="stop"))
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "thumbs_up",
                                                       "session_id": session, "target": "last", "source": "cli"}), now))
    asyncio.run(store.write_sample(JudgedSample(call_id=call_id, revision=0, state="ready", reward=1.0,
                                                reward_source="explicit", method="binary")))
    time.sleep(0.01)  # oldest first
    return call_id


def sample_states(store: Store) -> dict[str, tuple[str, str | None]]:
    return {r["call_id"]: (r["state"], r["reason"]) for r in query(store.db_path, "SELECT * FROM samples")}


def adapter_states(store: Store) -> dict[int, str]:
    return {r["version"]: r["state"] for r in query(store.db_path, "SELECT version, state FROM adapters")}


@pytest.fixture
def parts(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    slots = Slots()
    adapters = AdapterManager(slots, store, tmp_path / "adapters", keep=2)  # type: ignore[arg-type]
    yield store, adapters, slots, ScriptedTrainer(tmp_path / "trainer")
    store.close()


def run_until(loop: TrainingLoop, done, timeout: float = 60) -> None:
    async def go():
        task = asyncio.create_task(loop.run())
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())
    assert done(), "the loop did not get there"


def test_a_full_batch_trains_one_version_that_goes_live(parts):
    store, adapters, slots, trainer = parts
    trained: list[Trained] = []
    first = ready_sample(store)
    loop = TrainingLoop(store, adapters, CFG, lambda: trainer, on_trained=trained.append, poll_s=0.05)
    run_until(loop, lambda: loop.steps == 0 and sample_states(store)[first][0] == "ready")  # one is not a batch
    assert trainer.trained == [] and adapters.live() is None
    second = ready_sample(store)
    run_until(loop, lambda: adapters.live() == 1 and not loop.busy)  # the step, its commit included, is over
    assert trainer.resumed == [None]  # started lazily, from what served
    assert trainer.trained == [(1, [first, second])]
    assert slots.active == "v1" and adapter_states(store) == {1: "live"}
    assert {s for s, _ in sample_states(store).values()} == {"consumed"}
    assert trained[0].version == Version(1) and trained[0].samples == 2 and trained[0].metrics["loss"] == 0.5


def test_samples_served_too_many_versions_ago_are_dropped_as_stale(parts):
    store, adapters, _, trainer = parts
    cfg = TrainConfig(method="binary", batch_size=2, lora_rank=2, lora_alpha=4, max_staleness=0)
    loop = TrainingLoop(store, adapters, cfg, lambda: trainer, poll_s=0.05)
    for _ in range(2):
        ready_sample(store)
    run_until(loop, lambda: adapters.live() == 1 and not loop.busy)  # the step, its commit included, is over
    old = [ready_sample(store, served_by=None) for _ in range(2)]  # the base served them; v1 is live
    fresh = [ready_sample(store, served_by=1) for _ in range(2)]
    run_until(loop, lambda: adapters.live() == 2 and not loop.busy)  # the step, its commit included, is over
    states = sample_states(store)
    assert [states[c] for c in old] == [("dropped", "stale")] * 2
    assert trainer.trained[-1] == (2, fresh)


def test_a_failing_step_is_recorded_the_trainer_goes_back_and_repeat_samples_are_quarantined(parts):
    store, adapters, _, trainer = parts
    trainer.fail = 2
    loop = TrainingLoop(store, adapters, CFG, lambda: trainer, poll_s=0.05, retry_s=0.01, retry_max_s=0.02,
                        quarantine_after=2)
    batch = [ready_sample(store), ready_sample(store)]
    # the second failure's record and its quarantine are written after it is counted
    run_until(loop, lambda: loop.failures == 2 and {sample_states(store)[c][0] for c in batch} == {"quarantined"})
    steps = query(store.db_path, "SELECT outcome, error FROM train_steps ORDER BY step")
    assert [s["outcome"] for s in steps] == ["failed", "failed"] and "loss is NaN" in steps[0]["error"]
    # After each failure the trainer goes back to what serves (the last one may still be under way).
    assert trainer.resumed[:2] == [None, None] and set(trainer.resumed) == {None}
    states = sample_states(store)
    assert [states[c][0] for c in batch] == ["quarantined"] * 2
    assert "training failed 2 times: RuntimeError: loss is NaN" in states[batch[0]][1]
    assert adapters.live() is None and loop.failed_in_a_row == 2
    # The wait doubles with each failure in a row, up to its cap.
    loop.retry_s, loop.retry_max_s = 5.0, 600.0
    assert [loop.retry_delay() for loop.failed_in_a_row in (1, 2, 3, 20)] == [5.0, 10.0, 20.0, 600.0]
    # Samples behind the bad ones train, into the number the failed steps never published.
    later = [ready_sample(store), ready_sample(store)]
    run_until(loop, lambda: adapters.live() == 1 and not loop.busy)  # the step, its commit included, is over
    assert trainer.trained == [(1, later)] and loop.failed_in_a_row == 0


def test_a_refused_candidate_stays_out_of_service_and_the_next_step_trains_from_the_live_version(parts):
    store, adapters, slots, trainer = parts
    refused: list[Refused] = []
    gate = ScriptedGate(refuse={1})
    loop = TrainingLoop(store, adapters, CFG, lambda: trainer, poll_s=0.05, gate=gate,  # type: ignore[arg-type]
                        on_refused=refused.append)
    for _ in range(2):
        ready_sample(store)
    run_until(loop, lambda: bool(refused))
    assert refused == [Refused(Version(1), "replies collapsed")]
    assert adapter_states(store) == {1: "refused"} and adapters.live() is None and "v1" not in slots.loaded
    for _ in range(2):
        ready_sample(store)
    run_until(loop, lambda: adapters.live() == 2 and not loop.busy)  # the step, its commit included, is over
    assert gate.reviewed == [(1, None), (2, None)]
    assert trainer.resumed == [None, None]  # v1 is not what serves: the trainer went back to the base
    assert adapter_states(store) == {1: "refused", 2: "live"}


def versions(tmp_path: Path, store: Store, n: int) -> Path:
    root = tmp_path / "adapters"
    for v in range(1, n + 1):
        path = tiny_lora(root, v)
        asyncio.run(store.record_step(StepRecord(version=v, parent=v - 1 or None, started_at=time.time(),
                                                 method="binary", call_ids=(), outcome="committed", path=str(path))))
    return root


def test_rollback_refuses_what_was_refused_or_rolled_back_from_unless_forced(parts, tmp_path):
    store, adapters, slots, _ = parts
    root = versions(tmp_path, store, 3)

    async def go():
        await adapters.go_live(1, str(root / "v1"))
        await adapters.go_live(2, str(root / "v2"))
        assert adapter_states(store) == {1: "committed", 2: "live", 3: "committed"} and slots.loaded == ["v2"]
        await adapters.rollback(1)
        assert adapters.live() == 1 and adapter_states(store)[2] == "retired"
        with pytest.raises(AdapterError, match="v2 was rolled back from; .*rollback 2 --force"):
            await adapters.rollback(2)
        await adapters.refuse(3, "replies collapsed", {"collapse": True})
        with pytest.raises(AdapterError, match="v3 was refused: replies collapsed"):
            await adapters.rollback(3)
        assert adapters.live() == 1
        out = await adapters.rollback(3, force=True)  # forced: as promote, the gate overridden
        assert adapters.live() == 3 and out >= 0
        await adapters.rollback(None)
        assert adapters.live() is None and slots.active is None and "live" not in adapter_states(store).values()

    asyncio.run(go())
    promoted = query(store.db_path, "SELECT payload FROM events WHERE kind = 'adapter.promoted'")
    assert len(promoted) == 1 and "replies collapsed" in promoted[0]["payload"]


def test_prune_keeps_the_newest_good_and_refused_versions_the_pinned_and_the_live_one(parts, tmp_path):
    store, adapters, _, _ = parts  # keep=2
    root = versions(tmp_path, store, 7)

    async def go():
        await adapters.go_live(1, str(root / "v1"))
        await adapters.pin(2)
        for v in (5, 6, 7):
            await adapters.refuse(v, "replies collapsed", {})
        return await adapters.prune()

    assert sorted(asyncio.run(go())) == [5]
    states = adapter_states(store)
    assert states == {1: "live", 2: "committed", 3: "committed", 4: "committed", 5: "pruned", 6: "refused",
                      7: "refused"}
    assert not (root / "v5").exists() and (root / "v6").exists()


def test_restore_after_a_restart_never_serves_a_refused_or_retired_version(parts, tmp_path):
    store, adapters, slots, _ = parts
    root = versions(tmp_path, store, 4)

    async def go():
        await adapters.go_live(3, str(root / "v3"))
        await adapters.rollback(2)  # v3 retired
        await adapters.refuse(4, "replies collapsed", {})
        return adapters

    asyncio.run(go())
    (root / "v2" / "adapter_model.safetensors").write_bytes(b"torn")  # the live version no longer loads
    restarted = AdapterManager(Slots(), store, root, keep=2)  # type: ignore[arg-type]
    assert asyncio.run(restarted.restore()) == 1  # the newest committed one below it; not v3, not v4
    assert adapter_states(store)[1] == "live"
