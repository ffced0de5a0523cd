"""Cell files, aggregation over seeds and the summary JSON (the plot: plot.py).

Layout under the output dir:
  cells/<scenario>/<method>/seed<k>.json   one finished cell (written atomically, never partial)
  summary.json                             per scenario × method: adaptation, curves, paired differences
  <scenario>.png                           probe and held-out score vs interactions, methods side by side

A reply **meets** the scenario when it has the preferred form and a right answer (scenarios.py,
answers.py). Primary metric, **sessions to adaptation**: the first session s (1-based) from which
every window of 4 consecutive sessions holds at least 3 replies that meet it, to the end of the run:
adaptation that lasts, not a streak that happens (with a 34% meet rate a first 3-in-a-row turns up
in a third of 16-session runs). A run whose last window falls short is *not adapted*: it is
counted as such and never enters a mean as a number. Beside it: the meet rate over the whole run
and over its last 8 sessions, and **correctness**, the share of replies whose answer is right
whatever their form.

Methods are compared **paired**: the same seed means the same tasks, order and user coins, so
per seed the difference method − comparator is taken and its mean gets a t-interval
(mean ± t(0.975, n−1)·sd/√n). Sessions-until-adaptation differences use the seeds where both
adapted (how many is reported beside them); over every shared seed, `adapt_order` counts the
seeds where the method adapted sooner, at the same session, later, or neither did (a run that
adapted is sooner than one that did not: an order, never a number for the capped run), with the
exact two-sided sign test on sooner against later (`sign_p`; ties and neither left out): the order
is decided when p < 0.05, which takes at least 6 seeds that differ, all one way.

Cells recorded before answers were checked have no per-reply `right`: their `meets` is the form
alone, their correctness is unknown ("–"), and they are not comparable with newer cells.

A summary only ever holds cells of one code stamp (stamp.py): by default the newest cell's;
cells of other code are listed as excluded, never mixed in.

A curve is a step function: at interaction x the value is that of the newest point at or before x.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypedDict, cast

from .cell_file import CellRecord, CurvePoint
from .harness import Cell
from .plot import plot

MeanCI = tuple[float, float, float]  # mean and its 95% interval (nan, nan with one value)
BeforeAfter = tuple[MeanCI, MeanCI]
HeldOutKey = Literal["meets", "right", "meets_off", "right_off"]
PairedMetric = Literal["sessions_to_adapt", "meets_rate", "meets_last", "right_rate", "broken_rate", "final_score",
                       "meets_off_gain", "right_off_gain", "probe_final", "probe_off_gain"]
PAIRED_METRICS: tuple[PairedMetric, ...] = (
    "sessions_to_adapt", "meets_rate", "meets_last", "right_rate", "broken_rate", "final_score", "meets_off_gain",
    "right_off_gain", "probe_final", "probe_off_gain")


class PairedDiff(TypedDict):
    """Per shared seed, a − b, and its mean with the 95% t-interval."""

    seeds: list[int]
    diffs: list[float]
    mean: float
    low: float
    high: float


class AdaptOrder(TypedDict):
    """Over shared seeds: how often a adapted sooner than b, at the same session, later, or neither did."""

    seeds: list[int]
    sooner: int
    same: int
    later: int
    neither: int
    sign_p: float


class Comparison(TypedDict):
    """One method against its comparator: each metric's paired difference, and adaptation's order."""

    sessions_to_adapt: PairedDiff | None
    meets_rate: PairedDiff | None
    meets_last: PairedDiff | None
    right_rate: PairedDiff | None
    broken_rate: PairedDiff | None
    final_score: PairedDiff | None
    meets_off_gain: PairedDiff | None
    right_off_gain: PairedDiff | None
    probe_final: PairedDiff | None
    probe_off_gain: PairedDiff | None
    adapt_order: AdaptOrder | None


class MethodSummary(TypedDict):
    """One scenario × method over its seeds: a row of the summary."""

    seeds: list[int]
    interactions: int
    sessions_to_adapt: dict[str, int | None]  # per seed; None = not adapted
    adapted: str  # "k/n"
    sessions_to_adapt_adapted: MeanCI | None
    meets_rate: MeanCI | None
    meets_last: MeanCI | None
    broken_rate: MeanCI | None
    right_rate: MeanCI | None
    meets_by_session: list[float]
    mean: list[float]  # the held-out score at x = 0..interactions, mean and band over seeds
    low: list[float]
    high: list[float]
    probe_mean: list[float] | None
    probe_off_mean: list[float] | None  # without the notes, over the cells that recorded it
    before: MeanCI
    final: MeanCI
    meets_before_after: BeforeAfter | None
    right_before_after: BeforeAfter | None
    meets_off_before_after: BeforeAfter | None
    right_off_before_after: BeforeAfter | None
    meets_off_gain: MeanCI | None
    right_off_gain: MeanCI | None
    meets_gain: MeanCI | None
    probe_off_gain: MeanCI | None
    right_gain: MeanCI | None
    run_mean: MeanCI
    steps_per_seed: list[int]
    samples_used_per_seed: list[int]
    failed_steps: int
    gate: list[bool]
    promoted_per_seed: list[int]
    refused_per_seed: list[int]
    mean_drift: float | None
    mean_entropy: float | None
    wall_s_per_seed: list[float]


class Summary(TypedDict):
    """summary.json."""

    code_stamp: str | None
    commits: list[str]
    excluded_other_code: list[str]
    scenarios: dict[str, dict[str, MethodSummary]]
    paired: dict[str, dict[str, Comparison]]  # scenario -> "method - comparator" -> ...
    missing: list[str]  # the expected cells that have no file

# Two-sided 95% Student-t quantiles t(0.975, df) (scipy is not a dependency): every df to 30, then
# a few more; a df between two listed ones takes the smaller df's quantile (a slightly wider
# interval, never a narrower one).
_T975 = dict(zip(range(1, 31), (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042))) | {
    40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    if df < 1:
        return float("nan")
    return _T975[max(k for k in _T975 if k <= df)]


def cell_path(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.scenario / cell.method / f"seed{cell.seed}.json"


def write_cell(out: Path, cell: Cell, record: CellRecord) -> Path:
    path = cell_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # a cell file is whole or absent
    return path


def read_cell(out: Path, cell: Cell) -> CellRecord | None:
    path = cell_path(out, cell)
    if not path.is_file():
        return None
    try:
        return _cell_of(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it to run the cell again") from None


def all_cells(out: Path) -> list[CellRecord]:
    return [_cell_of(p.read_text()) for p in sorted((out / "cells").glob("*/*/seed*.json"))]


def _cell_of(text: str) -> CellRecord:
    """A cell file's record, as written (not checked: cells of older code lack newer keys)."""
    return cast(CellRecord, json.loads(text))


def stamp_of(cell: CellRecord) -> str:
    return (cell.get("code") or {}).get("stamp") or "unstamped"


ADAPT_WINDOW, ADAPT_NEED = 4, 3
LAST_SESSIONS = 8


def sessions_to_adapt(meets: list[bool], window: int = ADAPT_WINDOW, need: int = ADAPT_NEED) -> int | None:
    """The first session (1-based) from which every window of `window` sessions to the end of the run
    holds at least `need` that meet; None when the last window falls short (not adapted)."""
    good = [sum(meets[t:t + window]) >= need for t in range(len(meets) - window + 1)]
    if not good or not good[-1]:
        return None
    first = len(good)
    while first > 0 and good[first - 1]:
        first -= 1
    return first + 1


def right_of(cell: CellRecord) -> list[bool] | None:
    """Whether each reply's answer was right; None for a cell recorded before answers were checked."""
    its = cell["interactions"]
    return [bool(i.get("right")) for i in its] if all("right" in i for i in its) else None


# How the rule-based user rates a reply that fails every rule at once (raters.Judgement.gate).
BROKEN = ("cut", "meta", "repeat")


# Comparisons reported as paired differences (method, comparator), when both have cells.
COMPARISONS = (("default", "memory"), ("default", "binary"), ("default", "combined"), ("memory", "none"),
               ("default_evidence", "default"), ("default_evidence", "memory"),
               ("default_loops", "default"), ("default_loops", "memory"),
               ("default_updates", "default"), ("default_updates", "memory"),
               ("default", "binary_corrections"), ("binary_corrections", "binary"), ("binary_corrections", "none"),
               ("combined", "binary"), ("opd", "opd_token"), ("opd_evidence", "opd"), ("binary", "none"),
               ("combined", "none"), ("opd", "none"), ("combined", "seed"), ("seed", "none"),
               ("default", "default_ungated"), ("combined", "combined_ungated"),
               ("default_consolidated", "default"), ("default_consolidated", "memory"),
               ("default_consolidated_updates", "default_consolidated"), ("default_consolidated_updates", "memory"),
               ("default_consolidated_evidence", "default_consolidated"), ("default_consolidated_evidence", "memory"))


def _first_last(cell: CellRecord, key: HeldOutKey) -> tuple[float, float] | None:
    """The held-out `key` at the first and at the last evaluation; None for a cell recorded
    before `key` existed."""
    first, last = cell["curve"][0].get(key), cell["curve"][-1].get(key)
    return None if first is None or last is None else (first, last)


def _gain(members: list[CellRecord], key: HeldOutKey) -> dict[int, float]:
    """Per seed: the held-out `key` at the last evaluation minus at the first (the base model);
    cells recorded before `key` existed are left out."""
    return {m["cell"]["seed"]: fl[1] - fl[0] for m in members if (fl := _first_last(m, key)) is not None}


def _before_after(members: list[CellRecord], key: HeldOutKey) -> BeforeAfter | None:
    """The held-out `key` at the first and at the last evaluation, mean and 95% CI over seeds."""
    have = [fl for m in members if (fl := _first_last(m, key)) is not None]
    return (mean_ci([f for f, _ in have]), mean_ci([la for _, la in have])) if have else None


def step_curve(curve: Sequence[tuple[int, float]], interactions: int) -> list[float]:
    """Score at x = 0..interactions: the newest of the (interaction, score) points at or before x."""
    points = sorted(curve)
    out, j, current = [], 0, points[0][1]
    for x in range(interactions + 1):
        while j < len(points) and points[j][0] <= x:
            current = points[j][1]
            j += 1
        out.append(current)
    return out


def _scores(curve: list[CurvePoint]) -> list[tuple[int, float]]:
    return [(p["interaction"], p["score"]) for p in curve]


def mean_ci(values: list[float]) -> MeanCI:
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, float("nan"), float("nan")
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def _probe_curve(m: CellRecord, n_int: int, key: Literal["mass", "mass_off"] = "mass") -> list[float] | None:
    """The probe at x = 0..n_int; None for a cell that has not recorded `key` on every probe."""
    points = [(p["interaction"], p.get(key)) for p in m.get("probe", [])]
    known = [(x, v) for x, v in points if v is not None]
    return step_curve(known, n_int) if known and len(known) == len(points) else None


def probe_off_gain(cell: CellRecord) -> float | None:
    """The probe without the notes at the end minus the base model's (the first probe, taken before
    any note or version): what training moved in the weights alone. None for a cell recorded before
    the probe ran without the notes, or a scenario with no opener rule."""
    probe = cell.get("probe") or []
    if not probe or probe[0]["mass"] is None or (last := probe[-1].get("mass_off")) is None:
        return None
    return last - probe[0]["mass"]


def paired(a: dict[int, float], b: dict[int, float]) -> PairedDiff | None:
    """Mean of a[seed] − b[seed] over the seeds both have, with its 95% t-interval."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    diffs = [a[k] - b[k] for k in seeds]
    m, lo, hi = mean_ci(diffs)
    return {"seeds": seeds, "diffs": diffs, "mean": m, "low": lo, "high": hi}


def adapt_order(a: dict[int, int | None], b: dict[int, int | None]) -> AdaptOrder | None:
    """Per shared seed, did `a` adapt sooner than `b`, at the same session, later, or neither?"""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    never = float("inf")
    n = Counter[str]()
    for k in seeds:
        x, y = (never if v is None else v for v in (a[k], b[k]))
        n["neither" if x == y == never else "same" if x == y else "sooner" if x < y else "later"] += 1
    return {"seeds": seeds, "sooner": n["sooner"], "same": n["same"], "later": n["later"], "neither": n["neither"],
            "sign_p": sign_test(n["sooner"], n["later"])}


def sign_test(wins: int, losses: int) -> float:
    """Exact two-sided binomial sign test of wins against losses at p = 1/2 (1.0 with neither)."""
    n, k = wins + losses, min(wins, losses)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def summarize(cells: list[CellRecord], expected: list[Cell] | None = None, stamp: str | None = None) -> Summary:
    if cells and stamp is None:  # the newest cell's code
        stamp = stamp_of(max(cells, key=lambda c: c.get("finished_at", "")))
    excluded = sorted(f"{c['cell']['scenario']}/{c['cell']['method']}/seed{c['cell']['seed']} ({stamp_of(c)})"
                      for c in cells if stamp_of(c) != stamp)
    cells = [c for c in cells if stamp_of(c) == stamp]
    groups: dict[tuple[str, str], list[CellRecord]] = {}
    for c in cells:
        groups.setdefault((c["cell"]["scenario"], c["cell"]["method"]), []).append(c)
    commits = sorted({(c.get("code") or {}).get("commit") or "?" for c in cells})
    summary: Summary = {"code_stamp": stamp, "commits": commits, "excluded_other_code": excluded,
                        "scenarios": {}, "paired": {}, "missing": []}
    per_seed: dict[tuple[str, str], dict[str, dict[int, float]]] = {}
    adapt_at: dict[tuple[str, str], dict[int, int | None]] = {}
    for (scen, method), members in sorted(groups.items()):
        n_int = max(m["config"]["interactions"] for m in members)
        curves = [step_curve(_scores(m["curve"]), n_int) for m in members]
        per_x = [mean_ci([c[x] for c in curves]) for x in range(n_int + 1)]
        probes = [p for p in (_probe_curve(m, n_int) for m in members) if p is not None]
        probes_off = [p for p in (_probe_curve(m, n_int, "mass_off") for m in members) if p is not None]
        adapt = {m["cell"]["seed"]: sessions_to_adapt([r["meets"] for r in m["interactions"]]) for m in members}
        adapt_at[(scen, method)] = adapt
        meets_rate = {m["cell"]["seed"]: statistics.fmean([r["meets"] for r in m["interactions"]])
                      for m in members if m["interactions"]}
        meets_last = {m["cell"]["seed"]: statistics.fmean([r["meets"] for r in m["interactions"][-LAST_SESSIONS:]])
                      for m in members if m["interactions"]}
        # Replies no person wants whatever their preference: cut off, or about the conversation.
        broken_rate = {m["cell"]["seed"]: statistics.fmean([r["gate"] in BROKEN for r in m["interactions"]])
                       for m in members if m["interactions"]}
        right_rate = {m["cell"]["seed"]: statistics.fmean(right) for m in members
                      if m["interactions"] and (right := right_of(m)) is not None}
        per_seed[(scen, method)] = {
            "sessions_to_adapt": {k: float(v) for k, v in adapt.items() if v is not None},
            "meets_rate": meets_rate,
            "meets_last": meets_last,
            "broken_rate": broken_rate,
            "right_rate": right_rate,
            "final_score": {m["cell"]["seed"]: m["curve"][-1]["score"] for m in members},
            # Held-out, from the weights alone (notes off), end minus start: what training kept.
            "meets_off_gain": _gain(members, "meets_off"),
            "right_off_gain": _gain(members, "right_off"),
            "meets_gain": _gain(members, "meets"),
            "right_gain": _gain(members, "right"),
            # The probe where every method has one, at the end: during the run, a cell recorded
            # when the probe ran only on new versions holds a stale value while the notes change.
            "probe_final": {m["cell"]["seed"]: mass for m in members
                            if (probe := m.get("probe")) and (mass := probe[-1]["mass"]) is not None},
            "probe_off_gain": {m["cell"]["seed"]: g for m in members if (g := probe_off_gain(m)) is not None},
        }
        adapted = [v for v in adapt.values() if v is not None]
        steps = [s for m in members for s in m["steps"] if s["outcome"] == "committed"]

        def avg(key: str) -> float | None:
            vals = [s["metrics"][key] for s in steps if key in s["metrics"]]
            return statistics.fmean(vals) if vals else None

        def gain_ci(key: str) -> MeanCI | None:
            by_seed = per_seed[(scen, method)][key]
            return mean_ci(list(by_seed.values())) if by_seed else None

        summary["scenarios"].setdefault(scen, {})[method] = {
            "seeds": sorted(m["cell"]["seed"] for m in members),
            "interactions": n_int,
            "sessions_to_adapt": {str(k): v for k, v in sorted(adapt.items())},  # None = not adapted
            "adapted": f"{len(adapted)}/{len(adapt)}",
            "sessions_to_adapt_adapted": mean_ci([float(v) for v in adapted]) if adapted else None,
            "meets_rate": mean_ci(list(meets_rate.values())) if meets_rate else None,
            "meets_last": mean_ci(list(meets_last.values())) if meets_last else None,
            "broken_rate": mean_ci(list(broken_rate.values())) if broken_rate else None,
            "right_rate": mean_ci(list(right_rate.values())) if right_rate else None,
            # Per session (1-based at index 0): the share of seeds whose reply met the preference.
            "meets_by_session": [statistics.fmean(m["interactions"][i]["meets"] for m in members
                                                  if i < len(m["interactions"])) for i in range(n_int)],
            "mean": [p[0] for p in per_x], "low": [p[1] for p in per_x], "high": [p[2] for p in per_x],
            "probe_mean": [statistics.fmean(p[x] for p in probes) for x in range(n_int + 1)] if probes else None,
            "probe_off_mean": ([statistics.fmean(p[x] for p in probes_off) for x in range(n_int + 1)]
                               if probes_off else None),
            "before": mean_ci([c[0] for c in curves]), "final": mean_ci([c[-1] for c in curves]),
            "meets_before_after": _before_after(members, "meets"),
            "right_before_after": _before_after(members, "right"),
            "meets_off_before_after": _before_after(members, "meets_off"),
            "right_off_before_after": _before_after(members, "right_off"),
            "meets_off_gain": gain_ci("meets_off_gain"), "right_off_gain": gain_ci("right_off_gain"),
            "meets_gain": gain_ci("meets_gain"), "right_gain": gain_ci("right_gain"),
            "probe_off_gain": gain_ci("probe_off_gain"),
            # The score averaged over the whole run (area under the curve / N): how soon it learned.
            "run_mean": mean_ci([statistics.fmean(c) for c in curves]),
            "steps_per_seed": [sum(s["outcome"] == "committed" for s in m["steps"]) for m in members],
            "samples_used_per_seed": [sum(s["samples"] for s in m["steps"] if s["outcome"] == "committed")
                                      for m in members],
            "failed_steps": sum(s["outcome"] != "committed" for m in members for s in m["steps"]),
            "gate": [m["config"].get("gate", False) for m in members],
            "promoted_per_seed": [len(m["versions"]["promoted"]) if "versions" in m else 0 for m in members],
            "refused_per_seed": [len(m["versions"]["refused"]) if "versions" in m else 0 for m in members],
            "mean_drift": avg("drift"), "mean_entropy": avg("entropy"),
            "wall_s_per_seed": [round(m["wall_s"], 1) for m in members],
        }
    for scen in summary["scenarios"]:
        for a, b in COMPARISONS:
            if (scen, a) in per_seed and (scen, b) in per_seed:
                diffs = {metric: paired(per_seed[(scen, a)][metric], per_seed[(scen, b)][metric])
                         for metric in PAIRED_METRICS}
                summary["paired"].setdefault(scen, {})[f"{a} - {b}"] = cast(Comparison, {
                    **diffs, "adapt_order": adapt_order(adapt_at[(scen, a)], adapt_at[(scen, b)])})
    have = {(c["cell"]["scenario"], c["cell"]["method"], c["cell"]["seed"]) for c in cells}
    summary["missing"] = [c.key for c in expected or [] if (c.scenario, c.method, c.seed) not in have]
    return summary


def write_summary(out: Path, expected: list[Cell]) -> tuple[Summary, list[Path]]:
    summary = summarize(all_cells(out), expected)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary, plot(summary, out)


def markdown_table(summary: Summary) -> str:
    """Per scenario and method: adaptation, the rates of replies meeting the preference and of cut
    or meta replies during the run, held-out score before/after, the probe; then the paired
    differences."""

    def ci(t: Sequence[float] | None, fmt: str = ".3f") -> str:
        if t is None:
            return "–"
        m, lo, hi = t
        return format(m, fmt) if math.isnan(lo) else f"{m:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"

    def adapt(s: MethodSummary) -> str:
        return ", ".join("not adapted" if v is None else str(v) for v in s["sessions_to_adapt"].values())

    lines = [f"Code stamp {summary['code_stamp']} (commits {', '.join(c[:10] for c in summary['commits'])}).", "",
             "| scenario | method | seeds | sessions to adaptation, per seed | adapted | replies meeting the "
             "preference with a right answer (95% CI) | ... over the last 8 sessions (95% CI) | answer right, "
             "any form (95% CI) | broken: cut, about the conversation "
             "or repeated (95% CI) | held-out score before "
             "| after (95% CI) | probe before → after | steps/seed | promoted/refused per seed | wall min/cell |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for scen, methods in summary["scenarios"].items():
        for method, s in methods.items():
            wall = statistics.fmean(s["wall_s_per_seed"]) / 60
            gated = ",".join(f"{p}/{r}" if g else "no gate" for p, r, g in
                             zip(s.get("promoted_per_seed", []), s.get("refused_per_seed", []), s.get("gate", [])))
            probe = "–" if not (pm := s.get("probe_mean")) else f"{pm[0]:.3f} → {pm[-1]:.3f}"
            lines.append(
                f"| {scen} | {method} | {','.join(map(str, s['seeds']))} | {adapt(s)} | {s['adapted']} "
                f"| {ci(s['meets_rate'])} | {ci(s.get('meets_last'))} | {ci(s.get('right_rate'))} | {ci(s.get('broken_rate'))} | {ci(s['before'])} | {ci(s['final'])} | {probe} "
                f"| {','.join(map(str, s['steps_per_seed']))} | {gated} | {wall:.1f} |")
    lines += ["", "Held-out greedy replies at the first and the last evaluation, with the notes (as served) and "
              "without them (the weights alone); gain = last − first per seed, mean [95% CI].", "",
              "| scenario | method | meets, notes on | right, notes on | meets, notes off | right, notes off "
              "| gain meets off | gain right off | probe gain, notes off |", "|---|---|---|---|---|---|---|---|---|"]

    def before_after(t: BeforeAfter | None) -> str:
        return "–" if t is None else f"{t[0][0]:.2f} → {t[1][0]:.2f}"

    for scen, methods in summary["scenarios"].items():
        for method, s in methods.items():
            lines.append(f"| {scen} | {method} | " + " | ".join(before_after(t) for t in (
                s.get("meets_before_after"), s.get("right_before_after"), s.get("meets_off_before_after"),
                s.get("right_off_before_after")))
                + f" | {ci(s.get('meets_off_gain'), '+.3f')} | {ci(s.get('right_off_gain'), '+.3f')} "
                f"| {ci(s.get('probe_off_gain'), '+.3f')} |")
    lines += ["", "| scenario | method − comparator | metric | seeds | per-seed differences | mean [95% CI] |",
              "|---|---|---|---|---|---|"]
    for scen, pairs in summary["paired"].items():
        for name, metrics in pairs.items():
            for metric in PAIRED_METRICS:
                if (d := metrics.get(metric)) is not None:
                    lines.append(f"| {scen} | {name} | {metric} | {','.join(map(str, d['seeds']))} "
                                 f"| {', '.join(f'{x:+.3g}' for x in d['diffs'])} "
                                 f"| {ci([d['mean'], d['low'], d['high']], '+.3f')} |")
            if (o := metrics.get("adapt_order")) is not None:
                lines.append(f"| {scen} | {name} | adapted sooner / same / later / neither | "
                             f"{','.join(map(str, o['seeds']))} | {o['sooner']} / {o['same']} / {o['later']} / "
                             f"{o['neither']} | sign test p = {o.get('sign_p', 1.0):.3g} |")
    return "\n".join(lines)
