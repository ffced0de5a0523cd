"""Methods as bundles of settings, and the aggregation over seeds."""

from __future__ import annotations

import math

import pytest

from clawback.daemon.config import Settings
from clawback.sim.config import METHODS, SimConfig, parse_methods
from clawback.sim.results import mean_ci, step_curve


def test_seed_is_the_daemons_seed_preset():
    cfg = SimConfig(lr=3e-4, batch_size=8)
    s = Settings(**cfg.settings_for(METHODS["seed"], seed=2), no_auth=True)
    sig = s.signal_config()
    assert (sig.method, sig.teacher, sig.judge_context, sig.count_zero_signal, s.judge.backend) == (
        "combined", "base", "response_only", True, "off")
    tc = s.train_config()
    assert (tc.method, tc.tis_cap, tc.lr, tc.weight_decay, tc.betas, tc.batch_size, tc.seed) == (
        "combined", None, 1e-5, 0.1, (0.9, 0.98), 8, 2)
    combined = Settings(**cfg.settings_for(METHODS["combined"], seed=2), no_auth=True)
    assert (combined.train_config().lr, combined.train_config().tis_cap) == (3e-4, 2.0)
    assert combined.signal_config().teacher == "self" and combined.train.enabled
    none = Settings(**cfg.settings_for(METHODS["none"], seed=2), no_auth=True)
    assert not METHODS["none"].trains and not none.train.enabled


def test_method_lists():
    assert parse_methods("all") == ("none", "binary", "opd", "combined", "seed")
    assert parse_methods("combined, binary,combined") == ("combined", "binary")
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("")
    with pytest.raises(ValueError):
        SimConfig(interactions=0)


def test_step_curve_and_interval():
    curve = [{"interaction": 0, "score": 0.2}, {"interaction": 3, "score": 0.5}, {"interaction": 5, "score": 0.4}]
    assert step_curve(curve, 6) == [0.2, 0.2, 0.2, 0.5, 0.5, 0.4, 0.4]
    m, lo, hi = mean_ci([0.4, 0.5, 0.6])
    assert m == pytest.approx(0.5) and hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert math.isnan(mean_ci([0.3])[1])
