"""Which stored simulator replies the daemon's loop rules flag, by how the simulated user rated
them: the 6-token-run rule (`daemon/samples.py` `repetition_loop`, a 6-token run said three times
anywhere, which drops a sample as `repetition_loop`) and the tail rule (`daemon/probes.py`
`ends_in_loop`, one short sequence repeated over the end of the reply). Kinds: `liked` (met the
preference with a right answer), the user's gates (`repeat`: said a sentence again; `cut`; `meta`)
and `missed`. Reads the committed 0.5B cells; no model run. Results: bench/README.md.

    .venv/bin/python bench/loop_rule_scan.py
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from transformers import AutoTokenizer

from clawback.daemon.probes import ends_in_loop
from clawback.daemon.samples import repetition_loop

RESULTS = Path(__file__).resolve().parent / "results"
CELLS = ("grid-q05-*/*/cells/*/*/seed*.json", "great32-3e0a170/cells/*/*/seed*.json")


def main() -> None:
    tok = AutoTokenizer.from_pretrained(str(Path.home() / ".clawback" / "models" / "qwen2.5-coder-0.5b-instruct"))
    files = sorted(f for pattern in CELLS for f in RESULTS.glob(pattern))
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    n_cells = 0
    for f in files:
        cell = json.loads(f.read_text())
        if cell["cell"]["scenario"] == "shell":
            continue
        n_cells += 1
        for x in cell["interactions"]:
            ids = tok(x["reply"])["input_ids"]
            kind = "liked" if x["meets"] else (x["gate"] or "missed")
            count[(kind, "all")] += 1
            count[(kind, "6-token run x3")] += repetition_loop(ids) is not None
            count[(kind, "ends in a loop")] += ends_in_loop(ids)
    print(f"{n_cells} cells")
    print("| kind | replies | 6-token run x3 | ends in a loop |\n|---|---|---|---|")
    for kind in sorted({k for k, _ in count}):
        print(f"| {kind} | {count[(kind, 'all')]} | {count[(kind, '6-token run x3')]} | {count[(kind, 'ends in a loop')]} |")


if __name__ == "__main__":
    main()
