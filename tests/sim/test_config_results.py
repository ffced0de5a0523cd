"""Methods as bundles of settings, and the aggregation over seeds."""

from __future__ import annotations

import math

import pytest

from clawback.daemon.config import Settings
from clawback.sim.config import METHODS, SimConfig, parse_methods
from clawback.sim.results import mean_ci, step_curve


def test_seed_is_the_original_recipe_as_settings_values():
    cfg = SimConfig(lr=3e-4, batch_size=8)
    seed = METHODS["seed"]
    s = Settings(**cfg.settings_for(seed), no_auth=True)
    assert (s.method, s.teacher, s.judge_context, s.count_zero_signal, s.judge) == (
        "combined", "base", "response_only", True, "off")
    tc = cfg.train_config(seed, seed=2)
    assert (tc.method, tc.tis_cap, tc.lr, tc.weight_decay, tc.betas, tc.batch_size, tc.seed) == (
        "combined", None, 1e-5, 0.1, (0.9, 0.98), 8, 2)
    combined = cfg.train_config(METHODS["combined"], seed=2)
    assert (combined.lr, combined.tis_cap) == (3e-4, 2.0)
    assert not METHODS["none"].trains


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
