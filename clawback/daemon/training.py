"""Background training: ready samples -> one step on the Ray actor -> adapter vN+1 -> live.

Runs as an asyncio task in the daemon; the step itself runs in the trainer actor's process, so
serving never waits for it. Per step:
  1. take `batch_size` ready samples (only non-zero signals are ever `ready`), dropping with
     reason `stale` those served more than `max_staleness` versions ago (younger ones are
     corrected by truncated importance sampling in the loss);
  2. the actor trains `v{N+1}` and returns its files through Ray's object store (the actor may
     be on another node: no shared filesystem); the daemon commits them atomically into its
     adapters dir;
  3. the daemon validates and loads it beside the live version; only then the store commits the
     version and marks its samples consumed (one transaction);
  4. with a gate (clawback.daemon.gate) the version is a candidate until the gate has compared it
     with the live one: promoted, new requests go to it; refused, it stays on disk out of service
     and the next step trains from the live version again. Without a gate it goes live at once.
  5. the preference notes are checked against the version that went live (retirement.py): a note
     it follows without being told retires while it serves. A version put live by hand
     (`check_notes`, after a promote) and the live version at start-up (a restart may have cut a
     check short) are checked between steps.
Rated samples the gate holds out for its preference replay are dropped with reason `held_out`.
A sample the trainer cannot use (empty prompt or response, logprobs that do not match its tokens)
is quarantined with its reason before it reaches a step. A step that fails (actor crash, NaN, a
version that does not load) is recorded with its error; the actor goes back to the live version,
the loop waits before the next try (doubling from `retry_s` up to `retry_max_s`), and a sample
that was in `quarantine_after` failed steps is quarantined with the last error, so that one bad
sample cannot hold up the samples behind it. The actor starts lazily, at the first full batch,
and resumes from the live version, whose files the daemon sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from clawback.records import ReadySample, StepRecord, TrainResult, Version
from clawback.trainer.config import TrainConfig
from clawback.trainer.step import sample_problem

from .adapters import AdapterManager
from .gate import CandidateGate
from .retirement import NoteRetirement
from .store import Store

log = logging.getLogger(__name__)


class TrainerHandle(Protocol):
    """The trainer worker (`clawback.trainer.worker.TrainerWorker`) as the loop drives it: in a Ray
    actor (`RayTrainer`, the daemon's), or in a thread of this process (the simulator's)."""

    async def resume(self, version: int | None, files: dict[str, bytes] | None) -> int | None: ...

    async def ping(self) -> int | None: ...  # the version it stands on

    async def train(self, samples: Sequence[ReadySample], version: int, meta: dict[str, object]) -> TrainResult: ...

    async def close(self) -> None: ...


# Starts a trainer; blocking (Ray start-up, model load), so the loop runs it in a thread.
TrainerStarter = Callable[[], TrainerHandle]


class RayTrainer:
    """A `TrainerWorker` Ray actor behind `TrainerHandle`: each call is one actor task."""

    def __init__(self, actor: Any) -> None:  # Any: a Ray actor handle, its methods made at run time
        self.actor = actor

    async def resume(self, version: int | None, files: dict[str, bytes] | None) -> int | None:
        return await self.actor.resume.remote(version, files)

    async def ping(self) -> int | None:
        return await self.actor.ping.remote()

    async def train(self, samples: Sequence[ReadySample], version: int, meta: dict[str, object]) -> TrainResult:
        return await self.actor.train.remote(list(samples), version, meta)

    async def close(self) -> None:
        await self.actor.close.remote()


@dataclass(frozen=True)
class Trained:
    """A trained version that went live."""

    version: Version
    samples: int
    mean_reward: float
    metrics: dict[str, float]


@dataclass(frozen=True)
class Refused:
    """A trained version the gate refused, and why."""

    version: Version
    reason: str


class TrainingLoop:
    def __init__(self, store: Store, adapters: AdapterManager, cfg: TrainConfig,
                 start_worker: TrainerStarter, on_trained: Callable[[Trained], None] = lambda _: None,
                 poll_s: float = 10.0, retry_s: float = 5.0, retry_max_s: float = 600.0,
                 quarantine_after: int = 3, gate: CandidateGate | None = None,
                 on_refused: Callable[[Refused], None] = lambda _: None,
                 retirement: NoteRetirement | None = None) -> None:
        self.store, self.adapters, self.cfg = store, adapters, cfg
        self.retry_s, self.retry_max_s, self.quarantine_after = retry_s, retry_max_s, quarantine_after
        self.failed_in_a_row = 0
        self._failed_steps: Counter[str] = Counter()  # call id -> failed steps it was in
        self.start_worker = start_worker
        self.gate = gate  # None: every version goes live as soon as it loads
        self.retirement = retirement  # checks the preference notes against each version that goes live
        self.on_refused = on_refused
        self.on_trained = on_trained
        self.poll_s = poll_s
        self.worker: TrainerHandle | None = None
        self._wake = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0
        self.failures = 0
        self.busy = False
        self.last_metrics: dict[str, float] = {}
        self.trainer_node: str | None = None  # the Ray node the last step ran on
        self._notes_to_check: list[int] = []  # versions put live outside a step

    def check_notes(self, version: int) -> None:
        """Check the preference notes against `version` between steps (it went live by hand)."""
        if self.retirement is not None and version not in self._notes_to_check:
            self._notes_to_check.append(version)
            self._wake.set()

    def wake(self) -> None:
        """Thread-safe: a sample became ready (called from the store's writer thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        live = self.adapters.live()
        if live is not None:
            self.check_notes(live)
        while True:
            self._wake.clear()
            try:
                while self._notes_to_check and self.retirement is not None:  # never raises
                    version = self._notes_to_check.pop(0)
                    if self.adapters.live() == version:  # not rolled back meanwhile
                        await self.retirement.check(version)
                batch = await self._next_batch()
                if batch:
                    if await self.step(batch) is None:
                        await asyncio.sleep(self.retry_delay())
                    continue  # there may be another full batch waiting
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("training loop error")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    def retry_delay(self) -> float:
        """Seconds to wait after the last failed step: doubles with each failure in a row, capped."""
        return min(self.retry_max_s, self.retry_s * 2 ** max(0, self.failed_in_a_row - 1))

    async def _next_batch(self) -> list[ReadySample]:
        if await asyncio.to_thread(self.store.ready_count) < self.cfg.batch_size:
            return []
        rows = await asyncio.to_thread(self.store.ready_samples, self.cfg.batch_size * 4)
        live = self.adapters.live() or 0
        stale = [r.call_id for r in rows if live - (r.adapter_version or 0) > self.cfg.max_staleness]
        unusable = [r.call_id for r in rows if self.cfg.method == "opd" and r.teacher_logprobs is None]
        held = [r.call_id for r in rows if self.gate is not None and self.gate.holds_out(r)]
        for call_ids, reason in ((held, "held_out"), (stale, "stale"), (unusable, "no_teacher_for_opd")):
            if call_ids:
                await self.store.drop_samples(call_ids, reason)
        skip = set(stale) | set(unusable) | set(held)
        problems: dict[str, list[str]] = {}
        for r in rows:
            problem = None if r.call_id in skip else sample_problem(r, self.cfg.method)
            if problem is not None:
                problems.setdefault(problem, []).append(r.call_id)
                skip.add(r.call_id)
        for problem, call_ids in problems.items():
            await self.store.drop_samples(call_ids, f"untrainable: {problem}", "quarantined")
        usable = [r for r in rows if r.call_id not in skip]
        return usable[: self.cfg.batch_size] if len(usable) >= self.cfg.batch_size else []

    async def _worker(self) -> TrainerHandle:
        if self.worker is None:
            self.worker = await asyncio.to_thread(self.start_worker)
            await self._resume(self.worker, self.adapters.live())
        return self.worker

    async def _resume(self, worker: TrainerHandle, version: int | None) -> None:
        await worker.resume(version, await self.adapters.files(version))

    async def step(self, batch: list[ReadySample]) -> dict[str, float] | None:
        self.busy = True
        started = time.time()
        parent = self.adapters.live()
        version = await asyncio.to_thread(self.adapters.next_version)
        call_ids = tuple(s.call_id for s in batch)
        reward_mean = sum(s.reward for s in batch) / len(batch)
        meta = {"method": self.cfg.method, "samples": len(batch), "call_ids": list(call_ids),
                "reward_mean": reward_mean}
        step = StepRecord(version=version, parent=parent, started_at=started, method=self.cfg.method,
                          call_ids=call_ids, outcome="failed")
        try:
            worker = await self._worker()
            if await worker.ping() != parent:  # e.g. after a rollback: train from what serves
                await self._resume(worker, parent)
            result = await worker.train(batch, version, meta)
            self.trainer_node = result.node
            path = await self.adapters.receive(version, result.files)
            step = replace(step, path=path, metrics=result.metrics)
            await self.adapters.load(version, path)
        except Exception as e:
            self.failures += 1
            self.failed_in_a_row += 1
            log.error("training step for v%d failed (%d in a row): %s", version, self.failed_in_a_row, e)
            step = replace(step, error=f"{type(e).__name__}: {e}"[:1000])
            await self.store.record_step(step)
            await self._quarantine_repeat_failures(call_ids, step.error or type(e).__name__)
            await self._recover(parent, e)
            self.busy = False
            return None
        self.steps += 1
        self.failed_in_a_row = 0
        for call_id in call_ids:
            self._failed_steps.pop(call_id, None)
        try:
            # With a gate the version is a candidate until the review below decides.
            await self.store.record_step(replace(step, outcome="committed", candidate=self.gate is not None))
            if self.gate is not None:
                verdict = await self.gate.review(version, parent, result.metrics)
                if not verdict.promote:
                    await self.adapters.refuse(version, verdict.reason, verdict.report.json())
                    self.on_refused(Refused(Version(version), verdict.reason))
                    return None
                await self.adapters.record_gate(version, verdict.report.json())
            swap_s = await self.adapters.go_live(version, path)
            if self.retirement is not None:  # never raises: a failed check leaves the notes as they were
                await self.retirement.check(version)
        finally:
            self.busy = False
        pruned = await self.adapters.prune()  # retention: newest K good versions + pinned + live
        if pruned:
            log.info("pruned adapter versions %s", pruned)
        metrics = {**result.metrics, "swap_s": swap_s}
        self.last_metrics = metrics
        self.on_trained(Trained(Version(version), len(batch), reward_mean, metrics))
        return metrics

    async def close(self, timeout_s: float = 30.0) -> None:
        """Let the actor remove its private dir before Ray goes down (a step under way runs out first)."""
        if self.worker is not None:
            try:
                await asyncio.wait_for(self.worker.close(), timeout_s)
            except Exception as e:
                log.warning("trainer actor did not close cleanly: %s", e)

    async def _quarantine_repeat_failures(self, call_ids: tuple[str, ...], error: str) -> None:
        self._failed_steps.update(call_ids)
        doomed = [c for c in call_ids if self._failed_steps[c] >= self.quarantine_after]
        if doomed:
            await self.store.drop_samples(doomed, f"training failed {self.quarantine_after} times: {error}"[:500],
                                          "quarantined")
            for call_id in doomed:
                del self._failed_steps[call_id]

    async def _recover(self, parent: int | None, error: Exception) -> None:
        """After a failed step the actor must not keep weights no version holds."""
        if self.worker is None:
            return
        try:
            await self._resume(self.worker, parent)
        except Exception:  # the actor itself is gone (killed, OOM): start a fresh one next time
            log.warning("trainer actor lost (%s); it restarts at the next batch", error)
            self.worker = None
