"""`clawback simulate` end to end on a tiny random model: the real daemon loop with preference
notes, 2 top-K training steps, the probe on every version, greedy scores, sessions until
adaptation, cell JSON with its code stamp, summary and plot; a second run skips finished cells."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawback.cli import main
from tests.conftest import scaled

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def simulate(model: Path, out: Path, *extra: str) -> int:
    return main(["simulate", "--model", str(model), "--scenario", "sure", "--interactions", "4",
                 "--batch-size", "2", "--seeds", "1", "--max-tokens", "160", "--eval-tasks", "2",
                 "--out", str(out), *extra])


def test_simulate_trains_scores_and_resumes(ending_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "sim"
    # Without the gate every rated call trains and every version goes live: exact counts.
    assert simulate(ending_model_dir, out, "--method", "none,default", "--no-gate") == 0

    cell = json.loads((out / "cells/sure/default/seed1.json").read_text())
    committed = [s for s in cell["steps"] if s["outcome"] == "committed"]
    assert len(committed) == 2, cell["samples"]  # 4 interactions with a signal each, batch 2
    assert [p["interaction"] for p in cell["curve"]] == [0, 2, 4]  # greedy: before, then eval_points = 2
    # The probe: base, then every change of the notes (the first correction's note, before any
    # version), every version and every evaluation point (here the same interactions).
    assert [(p["interaction"], p["version"]) for p in cell["probe"]] == [(0, None), (1, None), (2, 1), (4, 2)]
    none = json.loads((out / "cells/sure/none/seed1.json").read_text())  # no notes, no versions
    assert [(p["interaction"], p["version"]) for p in none["probe"]] == [(0, None), (2, None), (4, None)]
    assert all(0 <= p["mass"] <= 1 and 0 <= p["mass_off"] <= 1 for p in cell["probe"])
    # Without the notes, before any version: the base model's prompt and weights, so its mass.
    base, noted = cell["probe"][0], cell["probe"][1]
    assert base["mass_off"] == base["mass"] and noted["mass_off"] == pytest.approx(base["mass"], abs=1e-6)
    assert all(p["mass_off"] == p["mass"] for p in none["probe"])  # no notes: one probe serves both
    assert all(0 <= p["score"] <= 1 and set(p["checks"]) == {"starts_with_sure", "shows_work"} for p in cell["curve"])
    assert sum(cell["reactions"].values()) == 4 and [r["meets"] for r in cell["interactions"]] == [False] * 4
    assert [r["right"] for r in cell["interactions"]] == [False] * 4 and all("right" in p for p in cell["curve"])
    # Every rated reply is kept, so a score can be read back reply by reply.
    assert all(isinstance(r["reply"], str) for r in cell["interactions"]) and any(r["reply"] for r in cell["interactions"])
    assert cell["samples"].get("consumed") == 4
    assert {"drift", "entropy", "loss", "topk_adv"} <= set(committed[0]["metrics"])  # top-K OPD trained
    assert cell["train_config"]["method"] == "combined" and cell["train_config"]["opd_top_k"] == 4
    assert cell["settings"]["memory"] and [n["text"] for n in cell["memory_notes"]] == [
        "Please start your reply with 'Sure!' and then work the problem out in full sentences, showing each "
        "calculation and the result."]
    # Retirement is checked on every version that went live; whichever way it went, the cell says.
    assert all(n["retired_by"] in (None, 1, 2) and n["active"] == (n["retired_by"] is None) for n in cell["memory_notes"])
    checks = cell["memory_checks"]  # the first note's correction trained v1: it was checked against it
    assert checks and checks[0]["version"] == 1 and {c["version"] for c in checks} <= {1, 2}
    assert {(c["note_id"], c["version"]) for c in checks if c["retired"]} == {
        (n["note_id"], n["retired_by"]) for n in cell["memory_notes"] if n["retired_by"] is not None}
    assert cell["code"]["stamp"] and cell["clawback_version"] and cell["wall_s"] > 0
    # The base model's evaluation is the same in every cell of a scenario: computed once.
    assert none["base_eval_from"] is None and cell["base_eval_from"] == "sure/none/seed1"
    assert cell["curve"][0] == none["curve"][0] and cell["eval_replies"]["before"] == none["eval_replies"]["before"]
    assert cell["resumed_at"] == [] and not list((out / ".work").glob("*/*/seed*"))  # finished: no work dir

    summary = json.loads((out / "summary.json").read_text())
    default = summary["scenarios"]["sure"]["default"]
    assert default["seeds"] == [1] and len(default["mean"]) == 5 and default["steps_per_seed"] == [2]
    assert default["sessions_to_adapt"] == {"1": None} and default["adapted"] == "0/1"  # capped: not adapted
    assert summary["scenarios"]["sure"]["none"]["steps_per_seed"] == [0]
    assert summary["missing"] == [] and summary["code_stamp"] == cell["code"]["stamp"]
    assert (out / "sure.png").read_bytes()[:8] == PNG_MAGIC

    # Resumable: finished cells are skipped, a new method runs, the plot names what is missing.
    before = (out / "cells/sure/default/seed1.json").read_bytes()
    capsys.readouterr()
    assert simulate(ending_model_dir, out, "--method", "default,binary", "--plot-only", "--no-gate") == 0
    assert "missing cells: sure/binary/seed1" in capsys.readouterr().err
    assert simulate(ending_model_dir, out, "--method", "default", "--no-gate") == 0
    assert "1 already finished, 0 to run" in capsys.readouterr().err
    assert (out / "cells/sure/default/seed1.json").read_bytes() == before


def test_a_stopped_cell_goes_on_from_its_last_interaction(ending_model_dir: Path, tmp_path: Path):
    """Killed (the whole process group, as a closed terminal does) after its second interaction,
    the cell goes on from its checkpoint: every interaction once, in order, and the daemon's
    versions and samples from before the kill are kept."""
    out = tmp_path / "sim"
    args = [sys.executable, "-m", "clawback.cli", "simulate", "--model", str(ending_model_dir), "--scenario", "sure",
            "--interactions", "4", "--batch-size", "1", "--seeds", "1", "--max-tokens", "160", "--eval-tasks", "2",
            "--eval-points", "1", "--method", "binary", "--no-gate", "--out", str(out)]
    saved = out / ".work/sure/binary/seed1/checkpoint/progress.json"
    run = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + scaled(600)
        while not (saved.exists() and json.loads(saved.read_text())["harness"]["next"] >= 2):
            assert run.poll() is None, run.stderr.read().decode() if run.stderr else "exited"
            assert time.monotonic() < deadline, "no checkpoint after the second interaction"
            time.sleep(0.2)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    before = json.loads(saved.read_text())["harness"]
    assert before["next"] >= 2 and not (out / "cells").exists()
    assert main(["simulate", *args[4:]]) == 0
    cell = json.loads((out / "cells/sure/binary/seed1.json").read_text())
    assert cell["resumed_at"] == [before["next"]]
    assert [r["i"] for r in cell["interactions"]] == [0, 1, 2, 3]
    assert cell["interactions"][: before["next"]] == before["interactions"]
    assert [p["interaction"] for p in cell["curve"]] == [0, 4] and cell["wall_s"] >= before["wall_s"]
    committed = [s["version"] for s in cell["steps"] if s["outcome"] == "committed"]
    assert committed == sorted(set(committed)) and cell["samples"].get("consumed", 0) == len(committed)
    assert not (out / ".work/sure/binary/seed1").exists()


def test_the_gate_is_on_by_default_and_each_cell_reports_its_versions(ending_model_dir: Path, tmp_path: Path, capsys):
    out = tmp_path / "sim"
    assert simulate(ending_model_dir, out, "--method", "binary", "--batch-size", "1") == 0
    cell = json.loads((out / "cells/sure/binary/seed1.json").read_text())
    assert cell["config"]["gate"] is True
    versions, committed = cell["versions"], [s["version"] for s in cell["steps"] if s["outcome"] == "committed"]
    # each version was decided: it went live (and may have been rolled back later: then also refused) or was refused
    assert set(versions["promoted"]) | {int(v) for v in versions["refused"]} == set(committed)
    assert all(versions["refused"].values()) and len(versions["gate_seconds"]) == len(committed)
    assert {int(v) for v in versions["gate"]} == set(committed)  # what the gate measured on each
    assert all("health" in r and "seconds" in r for r in versions["gate"].values())
    rated = 4 - cell["reactions"].get("moved_on", 0)
    assert cell["samples"].get("consumed", 0) == len(committed)  # batch 1: a step per trained sample
    assert len(committed) + cell["samples"]["dropped"].get("held_out", 0) <= rated
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("sure/binary/seed1:"))
    assert f"({len(versions['promoted'])} promoted, {len(versions['refused'])} refused)" in line
    # cells run before the gate existed count as ungated, so they never mix with gated ones
    assert simulate(ending_model_dir, out, "--method", "binary", "--batch-size", "1", "--no-gate") == 2
    assert "'gate': (True, False)" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(tiny_model_dir: Path, tmp_path: Path, capsys):
    assert simulate(tiny_model_dir, tmp_path, "--method", "sft") == 2
    assert "unknown method(s) sft" in capsys.readouterr().err
    assert main(["simulate", "--scenario", "chess", "--out", str(tmp_path)]) == 2
    assert "unknown scenario chess" in capsys.readouterr().err


def test_changed_settings_do_not_mix_with_finished_cells(tiny_model_dir: Path, tmp_path: Path, capsys):
    assert simulate(tiny_model_dir, tmp_path, "--method", "none") == 0
    assert simulate(tiny_model_dir, tmp_path, "--method", "none", "--lr", "0.5") == 2
    assert "was run with other settings" in capsys.readouterr().err
    cell = tmp_path / "cells/sure/none/seed1.json"
    ran = json.loads(cell.read_text())
    cell.write_text(json.dumps({**ran, "code": {**ran["code"], "stamp": "0" * 12}}))
    before = cell.read_bytes()
    assert simulate(tiny_model_dir, tmp_path, "--method", "none") == 2  # not skipped as if it were this code's
    assert f"was run by other code (stamp {'0' * 12}, now {ran['code']['stamp']})" in capsys.readouterr().err
    assert cell.read_bytes() == before


def test_simulate_shell_runs_end_to_end(embedded_model_dir: Path, tmp_path: Path):
    """The shell scenario on SmolLM2 (it rarely calls a tool: the run, not the success, is under test)."""
    from clawback.sim.shell import task_order
    from clawback.sim.shell_tasks import EVAL, TRAIN

    out = tmp_path / "sim"
    assert main(["simulate", "--model", str(embedded_model_dir), "--scenario", "shell", "--method", "none,binary",
                 "--interactions", "2", "--batch-size", "1", "--seeds", "1", "--max-tokens", "96",
                 "--eval-tasks", "2", "--eval-points", "1", "--out", str(out)]) == 0
    for method in ("none", "binary"):
        cell = json.loads((out / f"cells/shell/{method}/seed1.json").read_text())
        assert [p["interaction"] for p in cell["curve"]] == [0, 2] and cell["eval_tasks"] == 2
        assert all(0 <= p["score"] <= 1 for p in cell["curve"])
        assert [r["task"] for r in cell["interactions"]] == [t.key for t in task_order(1, 2)]
        assert {r["task"] for r in cell["interactions"]} <= {t.key for t in TRAIN}
        held_out = cell["eval_replies"]["last"]["episodes"]
        assert [e["task"] for e in held_out] == [t.key for t in EVAL[:2]] and all(e["why"] for e in held_out)
        assert all(r["meets"] == r["solved"] and r["why"] for r in cell["interactions"])
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["scenarios"]["shell"]) == {"none", "binary"} and summary["missing"] == []
