"""The trainer actor without Ray: the same `TrainerWorker`, its methods run in a thread.

`TrainingLoop` talks to its worker as to a Ray actor handle (`await worker.train.remote(...)`).
Starting Ray and a second process per simulated cell would cost more than the cell's training on
a laptop, so the simulator hands the loop this stand-in; everything else (batching, publishing,
validation, hot-swap) is the daemon's code path.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Callable

from clawback.trainer.config import TrainConfig


class InThreadActor:
    """`handle.method.remote(*args)` -> an awaitable running `obj.method(*args)` in a thread."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)
        return SimpleNamespace(remote=lambda *a, **k: asyncio.to_thread(fn, *a, **k))


def local_worker_starter(model_dir: str, cfg: TrainConfig, adapters_root: str, threads: int) -> Callable[[], Any]:
    def start() -> InThreadActor:  # blocking (model load): TrainingLoop runs it in a thread
        from clawback.trainer.worker import TrainerWorker

        return InThreadActor(TrainerWorker(model_dir, cfg, adapters_root, "cpu", threads))

    return start
