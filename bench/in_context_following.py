"""How often does the base model follow a preference when it is told it in context?

OPD's teacher is the model given the user's correction as a hint, so OPD can only teach what the
model already does when told. For each candidate preference this generates greedy replies to the
same tasks twice, plainly and with the preference appended as the teacher's hint
(daemon.samples.teacher_messages), and reports the share of replies that pass the preference's
check (for the student and teacher scenarios: the mean rating over all their checks).

    .venv/bin/python bench/in_context_following.py [--tasks 8] [--max-tokens 96] [--out FILE]
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
from clawback.daemon.engines.embedded import EmbeddedEngine
from clawback.daemon.samples import teacher_messages
from clawback.sim.scenarios import CANDIDATE_CHECKS, SURE, STUDENT, TEACHER, Scenario


async def reply(engine, renderer, messages, max_tokens: int) -> str:
    _, ids = renderer.render(ChatRequest.model_validate({"model": "m", "messages": messages}))
    sampling = Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=engine.info.eos_token_ids)
    out = [t.id async for t in engine.generate(ids, sampling)]
    return renderer.tokenizer.decode(out, skip_special_tokens=True)


async def measure(args) -> dict:
    from transformers import AutoTokenizer

    from clawback.daemon.models import resolve_model
    from clawback.daemon.config import Settings

    model_dir = resolve_model(args.model, Settings().models_dir) if not Path(args.model).is_dir() else args.model
    engine = EmbeddedEngine(model_dir, device="cpu", torch_threads=1)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    rows = []
    # Candidates are asked about the student tasks (math word problems).
    cases: list[tuple[str, Scenario | None, object, list]] = [
        ("student (all checks)", STUDENT, None, list(STUDENT.train[: args.tasks])),
        ("teacher (all checks)", TEACHER, None, list(TEACHER.train[: args.tasks])),
        ("sure (all checks)", SURE, None, list(SURE.train[: args.tasks])),
        *[(name, None, check, list(STUDENT.train[: args.tasks])) for name, check in CANDIDATE_CHECKS.items()],
    ]
    if args.only:
        cases = [c for c in cases if c[0].split(" ")[0] in args.only.split(",")]
    for name, scen, check, tasks in cases:
        hint = scen.preference if scen else f"Please {check.ask}."
        told, untold, examples = [], [], []
        for task in tasks:
            msgs = [{"role": "user", "content": task.prompt}]
            plain = await reply(engine, renderer, msgs, args.max_tokens)
            hinted = await reply(engine, renderer, teacher_messages(msgs, hint), args.max_tokens)
            rate = (lambda r: scen.rate(r, task).score) if scen else (lambda r: float(check.passes(r, task)))
            untold.append(rate(plain))
            told.append(rate(hinted))
            examples.append({"task": task.prompt, "plain": plain, "hinted": hinted})
        row = {"preference": name, "hint": hint, "untold": sum(untold) / len(untold), "told": sum(told) / len(told),
               "n": len(tasks), "examples": examples[:2]}
        rows.append(row)
        print(f"{name:<22} untold {row['untold']:.2f}  told {row['told']:.2f}  (+{row['told'] - row['untold']:.2f})",
              file=sys.stderr, flush=True)
    await engine.close()
    return {"model": str(model_dir), "max_tokens": args.max_tokens, "tasks": args.tasks, "rows": rows,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
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
    print("| preference | hint | followed untold | followed when told | gain |\n|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['preference']} | {r['hint']} | {r['untold']:.2f} | {r['told']:.2f} | {r['told'] - r['untold']:+.2f} |")


if __name__ == "__main__":
    main()
