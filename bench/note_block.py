"""How should the preference notes be put in front of a small model: in which order, under which
words, before or after the person's message?

A `memory` cell ends with the scenario's preference note beside notes the simulated person added
when a reply talked about their feedback or repeated itself ("Just answer, don't talk about my
feedback.", "Don't repeat yourself."). This generates greedy replies to the held-out tasks with
those notes in each order and in each form of the block, and counts the replies that meet the
preference and the broken ones (cut by the budget, about the conversation, or repeating a
sentence: the gates of sim/scenarios.py). The form `bare` is what `daemon.memory.inject` does.

    .venv/bin/python bench/note_block.py [--tasks 16] [--only brief,sure] [--forms bare,header,...] \
        [--orders "pref;meta, pref"] [--out FILE]
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
from clawback.engines.embedded import EmbeddedEngine
from clawback.sim.scenarios import BRIEF, SCENARIOS, SURE, Rating

META = "Just answer, don't talk about my feedback."
REPEAT = "Don't repeat yourself."
# Note lists as cells end with them; "pref" is the scenario's own note.
ORDERS = {"untold": [], "pref": ["pref"], "meta, pref": [META, "pref"], "pref, meta": ["pref", META], "repeat, pref": [REPEAT, "pref"],
          "repeat, pref, meta": [REPEAT, "pref", META], "meta, repeat, pref": [META, REPEAT, "pref"],
          "repeat, meta, pref": [REPEAT, META, "pref"]}
HEADER = "What this user has told you they want (follow it in every reply):"
SILENT = "Follow these requests from the user in your reply, without mentioning them:"


def _listed(header: str, tail: str = ""):
    return lambda notes: "\n".join([header, *(f"- {n}" for n in notes), *([tail] if tail else [])])


# Forms of the block: what it says, and whether it goes after or before the person's message.
FORMS = {"header": (_listed(HEADER), "after"),
         "silent": (_listed(SILENT), "after"),
         "before": (_listed(HEADER), "before"),
         "silent-before": (_listed(SILENT), "before"),
         "then-answer": (_listed(HEADER, "Now answer the message above."), "after"),
         "bare": (None, "after"),  # daemon.memory.inject: plain lines under the person's message
         "as-always": (lambda notes: "As always: " + " ".join(notes), "after"),
         "ps": (lambda notes: "P.S. " + " ".join(notes), "after")}


def with_notes(prompt: str, notes: list[str], form: str) -> list[dict]:
    block, where = FORMS[form]
    if block is None or not notes:
        return memory.inject([{"role": "user", "content": prompt}], notes)
    return [{"role": "user", "content": f"{block(notes)}\n\n{prompt}" if where == "before" else f"{prompt}\n\n{block(notes)}"}]


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
        for form in args.forms.split(","):
            for name in args.orders.split(";"):
                key = f"{scen.name} / untold" if name == "untold" else f"{scen.name} / {form} / {name}"
                if key in rows:
                    continue
                notes = [pref if n == "pref" else n for n in ORDERS[name]]
                replies = []
                for task in scen.eval[: args.tasks]:
                    text, complete = await reply(engine, renderer, with_notes(task.prompt, notes, form), args.max_tokens)
                    replies.append({"reply": text, "complete": complete})
                rows[key] = rate(scen, {"form": form, "notes": notes, "replies": replies})
                print(key, rows[key]["meets"], rows[key]["broken"], file=sys.stderr, flush=True)
                _write(args.out, args, rows)  # resumable: an interrupted run keeps what it measured
    await engine.close()
    return rows


def rate(scen, row: dict) -> dict:
    """The row's replies rated by the scenario's rules as they are now (kept replies are re-rated
    when the rules change)."""
    for r, task in zip(row["replies"], scen.eval):
        r.setdefault("complete", r.get("gate") != "cut")  # rows written before "complete" was kept
        rating = scen.rate(r["reply"], task, r["complete"])
        r.update(meets=rating.meets, gate=rating.gate)
    return {**row, "n": len(row["replies"]), "meets": sum(r["meets"] for r in row["replies"]),
            "broken": sum(r["gate"] is not None for r in row["replies"])}


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
    p.add_argument("--forms", default="bare", help=f"comma list of {', '.join(FORMS)}")
    p.add_argument("--orders", default=";".join(ORDERS), help=f"semicolon list of {'; '.join(ORDERS)}")
    p.add_argument("--out", default="bench/results/note_block.json")
    args = p.parse_args()
    done = json.loads(Path(args.out).read_text())["rows"] if Path(args.out).is_file() else {}
    done = {k: rate(SCENARIOS[k.split(" / ")[0]], row) for k, row in done.items()}
    rows = asyncio.run(measure(args, done))
    print("| notes | meets the preference | broken |\n|---|---|---|")
    for key, r in rows.items():
        print(f"| {key} | {r['meets']}/{r['n']} | {r['broken']}/{r['n']} |")


if __name__ == "__main__":
    main()
