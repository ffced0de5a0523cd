"""The in-thread stand-in for the trainer actor."""

from __future__ import annotations

import asyncio
import threading

from clawback.sim.local_worker import InThreadActor


class Recorder:
    def __init__(self) -> None:
        self.threads: set[int] = set()

    def train(self, x: int, *, scale: int = 1) -> int:
        self.threads.add(threading.get_ident())
        return x * scale


def test_calls_run_in_order_on_one_dedicated_thread():
    obj = Recorder()
    actor = InThreadActor(obj)

    async def go() -> list[int]:
        return list(await asyncio.gather(*(actor.train.remote(i, scale=2) for i in range(8))))

    assert asyncio.run(go()) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert len(obj.threads) == 1 and threading.get_ident() not in obj.threads
