"""`clawback simulate` end to end on the tiny random model: the real daemon loop, 2 training steps,
scores, cell JSON, summary and plot; a second run skips the finished cells."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawback.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulate(model: Path, out: Path, *extra: str) -> int:
    return main(["simulate", "--model", str(model), "--scenario", "student", "--interactions", "4",
                 "--batch-size", "2", "--seeds", "1", "--max-tokens", "12", "--eval-tasks", "2",
                 "--out", str(out), *extra])


def test_simulate_trains_scores_and_resumes(tiny_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "sim"
    assert simulate(tiny_model_dir, out, "--method", "none,combined") == 0

    cell = json.loads((out / "cells/student/combined/seed1.json").read_text())
    committed = [s for s in cell["steps"] if s["outcome"] == "committed"]
    assert len(committed) == 2  # 4 interactions with a signal each, batch 2
    assert [p["version"] for p in cell["curve"]] == [None, 1, 2]  # base, then after every version
    assert all(0 <= p["score"] <= 1 and set(p["checks"]) >= {"no_bold", "shows_work"} for p in cell["curve"])
    assert sum(cell["reactions"].values()) == 4 and len(cell["interactions"]) == 4
    assert cell["samples"].get("consumed") == 4
    assert {"drift", "entropy", "loss"} <= set(committed[0]["metrics"])
    assert cell["wall_s"] > 0 and cell["train_config"]["method"] == "combined"

    summary = json.loads((out / "summary.json").read_text())
    combined = summary["scenarios"]["student"]["combined"]
    assert combined["seeds"] == [1] and len(combined["mean"]) == 5 and combined["steps_per_seed"] == [2]
    assert summary["scenarios"]["student"]["none"]["steps_per_seed"] == [0]
    assert summary["missing"] == []
    assert (out / "student.png").read_bytes()[:8] == PNG_MAGIC

    # Resumable: finished cells are skipped, a new method runs, the plot names what is missing.
    before = (out / "cells/student/combined/seed1.json").read_bytes()
    capsys.readouterr()
    assert simulate(tiny_model_dir, out, "--method", "combined,binary", "--plot-only") == 0
    assert "missing cells: student/binary/seed1" in capsys.readouterr().err
    assert simulate(tiny_model_dir, out, "--method", "combined") == 0
    assert "1 already finished, 0 to run" in capsys.readouterr().err
    assert (out / "cells/student/combined/seed1.json").read_bytes() == before


def test_bad_input_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path, capsys):
    assert simulate(tiny_model_dir, tmp_path, "--method", "sft") == 2
    assert "unknown method(s) sft" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "chess", "--out", str(tmp_path)]) == 2
    assert "unknown scenario chess" in capsys.readouterr().err


def test_changed_settings_do_not_mix_with_finished_cells(tiny_model_dir: Path, tmp_path: Path, capsys):
    assert simulate(tiny_model_dir, tmp_path, "--method", "none") == 0
    assert simulate(tiny_model_dir, tmp_path, "--method", "none", "--lr", "0.5") == 2
    assert "was run with other settings" in capsys.readouterr().err
