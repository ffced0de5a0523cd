"""Paired per-seed differences between two sets of `clawback simulate` cells that a summary will
not mix: two output folders (two code stamps, e.g. one change tried against the code before it),
one method from each.

Per scenario and shared seed: the share of replies during the run that meet the scenario (the
preferred form with a right answer), that share over the last 8 sessions, correctness (the share
whose answer is right, any form), the share broken (cut, about the conversation, repeated), the
final held-out greedy score, the last opener probe (`sure`), the probe's gain without the notes
(the last one less the base model's: what the weights alone learned), and when each run adapted
(sim/results.py); the mean difference A − B with its 95% t-interval. `--sessions 17-32` takes the
shares over those sessions only (in a long run, the part where versions are live); adaptation and
the last 8 sessions are always over the whole run.

Either side may pool one method's seeds from several folders, each part with its seed range
(FOLDER:METHOD@1-6+FOLDER:METHOD@7-12). The parts must be cells of one code stamp: stamps that
differ are pooled only when `--equivalent 'STAMP=STAMP: why'` says they are the same code for
this measurement, and the reason is printed with the table. Cells recorded before answers were
checked (their `meets` is the form alone) are never compared with newer ones.

    .venv/bin/python bench/paired_cells.py bench/results/bare:memory bench/results/header:memory [--scenario sure,brief]
    .venv/bin/python bench/paired_cells.py 'bench/results/exch-lr1:default@1-6+bench/results/cons:default_as_served@7-12' \\
        'bench/results/exch-lr1:binary@1-6+bench/results/binary-lr1:binary@7-12' --scenario sure \\
        [--equivalent 'STAMP=STAMP: why they are the same code for this measurement']
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from clawback.sim.results import (
    BROKEN,
    LAST_SESSIONS,
    adapt_order,
    all_cells,
    paired,
    probe_off_gain,
    right_of,
    sessions_to_adapt,
    stamp_of,
)

METRICS = ("meets", "last", "right", "broken", "final", "probe", "probe_off")


class Cells:
    """One side's metrics by seed, the code stamps its cells ran and whether answers were checked."""

    def __init__(self) -> None:
        self.by_seed: dict[str, dict[int, Any]] = {k: {} for k in (*METRICS, "adapted")}
        self.stamps: set[str] = set()
        self.checked: set[bool] = set()


def pooled(spec: str, scenario: str, sessions: tuple[int, int] | None = None,
           equivalent: dict[str, str] | None = None) -> Cells:
    """`per_seed` over parts joined by "+", each FOLDER:METHOD@FIRST-LAST giving those seeds; the
    parts' stamps must be one, up to `equivalent` (stamp -> the stamp it stands for)."""
    out = Cells()
    for part in spec.split("+"):
        one, _, seeds = part.partition("@")
        first, _, last = seeds.partition("-")
        if not (first.isdigit() and last.isdigit()):
            raise SystemExit(f"{part}: expected FOLDER:METHOD@FIRST-LAST")
        wanted = range(int(first), int(last) + 1)
        got = per_seed(one, scenario, sessions)
        out.stamps |= got.stamps
        out.checked |= got.checked
        for key, by_seed in got.by_seed.items():
            taken, mine = out.by_seed[key], {s: v for s, v in by_seed.items() if s in wanted}
            if taken.keys() & mine.keys():
                raise SystemExit(f"{spec}: seeds {sorted(taken.keys() & mine.keys())} in two parts")
            taken.update(mine)
    same = {(equivalent or {}).get(s, s) for s in out.stamps}
    if len(same) > 1:
        raise SystemExit(f"{spec}: pools cells of code stamps {', '.join(sorted(out.stamps))}; pass --equivalent "
                         "'STAMP=STAMP: why' if they are the same code for this measurement")
    return out


def per_seed(spec: str, scenario: str, sessions: tuple[int, int] | None = None,
             equivalent: dict[str, str] | None = None) -> Cells:
    """Each metric by seed, for FOLDER:METHOD (or a pooled spec, see `pooled`)."""
    if "+" in spec or "@" in spec:
        return pooled(spec, scenario, sessions, equivalent)
    folder, method = spec.rsplit(":", 1)
    cells = [c for c in all_cells(Path(folder)) if c["cell"]["scenario"] == scenario and c["cell"]["method"] == method]
    out = Cells()
    out.stamps = {stamp_of(c) for c in cells}
    if len(out.stamps) > 1:
        raise SystemExit(f"{spec}: cells of {len(out.stamps)} code stamps in one set ({', '.join(sorted(out.stamps))})")
    m = out.by_seed
    for c in cells:
        seed, run, right = c["cell"]["seed"], c["interactions"], right_of(c)
        out.checked.add(right is not None)
        lo, hi = (sessions[0] - 1, sessions[1]) if sessions else (0, len(run))
        its = run[lo:hi]
        if not its:
            raise SystemExit(f"{spec} seed {seed}: no session in {sessions} (the run has {len(run)})")
        m["meets"][seed] = sum(bool(i["meets"]) for i in its) / len(its)
        m["last"][seed] = sum(bool(i["meets"]) for i in run[-LAST_SESSIONS:]) / len(run[-LAST_SESSIONS:])
        if right is not None:
            m["right"][seed] = sum(right[lo:hi]) / len(its)
        m["broken"][seed] = sum(i["gate"] in BROKEN for i in its) / len(its)
        m["final"][seed] = c["final_score"]
        if c.get("probe") and c["probe"][-1]["mass"] is not None:
            m["probe"][seed] = c["probe"][-1]["mass"]
        if (gain := probe_off_gain(c)) is not None:
            m["probe_off"][seed] = gain
        m["adapted"][seed] = sessions_to_adapt([bool(i["meets"]) for i in run])
    if len(out.checked) > 1:
        raise SystemExit(f"{spec}: some cells were recorded before answers were checked and some after")
    return out


def equivalences(pairs: list[str]) -> tuple[dict[str, str], list[str]]:
    """'A=B: why' declarations -> each stamp's representative, and the reasons as written."""
    rep: dict[str, str] = {}
    reasons = []
    for text in pairs:
        stamps, _, why = text.partition(":")
        names = [s.strip() for s in stamps.split("=")]
        if len(names) < 2 or not all(names) or not why.strip():
            raise SystemExit(f"--equivalent {text!r}: expected 'STAMP=STAMP[=...]: why they are the same code'")
        root = rep.get(names[0], names[0])
        for name in names:
            old = rep.get(name, name)
            rep = {k: root if v == old else v for k, v in rep.items()} | {name: root}
        reasons.append(f"{' = '.join(names)}: {why.strip()}")
    return rep, reasons


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="FOLDER:METHOD")
    p.add_argument("b", help="FOLDER:METHOD")
    p.add_argument("--scenario", default="sure,brief")
    p.add_argument("--sessions", help="FIRST-LAST (1-based, inclusive): the shares over these sessions only")
    p.add_argument("--equivalent", action="append", default=[],
                   help="'STAMP=STAMP: why': pool cells of these stamps as one code (repeatable)")
    args = p.parse_args()
    sessions = tuple(int(x) for x in args.sessions.split("-")) if args.sessions else None
    if sessions is not None and (len(sessions) != 2 or not 1 <= sessions[0] <= sessions[1]):
        raise SystemExit(f"--sessions {args.sessions}: expected FIRST-LAST with 1 <= FIRST <= LAST")
    equivalent, reasons = equivalences(args.equivalent)
    lines = []
    for scenario in args.scenario.split(","):
        a, b = (per_seed(s, scenario, sessions, equivalent) for s in (args.a, args.b))
        if a.checked and b.checked and a.checked != b.checked:
            raise SystemExit(f"{scenario}: one side's cells were recorded before answers were checked (their "
                             "'meets' is the form alone) and the other's after; they do not compare")
        rows = [paired(a.by_seed[k], b.by_seed[k]) for k in METRICS]
        order = adapt_order(a.by_seed["adapted"], b.by_seed["adapted"])
        if rows[0] is None or order is None:
            continue
        cells = ["–" if r is None else f"{r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]" for r in rows]
        lines.append(f"| {scenario} | {len(rows[0]['seeds'])} | {' | '.join(cells)} | {order['sooner']} / "
                     f"{order['same']} / {order['later']} / {order['neither']} (p = {order['sign_p']:.2g}) "
                     f"| {', '.join(sorted(a.stamps))} | {', '.join(sorted(b.stamps))} |")
    print(f"| scenario | seeds | replies meeting the preference with a right answer | ... over the last {LAST_SESSIONS} "
          "sessions | answer right, any form | broken | held-out greedy | probe at the end | probe gain, notes off "
          f"| {args.a} adapted sooner / same / later / neither | stamps A | stamps B |\n" + "|---" * 12 + "|")
    print("\n".join(lines))
    for reason in reasons:
        print(f"\nPooled as one code: {reason}")


if __name__ == "__main__":
    main()
