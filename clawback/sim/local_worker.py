"""The trainer without Ray: the same `TrainerWorker`, its methods run on a thread of this process.

The daemon's training loop drives a `TrainerHandle`; by default a Ray actor. Starting Ray and a
second process per simulated cell would cost more than the cell's training on a laptop, so the
simulator hands `build_state` this one instead; everything else (batching, publishing,
validation, hot-swap) is the daemon's code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from clawback.daemon.training import TrainerStarter
from clawback.records import ReadySample, TrainResult
from clawback.trainer.config import TrainConfig
from clawback.trainer.worker import TrainerWorker  # at import: a cell runs the code its stamp hashed

T = TypeVar("T")
P = ParamSpec("P")


class InThreadTrainer:
    """A `TrainerWorker` behind `TrainerHandle`, its calls run one at a time on one dedicated thread.

    One thread, like a Ray actor with max_concurrency=1, so every step allocates from the same
    malloc arena. (On asyncio's shared pool each step landed on another thread, and every thread's
    arena kept ~1.5 GB of freed training tensors: RSS grew by that much per step until the machine
    ran out of memory.)"""

    def __init__(self, worker: TrainerWorker) -> None:
        self.worker = worker
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawback-trainer")

    async def _run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        def call() -> T:
            try:
                return fn(*args, **kwargs)
            finally:
                _trim()

        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    async def resume(self, version: int | None, files: dict[str, bytes] | None) -> int | None:
        return await self._run(self.worker.resume, version, files)

    async def ping(self) -> int | None:
        return await self._run(self.worker.ping)

    async def train(self, samples: Sequence[ReadySample], version: int, meta: dict[str, object]) -> TrainResult:
        return await self._run(self.worker.train, samples, version, meta)

    async def close(self) -> None:
        await self._run(self.worker.close)


def _trim() -> None:
    """Hand freed heap back to the OS after each call (glibc keeps it otherwise)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # not glibc (musl): nothing to trim
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def in_thread_trainer(model_dir: str, cfg: TrainConfig, threads: int) -> TrainerStarter:
    def start() -> InThreadTrainer:  # blocking (model load): the training loop runs it in a thread
        # No adapters dir, as for the Ray actor: the worker keeps its own and versions reach the
        # daemon's dir as bytes (the same path as with a remote trainer).
        return InThreadTrainer(TrainerWorker(model_dir, cfg, None, "cpu", threads))

    return start
