"""The trainer actor without Ray: the same `TrainerWorker`, its methods run in a thread.

`TrainingLoop` talks to its worker as to a Ray actor handle (`await worker.train.remote(...)`).
Starting Ray and a second process per simulated cell would cost more than the cell's training on
a laptop, so the simulator hands the loop this stand-in; everything else (batching, publishing,
validation, hot-swap) is the daemon's code path.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Callable

from clawback.trainer.config import TrainConfig
from clawback.trainer.worker import TrainerWorker  # at import: a cell runs the code its stamp hashed


class InThreadActor:
    """`handle.method.remote(*args)` -> an awaitable running `obj.method(*args)` on the actor's thread.

    One dedicated thread, like a Ray actor with max_concurrency=1: calls run one at a time, and
    every step allocates from the same malloc arena. (On asyncio's shared pool each step landed on
    another thread, and every thread's arena kept ~1.5 GB of freed training tensors: RSS grew by
    that much per step until the machine ran out of memory.)"""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawback-trainer")

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)

        def call(args: tuple, kwargs: dict) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                _trim()

        def remote(*args: Any, **kwargs: Any) -> Any:
            return asyncio.get_running_loop().run_in_executor(self._thread, call, args, kwargs)

        return SimpleNamespace(remote=remote)


def _trim() -> None:
    """Hand freed heap back to the OS after each call (glibc keeps it otherwise)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


def local_worker_starter(model_dir: str, cfg: TrainConfig, threads: int) -> Callable[[], Any]:
    def start() -> InThreadActor:  # blocking (model load): TrainingLoop runs it in a thread
        # No adapters dir, as for the Ray actor: the worker keeps its own and versions reach the
        # daemon's dir as bytes (the same path as with a remote trainer).
        return InThreadActor(TrainerWorker(model_dir, cfg, None, "cpu", threads))

    return start
