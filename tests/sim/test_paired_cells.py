"""bench/paired_cells.py: pooling one method's cells from two folders by seed range."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _paired_cells():
    spec = importlib.util.spec_from_file_location("paired_cells", ROOT / "bench" / "paired_cells.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(folder: Path, method: str, seed: int, meets: list[bool], stamp: str) -> None:
    path = folder / "cells" / "sure" / method / f"seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "cell": {"scenario": "sure", "method": method, "seed": seed}, "code": {"stamp": stamp},
        "interactions": [{"meets": m, "gate": None, "reply": "Sure! 2 + 2 = 4."} for m in meets],
        "final_score": 0.5, "probe": [{"interaction": 0, "version": None, "mass": 0.1 * seed}]}))


def test_pooled_spec_takes_each_seed_from_its_folder(tmp_path: Path) -> None:
    pc = _paired_cells()
    a, b = tmp_path / "a", tmp_path / "b"
    for seed in (1, 2, 3):
        _cell(a, "default", seed, [True] * 4, "s1")  # every seed here meets every time
        _cell(b, "default_as_served", seed, [False] * 4, "s2")  # and never here
    pooled = pc.per_seed(f"{a}:default@1-2+{b}:default_as_served@3-3", "sure")
    assert pooled["meets"] == {1: 1.0, 2: 1.0, 3: 0.0}
    assert pooled["adapted"] == {1: 1, 2: 1, 3: None}
    assert pooled["probe"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    # the plain form reads one folder, as before
    assert pc.per_seed(f"{b}:default_as_served", "sure")["meets"] == {1: 0.0, 2: 0.0, 3: 0.0}


@pytest.mark.parametrize("spec", ["{a}:default@1-x", "{a}:default@1-2+{a}:default@2-3"])
def test_pooled_spec_refuses_bad_ranges_and_overlaps(tmp_path: Path, spec: str) -> None:
    pc = _paired_cells()
    a = tmp_path / "a"
    for seed in (1, 2, 3):
        _cell(a, "default", seed, [True] * 4, "s1")
    with pytest.raises(SystemExit):
        pc.per_seed(spec.format(a=a), "sure")
