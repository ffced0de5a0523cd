"""Serving before training: the CPU budget, the gauge the daemon writes and the trainer reads, and
the trainer's wait between micro-batches."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clawback.trainer import priority
from clawback.trainer.priority import ServingGauge, ServingPriority, thread_budget


@pytest.mark.parametrize("cores, training, want", [
    (1, True, (1, 1)), (2, True, (1, 1)), (2, False, (1, 1)),
    (4, True, (2, 1)), (4, False, (3, 1)), (8, True, (4, 3)), (16, True, (8, 7)),
])
def test_thread_budget_leaves_a_core_to_the_daemon(cores: int, training: bool, want: tuple[int, int]):
    assert thread_budget(cores, training) == want
    engine, trainer = want
    if cores >= 3:
        assert engine + (trainer if training else 0) <= cores - 1


def test_explicit_thread_settings_win():
    assert thread_budget(16, True, engine_threads=2, trainer_threads=3) == (2, 3)


def test_gauge_is_read_by_another_process(tmp_path: Path):
    gauge = ServingGauge(tmp_path / "serving")
    gauge.set(3)
    assert ServingPriority(tmp_path / "serving").daemon_pid() == os.getpid()
    code = f"from clawback.trainer.priority import ServingPriority; print(ServingPriority({str(tmp_path / 'serving')!r}).serving())"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "3"
    assert oct((tmp_path / "serving").stat().st_mode & 0o777) == "0o600"


def test_wait_holds_while_serving_and_goes_on_when_it_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(priority, "MIN_YIELD_S", 3600.0)  # only the gauge can release it
    gauge = ServingGauge(tmp_path / "serving")
    waiter = ServingPriority(tmp_path / "serving")
    waiter.wait()  # nothing served: returns at once
    gauge.set(1)
    waiter.start_step()
    t = threading.Thread(target=waiter.wait)
    t.start()
    t.join(0.3)
    assert t.is_alive(), "a request is being served: the trainer waits"
    gauge.set(0)
    t.join(60)
    assert not t.is_alive()


def test_wait_is_bounded_so_training_cannot_starve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(priority, "MIN_YIELD_S", 0.05)
    ServingGauge(tmp_path / "serving").set(1)  # serving never stops
    waiter = ServingPriority(tmp_path / "serving")
    waiter.start_step()
    waiter.wait()
    assert waiter.waited_s > 0


def test_no_gauge_on_this_node_means_no_waiting(tmp_path: Path):
    waiter = ServingPriority(tmp_path / "absent")
    assert waiter.serving() == 0
    waiter.wait()


def test_lower_priority_raises_niceness():
    code = f"import os; from clawback.trainer.priority import lower_priority; lower_priority({os.getpid()}); print(os.nice(0))"
    before = os.nice(0)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert int(out) == min(19, before + priority.TRAINER_NICE)
