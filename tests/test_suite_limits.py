"""The suite's own deadlines: however slow the machine measures, a wait is bounded."""

from __future__ import annotations

import pytest

from tests import conftest


def test_a_scaled_deadline_is_bounded_on_a_very_slow_machine(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(conftest, "slowdown", lambda: conftest.MAX_SLOWDOWN)
    assert conftest.scaled(30) == conftest.MAX_WAIT_S  # not 30 x 100 s
    assert conftest.scaled(2) == 200
    assert conftest.scaled(1200) == 1200  # a wait longer than the bound idle keeps its own
    assert conftest.MAX_WAIT_S < conftest.TEST_LIMIT_S < 90 * 60 / 2


def test_wait_for_gives_up_with_what_it_waited_for(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(conftest, "slowdown", lambda: conftest.MAX_SLOWDOWN)
    monkeypatch.setattr(conftest, "MAX_WAIT_S", 0.3)
    with pytest.raises(AssertionError, match="the impossible not met.*at most 0 s"):
        conftest.wait_for(lambda: False, timeout=0.1, what="the impossible", interval=0.05)
