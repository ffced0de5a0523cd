"""Cell files, aggregation over seeds, the summary JSON and the plot.

Layout under the output dir:
  cells/<scenario>/<method>/seed<k>.json   one finished cell (written atomically, never partial)
  summary.json                             every scenario × method: curve mean and 95% interval
  <scenario>.png                           score vs interactions, all methods side by side
A curve is a step function: at interaction x the score is that of the newest version evaluated at
or before x. Seeds are averaged per x; the interval is mean ± t(0.975, n−1)·sd/√n.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import textwrap
from pathlib import Path
from typing import Any

from .harness import Cell

# Two-sided 95% Student-t quantiles by degrees of freedom (scipy is not a dependency).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    if df < 1:
        return float("nan")
    return _T975.get(df) or next((v for k, v in sorted(_T975.items()) if k >= df), 1.96)


def cell_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.scenario / cell.method / f"seed{cell.seed}.json"


def write_cell(out: Path, cell: Cell, record: dict[str, Any]) -> Path:
    path = cell_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # a cell file is whole or absent
    return path


def read_cell(out: Path, cell: Cell) -> dict[str, Any] | None:
    path = cell_path(out, cell)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it to run the cell again") from None


def all_cells(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*/*/seed*.json"))]


def step_curve(curve: list[dict[str, Any]], interactions: int) -> list[float]:
    """Score at x = 0..interactions: the newest evaluation at or before x."""
    points = sorted((p["interaction"], p["score"]) for p in curve)
    out, j, current = [], 0, points[0][1]
    for x in range(interactions + 1):
        while j < len(points) and points[j][0] <= x:
            current = points[j][1]
            j += 1
        out.append(current)
    return out


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan"), float("nan")
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def summarize(cells: list[dict[str, Any]], expected: list[Cell] | None = None) -> dict[str, Any]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["cell"]["scenario"], c["cell"]["method"]), []).append(c)
    summary: dict[str, Any] = {"scenarios": {}, "missing": []}
    for (scen, method), members in sorted(groups.items()):
        n_int = max(m["config"]["interactions"] for m in members)
        curves = [step_curve(m["curve"], n_int) for m in members]
        per_x = [mean_ci([c[x] for c in curves]) for x in range(n_int + 1)]
        steps = [s for m in members for s in m["steps"] if s["outcome"] == "committed"]

        def avg(key: str) -> float | None:
            vals = [s["metrics"][key] for s in steps if key in s["metrics"]]
            return statistics.fmean(vals) if vals else None

        summary["scenarios"].setdefault(scen, {})[method] = {
            "seeds": sorted(m["cell"]["seed"] for m in members),
            "interactions": n_int,
            "mean": [p[0] for p in per_x], "low": [p[1] for p in per_x], "high": [p[2] for p in per_x],
            "before": mean_ci([c[0] for c in curves]), "final": mean_ci([c[-1] for c in curves]),
            # The score averaged over the whole run (area under the curve / N): how soon it learned.
            "run_mean": mean_ci([statistics.fmean(c) for c in curves]),
            "steps_per_seed": [sum(s["outcome"] == "committed" for s in m["steps"]) for m in members],
            "samples_used_per_seed": [sum(s["samples"] for s in m["steps"] if s["outcome"] == "committed")
                                      for m in members],
            "failed_steps": sum(s["outcome"] != "committed" for m in members for s in m["steps"]),
            "gate": [m["config"].get("gate", False) for m in members],
            "promoted_per_seed": [len(m.get("versions", {}).get("promoted", [])) for m in members],
            "refused_per_seed": [len(m.get("versions", {}).get("refused", {})) for m in members],
            "mean_drift": avg("drift"), "mean_entropy": avg("entropy"),
            "wall_s_per_seed": [round(m["wall_s"], 1) for m in members],
        }
    have = {(c["cell"]["scenario"], c["cell"]["method"], c["cell"]["seed"]) for c in cells}
    summary["missing"] = [c.key for c in expected or [] if (c.scenario, c.method, c.seed) not in have]
    return summary


def plot(summary: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per scenario: mean score vs interactions with its 95% band, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for scen, methods in summary["scenarios"].items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for method, s in methods.items():
            xs = list(range(len(s["mean"])))
            line, = ax.step(xs, s["mean"], where="post", label=f"{method} (n={len(s['seeds'])})")
            if len(s["seeds"]) > 1:
                ax.fill_between(xs, s["low"], s["high"], step="post", alpha=0.15, color=line.get_color())
        missing = [k for k in summary["missing"] if k.startswith(f"{scen}/")]
        title = f"{scen}: held-out score vs interactions (mean, 95% interval over seeds)"
        if missing:
            by_method: dict[str, list[str]] = {}
            for k in missing:
                _, method, seed = k.split("/")
                by_method.setdefault(method, []).append(seed.removeprefix("seed"))
            text = "; ".join(f"{m} seed {','.join(s)}" for m, s in by_method.items())
            title += "\n" + textwrap.fill(f"missing cells: {text}", 110)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("interactions")
        ax.set_ylabel("score (0..1)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = out / f"{scen}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def write_summary(out: Path, expected: list[Cell]) -> tuple[dict[str, Any], list[Path]]:
    summary = summarize(all_cells(out), expected)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary, plot(summary, out)


def markdown_table(summary: dict[str, Any]) -> str:
    """Per scenario and method: seeds, score before/after with 95% intervals, steps, samples, time."""

    def ci(t: list[float]) -> str:
        m, lo, hi = t
        return f"{m:.3f}" if math.isnan(lo) else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"

    def opt(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    lines = ["| scenario | method | seeds | score before | score after N interactions (95% CI) "
             "| mean score over the run (95% CI) | N | steps/seed | promoted/refused per seed | samples used/seed "
             "| mean drift | mean entropy | wall min/cell |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for scen, methods in summary["scenarios"].items():
        for method, s in methods.items():
            wall = statistics.fmean(s["wall_s_per_seed"]) / 60
            gated = ",".join(f"{p}/{r}" if g else "no gate" for p, r, g in
                             zip(s.get("promoted_per_seed", []), s.get("refused_per_seed", []), s.get("gate", [])))
            lines.append(
                f"| {scen} | {method} | {','.join(map(str, s['seeds']))} | {ci(s['before'])} | {ci(s['final'])} "
                f"| {ci(s['run_mean'])} "
                f"| {s['interactions']} | {','.join(map(str, s['steps_per_seed']))} "
                f"| {gated} "
                f"| {','.join(map(str, s['samples_used_per_seed']))} | {opt(s['mean_drift'], '.2g')} "
                f"| {opt(s['mean_entropy'], '.2f')} | {wall:.1f} |")
    return "\n".join(lines)
