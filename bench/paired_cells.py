"""Paired per-seed differences between two sets of `clawback simulate` cells that a summary will
not mix: two output folders (two code stamps, e.g. one change tried against the code before it),
one method from each.

Per scenario and shared seed: the share of replies during the run that meet the preference (and
of those that also get every computation they write out right), the share broken (cut, about
the conversation, repeated), the final held-out greedy score, the last opener probe (`sure`), and
when each run adapted; the mean
difference A − B with its 95% t-interval (sim/results.py). `--sessions 17-32` takes the shares over
those sessions only (in a long run, the part where versions are live); adaptation is always over the
whole run. Either side may pool one method's seeds from several folders, each part with its seed
range (FOLDER:METHOD@1-6+FOLDER:METHOD@7-12).

    .venv/bin/python bench/paired_cells.py bench/results/bare:memory bench/results/header:memory [--scenario sure,brief]
    .venv/bin/python bench/paired_cells.py 'bench/results/exch-lr1:default@1-6+bench/results/cons:default_as_served@7-12' \
        'bench/results/exch-lr1:binary@1-6+bench/results/binary-lr1:binary@7-12' --scenario sure
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from clawback.sim.results import BROKEN, adapt_order, all_cells, meets_and_right, paired, sessions_to_adapt


def pooled(spec: str, scenario: str, sessions: tuple[int, int] | None = None) -> dict[str, dict[int, Any]]:
    """`per_seed` over parts joined by "+", each FOLDER:METHOD@FIRST-LAST giving those seeds."""
    out: dict[str, dict[int, Any]] = {}
    for part in spec.split("+"):
        one, _, seeds = part.partition("@")
        first, _, last = seeds.partition("-")
        if not (first.isdigit() and last.isdigit()):
            raise SystemExit(f"{part}: expected FOLDER:METHOD@FIRST-LAST")
        wanted = range(int(first), int(last) + 1)
        for key, by_seed in per_seed(one, scenario, sessions).items():
            taken, mine = out.setdefault(key, {}), {s: v for s, v in by_seed.items() if s in wanted}
            if taken.keys() & mine.keys():
                raise SystemExit(f"{spec}: seeds {sorted(taken.keys() & mine.keys())} in two parts")
            taken.update(mine)
    return out


def per_seed(spec: str, scenario: str, sessions: tuple[int, int] | None = None) -> dict[str, dict[int, Any]]:
    """Each metric by seed, for FOLDER:METHOD (or a pooled spec, see `pooled`)."""
    if "+" in spec or "@" in spec:
        return pooled(spec, scenario, sessions)
    folder, method = spec.rsplit(":", 1)
    cells = [c for c in all_cells(Path(folder)) if c["cell"]["scenario"] == scenario and c["cell"]["method"] == method]
    stamps = {(c.get("code") or {}).get("stamp") for c in cells}
    if len(stamps) > 1:
        raise SystemExit(f"{spec}: cells of {len(stamps)} code stamps in one set ({', '.join(map(str, stamps))})")
    out: dict[str, dict[int, Any]] = {"meets": {}, "right": {}, "broken": {}, "final": {}, "probe": {},
                                      "adapted": {}}
    for c in cells:
        seed, run = c["cell"]["seed"], c["interactions"]
        its = run[sessions[0] - 1:sessions[1]] if sessions else run
        if not its:
            raise SystemExit(f"{spec} seed {seed}: no session in {sessions} (the run has {len(run)})")
        out["meets"][seed] = sum(bool(i["meets"]) for i in its) / len(its)
        if all("reply" in i for i in its):  # cells recorded before replies were kept have no right rate
            out["right"][seed] = sum(meets_and_right(i) for i in its) / len(its)
        out["broken"][seed] = sum(i["gate"] in BROKEN for i in its) / len(its)
        out["final"][seed] = c["final_score"]
        if c.get("probe") and c["probe"][-1]["mass"] is not None:
            out["probe"][seed] = c["probe"][-1]["mass"]
        out["adapted"][seed] = sessions_to_adapt([bool(i["meets"]) for i in run])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="FOLDER:METHOD")
    p.add_argument("b", help="FOLDER:METHOD")
    p.add_argument("--scenario", default="sure,brief")
    p.add_argument("--sessions", help="FIRST-LAST (1-based, inclusive): the shares over these sessions only")
    args = p.parse_args()
    sessions = tuple(int(x) for x in args.sessions.split("-")) if args.sessions else None
    if sessions is not None and (len(sessions) != 2 or not 1 <= sessions[0] <= sessions[1]):
        raise SystemExit(f"--sessions {args.sessions}: expected FIRST-LAST with 1 <= FIRST <= LAST")
    print(f"| scenario | seeds | replies meeting the preference | ... and every computation right | broken | held-out greedy | probe at the end "
          f"| {args.a} adapted sooner / same / later / neither |\n|---|---|---|---|---|---|---|---|")
    for scenario in args.scenario.split(","):
        a, b = per_seed(args.a, scenario, sessions), per_seed(args.b, scenario, sessions)
        rows = [paired(a[k], b[k]) for k in ("meets", "right", "broken", "final", "probe")]
        order = adapt_order(a["adapted"], b["adapted"])
        if rows[0] is None or order is None:
            continue
        cells = ["–" if r is None else f"{r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}]" for r in rows]
        print(f"| {scenario} | {len(rows[0]['seeds'])} | {' | '.join(cells)} | "
              f"{order['sooner']} / {order['same']} / {order['later']} / {order['neither']} (p = {order['sign_p']:.2g}) |")


if __name__ == "__main__":
    main()
