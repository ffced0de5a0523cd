"""Serving before training on a shared machine: threads, niceness, and yielding while requests run.

On a CPU box the engine (decoding in the daemon's process) and the trainer (a Ray actor, its own
process) compete for the same few cores, and torch's default of one thread per core makes each
oversubscribe them: measured on 2 shared cores, 8 tokens took 27-29 s with the default thread count
and 0.8-1.2 s with one thread (an OpenMP barrier stalls whenever any of its cores is taken).
`thread_budget` therefore splits the cores on purpose, the trainer lowers its own CPU priority
(`TRAINER_NICE`), and on the daemon's node it waits before each micro-batch and each decoder layer
(forward, and the backward's recomputation under checkpointing) while requests are being served. The daemon publishes its number of requests in flight through `ServingGauge`, an 8-byte
memory-mapped file: an update is a store into shared memory, no system call.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import time
from pathlib import Path

log = logging.getLogger(__name__)

TRAINER_NICE = 10  # CFS weight 110 against the engine's 1024: on a shared core serving gets ~90%
YIELD_POLL_S = 0.01
# While requests keep coming, the next piece of work (a micro-batch, a layer) still starts after
# waiting this many times as long as the work since the last wait took (at least MIN_YIELD_S), so
# training slows down under load but never stops.
YIELD_FACTOR = 4.0
MIN_YIELD_S = 1.0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def thread_budget(cores: int, training: bool, engine_threads: int = 0, trainer_threads: int = 0) -> tuple[int, int]:
    """torch threads for (engine, trainer); an explicit setting (> 0) wins over the rule.

    One core is left to the daemon's event loop, HTTP and store writer where there are 3 or more;
    with training on, the engine gets the larger half of the rest and the trainer the smaller; without
    it the engine gets them all but that one. On 1-2 cores both get a single thread: decoding the small
    models a CPU serves gains nothing from a second thread and loses its tail latency when the
    other core is busy (bench/README.md, `serve_overhead.py`: threads).
    """
    if cores <= 2:
        engine, trainer = 1, 1
    else:
        spare = cores - 1
        engine = (spare + 1) // 2 if training else spare
        trainer = max(1, spare - engine)
    return engine_threads or engine, trainer_threads or trainer


def lower_priority(daemon_pid: int | None, nice: int = TRAINER_NICE) -> None:
    """Lower this process's CPU priority. With autogroup scheduling (Linux desktops) nice only
    ranks processes of one session against each other, so when this process is in another
    session's group than the daemon's (Ray starts its workers that way) that group is lowered too."""
    with contextlib.suppress(OSError):
        os.nice(nice)
    if daemon_pid is not None and _autogroup("self") not in (None, _autogroup(daemon_pid)):
        with contextlib.suppress(OSError):
            Path("/proc/self/autogroup").write_text(str(nice))


def _autogroup(pid: int | str) -> str | None:
    try:
        return Path(f"/proc/{pid}/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


class ServingGauge:
    """The daemon's count of requests in flight (and its pid), readable by another process on the
    same node."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 16)
            self._map = mmap.mmap(fd, 16)
        finally:
            os.close(fd)
        struct.pack_into("qq", self._map, 0, 0, os.getpid())

    def set(self, n: int) -> None:
        struct.pack_into("q", self._map, 0, n)

    def close(self) -> None:
        self._map.close()


class ServingPriority:
    """The trainer's side: `wait()` (before each micro-batch and each decoder layer) returns once
    nothing is being served, or after YIELD_FACTOR times the work since the last wait (at least
    MIN_YIELD_S)."""

    def __init__(self, path: str | Path | None) -> None:
        self._map: mmap.mmap | None = None
        if path is not None and Path(path).is_file():  # absent on another node: nothing to yield to
            with Path(path).open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 16, access=mmap.ACCESS_READ)
        self._last = time.monotonic()
        self.waited_s = 0.0

    def start_step(self) -> None:
        self._last = time.monotonic()

    def daemon_pid(self) -> int | None:
        return struct.unpack_from("q", self._map, 8)[0] if self._map is not None else None

    def serving(self) -> int:
        return struct.unpack_from("q", self._map, 0)[0] if self._map is not None else 0

    def wait(self) -> None:
        now = time.monotonic()
        limit = now + max(MIN_YIELD_S, YIELD_FACTOR * (now - self._last))
        while self.serving() > 0 and time.monotonic() < limit:
            time.sleep(YIELD_POLL_S)
        self._last = time.monotonic()
        self.waited_s += self._last - now
