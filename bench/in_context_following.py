"""How often does the base model follow a preference when it is told it in context?

OPD's teacher is the model given the user's correction as a hint, so OPD can only teach what the
model already does when told. For each scenario and candidate preference this generates greedy
replies to the same train tasks untold and told, where "told" is the person's full correction (the
scenario's complaint and every ask, as the simulated user writes it) given to the teacher in each
wording and placement of `daemon.samples.teacher_messages` (template x user/system), or the
preference notes memory keeps from that correction, where `daemon.memory.inject` puts them
(memory x user/system). It reports the
share of replies that meet the preference (every check passed, after the cut/meta gates of
sim/scenarios.py), the mean rating, and how many replies the token budget cut.

    .venv/bin/python bench/in_context_following.py [--tasks 8] [--max-tokens 400] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from clawback.chat import ChatRenderer, ChatRequest
from clawback.engine import Sampling
from clawback.daemon import memory
from clawback.daemon.engines.embedded import EmbeddedEngine
from clawback.daemon.samples import teacher_messages
from clawback.sim.scenarios import BRIEF, CANDIDATE_CHECKS, STUDENT, SURE, TEACHER, Check, Rating, Scenario

# The OpenClaw-RL wording where it put it, the instruction wording in both places, and the notes
# memory keeps from the correction in both places.
VARIANTS = [("hint", "user"), ("instruction", "user"), ("instruction", "system"), ("memory", "user"),
            ("memory", "system")]


def told(messages: list[dict], hint: str, form: str, placement: str) -> list[dict]:
    if form == "memory":
        return memory.inject(messages, memory.notes_from(hint)[0], placement)
    return teacher_messages(messages, hint, form, placement)


async def reply(engine, renderer, messages, max_tokens: int) -> tuple[str, bool]:
    """The greedy reply and whether it finished (False: cut by the budget)."""
    _, ids = renderer.render(ChatRequest.model_validate({"model": "m", "messages": messages}))
    stops = engine.info.eos_token_ids
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)
    out = [t.id async for t in engine.generate(ids, sampling)]
    return renderer.tokenizer.decode(out, skip_special_tokens=True), bool(out) and out[-1] in stops


def _single(name: str, check: Check) -> Scenario:
    """One candidate check as a scenario of its own (the gates apply to it too)."""
    return Scenario(name, check.ask, (), (), (check,), "Hmm.")


async def measure(args) -> dict:
    from transformers import AutoTokenizer

    from clawback.daemon.models import resolve_model
    from clawback.daemon.config import Settings

    model_dir = resolve_model(args.model, Settings().models_dir) if not Path(args.model).is_dir() else args.model
    engine = EmbeddedEngine(model_dir, device="cpu", torch_threads=1)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    rows = []
    # Candidates are asked about the student tasks (math word problems).
    cases: list[tuple[str, Scenario, list]] = [
        (s.name, s, list(s.train[: args.tasks])) for s in (STUDENT, TEACHER, SURE, BRIEF)
    ] + [(f"check:{name}", _single(name, check), list(STUDENT.train[: args.tasks]))
         for name, check in CANDIDATE_CHECKS.items()]
    if args.only:
        cases = [c for c in cases if c[0] in args.only.split(",")]
    for name, scen, tasks in cases:
        hint = scen.correction(Rating(0.0, scen.checks))  # everything failed: the full correction
        results: dict[str, list[tuple[Rating, bool]]] = {}
        examples = []
        for task in tasks:
            msgs = [{"role": "user", "content": task.prompt}]
            ex = {"task": task.prompt}
            for variant in [None, *VARIANTS]:
                key = "untold" if variant is None else "/".join(variant)
                text, done = await reply(engine, renderer, msgs if variant is None else
                                         told(msgs, hint, *variant), args.max_tokens)
                results.setdefault(key, []).append((scen.rate(text, task, done), done))
                ex[key] = text
            examples.append(ex)
        row = {"preference": name, "hint": hint, "n": len(tasks), "examples": examples[:2], "variants": {
            k: {"meets": sum(r.meets for r, _ in v) / len(v), "score": sum(r.score for r, _ in v) / len(v),
                "cut": sum(not d for _, d in v), "meta": sum(r.gate == "meta" for r, _ in v)}
            for k, v in results.items()}}
        rows.append(row)
        print(name, json.dumps(row["variants"]), file=sys.stderr, flush=True)
    await engine.close()
    return {"model": str(model_dir), "max_tokens": args.max_tokens, "tasks": args.tasks, "rows": rows,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--out", default="bench/results/in_context_following.json")
    p.add_argument("--only", help="comma list of preferences to (re)measure; the other rows of --out are kept")
    args = p.parse_args()
    result = asyncio.run(measure(args))
    if args.only and Path(args.out).is_file():  # merge: re-measured rows replace their old ones
        fresh = {r["preference"]: r for r in result["rows"]}
        old = json.loads(Path(args.out).read_text())["rows"]
        result["rows"] = [fresh.pop(r["preference"], r) for r in old] + list(fresh.values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    keys = ["untold", *("/".join(v) for v in VARIANTS)]
    print("| preference | " + " | ".join(keys) + " |\n|---" * (len(keys) + 1) + "|")
    for r in result["rows"]:
        cells = [f"{v['meets']:.2f} ({v['score']:.2f}; cut {v['cut']}, meta {v['meta']})" if v else "–"
                 for v in (r["variants"].get(k) for k in keys)]
        print(f"| {r['preference']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
