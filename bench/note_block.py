"""Does the order of the preference notes change what a small model does with them?

A `memory` cell ends with the scenario's preference note beside notes the simulated person added
when a reply talked about their feedback or repeated itself ("Just answer, don't talk about my
feedback.", "Don't repeat yourself."). This generates greedy replies to the held-out tasks with
those notes injected as `daemon.memory.inject` puts them, in each order, and counts the replies
that meet the preference and the broken ones (cut by the budget, about the conversation, or
repeating a sentence: the gates of sim/scenarios.py).

    .venv/bin/python bench/note_order.py [--tasks 16] [--only brief,sure] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from in_context_following import reply

from clawback.chat import ChatRenderer
from clawback.daemon import memory
from clawback.daemon.engines.embedded import EmbeddedEngine
from clawback.sim.scenarios import BRIEF, SURE, Rating

META = "Just answer, don't talk about my feedback."
REPEAT = "Don't repeat yourself."
# Note lists as cells end with them; "pref" is the scenario's own note.
ORDERS = {"untold": [], "pref": ["pref"], "meta, pref": [META, "pref"], "pref, meta": ["pref", META],
          "repeat, pref, meta": [REPEAT, "pref", META], "meta, repeat, pref": [META, REPEAT, "pref"]}


async def measure(args, done: dict) -> dict:
    from transformers import AutoTokenizer

    from clawback.daemon.config import Settings
    from clawback.daemon.models import resolve_model

    model_dir = resolve_model(args.model, Settings().models_dir) if not Path(args.model).is_dir() else args.model
    engine = EmbeddedEngine(model_dir, device="cpu", torch_threads=1)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    rows = done
    for scen in (s for s in (BRIEF, SURE) if s.name in args.only.split(",")):
        pref, = memory.notes_from(scen.correction(Rating(0.0, scen.checks)))[0]
        for name, order in ORDERS.items():
            key = f"{scen.name} / {name}"
            if key in rows:
                continue
            notes = [pref if n == "pref" else n for n in order]
            replies = []
            for task in scen.eval[: args.tasks]:
                text, complete = await reply(engine, renderer, memory.inject(
                    [{"role": "user", "content": task.prompt}], notes), args.max_tokens)
                r = scen.rate(text, task, complete)
                replies.append({"meets": r.meets, "gate": r.gate, "reply": text})
            rows[key] = {"notes": notes, "n": len(replies), "meets": sum(r["meets"] for r in replies),
                         "broken": sum(r["gate"] is not None for r in replies), "replies": replies}
            print(key, rows[key]["meets"], rows[key]["broken"], file=sys.stderr, flush=True)
            _write(args.out, args, rows)  # resumable: an interrupted run keeps what it measured
    await engine.close()
    return rows


def _write(path: str, args, rows: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "tasks": args.tasks,
                                      "rows": rows, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                     indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--only", default="brief,sure")
    p.add_argument("--out", default="bench/results/note_order.json")
    args = p.parse_args()
    done = json.loads(Path(args.out).read_text())["rows"] if Path(args.out).is_file() else {}
    rows = asyncio.run(measure(args, done))
    print("| notes, first to last | meets the preference | broken |\n|---|---|---|")
    for key, r in rows.items():
        print(f"| {key} | {r['meets']}/{r['n']} | {r['broken']}/{r['n']} |")


if __name__ == "__main__":
    main()
