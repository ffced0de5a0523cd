"""The dashboard's pieces that need no browser: the untagged-calls warning, and a non-editable
install ships every template, script, style, vendored library and license file (package data
declared in pyproject.toml). The page itself is tested in Chromium (tests/e2e/test_dashboard.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from clawback.daemon.dashboard_views import QUIET_HOUR_S, untagged_only

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0


def test_untagged_warning_only_when_no_tagged_main_call_in_the_last_hour():
    assert untagged_only(NOW - 60, None, NOW)  # untagged calls, never a tagged one
    assert untagged_only(NOW - 60, NOW - QUIET_HOUR_S - 1, NOW)  # the last tagged one is over an hour old
    assert not untagged_only(NOW - 60, NOW - 120, NOW)  # a tagged main call in the last hour
    assert not untagged_only(None, None, NOW)  # nothing at all: nothing to warn about
    assert not untagged_only(NOW - QUIET_HOUR_S - 1, None, NOW)  # untagged calls, but not lately


def test_wheel_ships_dashboard_assets(tmp_path: Path):
    src = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "clawback", src / "clawback", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("clawback-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    wanted = {p.relative_to(ROOT).as_posix()
              for folder in ("templates", "static") for p in (ROOT / "clawback" / "daemon" / folder).rglob("*")
              if p.is_file()}
    assert any(name.endswith("htmx.LICENSE") for name in wanted)  # the vendored libraries' licenses too
    assert wanted <= shipped, sorted(wanted - shipped)


def test_simulate_summary_from_the_data_dir(tmp_path: Path):
    from clawback.daemon.dashboard_views import simulate_summary

    assert simulate_summary(tmp_path) is None  # no simulate run here: no table
    (tmp_path / "simulate").mkdir()
    (tmp_path / "simulate" / "summary.json").write_text(json.dumps({"scenarios": {"teacher": {
        "combined": {"seeds": [1, 2, 3], "mean": [0.25, 0.5, 0.75]},
        "none": {"seeds": [1, 2, 3], "mean": [0.25, 0.25, 0.25]}}}, "missing": []}))
    rows = simulate_summary(tmp_path)
    assert rows == [{"scenario": "teacher", "method": "combined", "seeds": 3, "before": 0.25, "after": 0.75},
                    {"scenario": "teacher", "method": "none", "seeds": 3, "before": 0.25, "after": 0.25}]


def test_chart_series_keep_their_order_and_colours_through_the_template():
    """The template's `tojson` sorts object keys: with series as a dict, "bad" came first and took
    the first colour (green). Each series now carries its own colour, in order."""
    from jinja2 import Environment

    from clawback.daemon.dashboard_views import chart as make_chart

    chart = make_chart("feedback", [0, 1], ["base", "v1"], {"good": [0.5, 0.75], "bad": [0.25, 0.0], "corrections": [0, 0]})
    drawn = json.loads(Environment().from_string("{{ c | tojson }}").render(c=chart))
    assert [(s["label"], s["color"]) for s in drawn["series"]] == [("good", "#1a7f4b"), ("bad", "#b3261e"),
                                                                    ("corrections", "#c80")]
    assert drawn["series"][0]["values"] == [0.5, 0.75]


def test_health_shows_how_many_samples_distil_the_top_k_and_why_others_do_not():
    """A user sees when samples train token-level OPD (the weaker signal) and why."""
    from jinja2 import Environment, FileSystemLoader

    from clawback.daemon.display import ago, sample_reason, sample_state

    env = Environment(loader=FileSystemLoader(ROOT / "clawback" / "daemon" / "templates"), autoescape=True)
    env.filters.update(ago=ago, sample_reason=sample_reason, sample_state=sample_state,
                       pct=lambda x: "–" if x is None else f"{100 * x:.0f}%")
    health = {"model": "m", "engine": "vllm", "live": None, "extension_connections": 1, "main_calls": 3, "paired": 3,
              "awaiting": 0, "untagged_calls": 0, "last_main_at": None, "untagged_only": False, "samples": {},
              "dropped_samples": {}, "ready": 3, "batch_size": 16, "training": True, "training_now": False,
              "judge": "off", "judging": 0, "dropped": {}, "queue_depth": 0}
    opd = {"top_k": 3, "token_level": 1, "token_level_share": 0.25,
           "token_level_reasons": {"candidate_scoring_failed": 1}}
    html = env.get_template("ui/part_health.html").render(p={**health, "opd": opd})
    assert "3 top-K · 1 token-level" in html and "25% of the samples with a teacher" in html
    assert "1 token-level: the engine could not score the teacher" in html
    empty = {"top_k": 0, "token_level": 0, "token_level_share": None, "token_level_reasons": {}}
    assert "no sample with a teacher yet" in env.get_template("ui/part_health.html").render(p={**health, "opd": empty})
