"""The in-thread stand-in for the trainer actor."""

from __future__ import annotations

import asyncio
import threading

from clawback.sim.local_worker import InThreadTrainer


class Recorder:
    """Stands in for TrainerWorker: records the thread each call runs on and their order."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.calls: list[int] = []

    def resume(self, version, files):
        self.threads.add(threading.get_ident())
        self.calls.append(version)
        return version


def test_calls_run_in_order_on_one_dedicated_thread():
    worker = Recorder()
    trainer = InThreadTrainer(worker)

    async def go() -> list[int]:
        return list(await asyncio.gather(*(trainer.resume(i, None) for i in range(8))))

    assert asyncio.run(go()) == list(range(8)) and worker.calls == list(range(8))
    assert len(worker.threads) == 1 and threading.get_ident() not in worker.threads
