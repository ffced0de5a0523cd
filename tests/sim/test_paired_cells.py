"""bench/paired_cells.py: pooling one method's cells from two folders by seed range, and only cells
of one code (or of stamps declared the same code, with the reason in the output)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _paired_cells():
    spec = importlib.util.spec_from_file_location("paired_cells", ROOT / "bench" / "paired_cells.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(folder: Path, method: str, seed: int, meets: list[bool], stamp: str, checked: bool = True) -> None:
    path = folder / "cells" / "sure" / method / f"seed{seed}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    its = [{"meets": m, "gate": None, "reply": "Sure! 2 + 2 = 4.", **({"right": m} if checked else {})} for m in meets]
    path.write_text(json.dumps({
        "cell": {"scenario": "sure", "method": method, "seed": seed}, "code": {"stamp": stamp},
        "interactions": its, "final_score": 0.5, "probe": [{"interaction": 0, "version": None, "mass": 0.1 * seed}]}))


def test_pooled_spec_takes_each_seed_from_its_folder(tmp_path: Path) -> None:
    pc = _paired_cells()
    a, b = tmp_path / "a", tmp_path / "b"
    for seed in (1, 2, 3):
        _cell(a, "default", seed, [True] * 4, "s1")  # every seed here meets every time
        _cell(b, "default_as_served", seed, [False] * 4, "s1")  # and never here
    pooled = pc.per_seed(f"{a}:default@1-2+{b}:default_as_served@3-3", "sure").by_seed
    assert pooled["meets"] == {1: 1.0, 2: 1.0, 3: 0.0} and pooled["right"] == pooled["meets"]
    assert pooled["adapted"] == {1: 1, 2: 1, 3: None}
    assert pooled["probe"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert pooled["probe_off"] == {}  # cells without the probe's notes-off mass: not read as 0
    # the plain form reads one folder, as before
    assert pc.per_seed(f"{b}:default_as_served", "sure").by_seed["meets"] == {1: 0.0, 2: 0.0, 3: 0.0}


@pytest.mark.parametrize("spec", ["{a}:default@1-x", "{a}:default@1-2+{a}:default@2-3"])
def test_pooled_spec_refuses_bad_ranges_and_overlaps(tmp_path: Path, spec: str) -> None:
    pc = _paired_cells()
    a = tmp_path / "a"
    for seed in (1, 2, 3):
        _cell(a, "default", seed, [True] * 4, "s1")
    with pytest.raises(SystemExit):
        pc.per_seed(spec.format(a=a), "sure")


def test_cells_of_other_code_pool_only_when_declared_the_same_and_why(tmp_path: Path, monkeypatch, capsys) -> None:
    pc = _paired_cells()
    a, b = tmp_path / "a", tmp_path / "b"
    for seed in (1, 2):
        _cell(a, "default", seed, [True] * 6, "s1")
        _cell(b, "default", seed + 2, [True] * 6, "s2")
        _cell(b, "memory", seed, [False] * 6, "s2")
        _cell(b, "memory", seed + 2, [False] * 6, "s2")
    spec = f"{a}:default@1-2+{b}:default@3-4"
    with pytest.raises(SystemExit, match="pools cells of code stamps s1, s2"):
        pc.per_seed(spec, "sure")
    equivalent, reasons = pc.equivalences(["s1=s2: only bench/ changed"])
    assert pc.per_seed(spec, "sure", equivalent=equivalent).stamps == {"s1", "s2"}
    monkeypatch.setattr(sys, "argv", ["paired_cells.py", spec, f"{b}:memory", "--scenario", "sure",
                                      "--equivalent", "s1=s2: only bench/ changed"])
    pc.main()
    out = capsys.readouterr().out
    assert "| sure | 4 | +1.000 [+1.000, +1.000]" in out and "| s1, s2 | s2 |" in out
    assert "Pooled as one code: s1 = s2: only bench/ changed" in out
    with pytest.raises(SystemExit, match="expected 'STAMP=STAMP"):
        pc.equivalences(["s1=s2"])  # no reason given


def test_cells_from_before_answers_were_checked_do_not_compare(tmp_path: Path, monkeypatch) -> None:
    pc = _paired_cells()
    a, b = tmp_path / "a", tmp_path / "b"
    _cell(a, "default", 1, [True] * 6, "s1")
    _cell(b, "memory", 1, [True] * 6, "s0", checked=False)
    assert pc.per_seed(f"{b}:memory", "sure").by_seed["right"] == {}  # correctness unknown: "–"
    monkeypatch.setattr(sys, "argv", ["paired_cells.py", f"{a}:default", f"{b}:memory", "--scenario", "sure"])
    with pytest.raises(SystemExit, match="before answers were checked"):
        pc.main()
