"""How often does the base model follow a preference when it is told it in context?

OPD's teacher is the model given the user's correction as a hint, and the notes put the person's
corrections into the prompt, so training and the notes can only teach what the model already does
when told. For each scenario and candidate preference this generates greedy replies to the same
train tasks untold and told, where "told" is the person's full correction (the scenario's complaint
and every ask, as the simulated user writes it) given to the teacher in each wording and placement
of `daemon.samples.teacher_messages` (template x user/system), or the preference notes memory keeps
from that correction, where `daemon.memory.inject` puts them (memory x user/system).

It reports, per condition, the share of replies that **meet** the scenario (every check passed after
the cut/meta/repeat gates of sim/scenarios.py, and the answer right), the share that follow the
preference whatever the answer, the share whose answer is **right** whatever the form
(sim/answers.py), and how many replies the token budget cut or talked about the feedback. The
untold replies do not depend on the preference, so they are generated once per task and rated
against every scenario. All generations run concurrently (`--batch` at a time) so the engine
decodes them as one batch.

Every reply is kept in `--out`; `--rate-only` rates the kept replies again under the current rules
without a model.

    .venv/bin/python bench/in_context_following.py --model DIR --tasks 20 \\
        --only sure,brief,answer_line,plain --variants memory/user --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from clawback.chat import ChatRenderer, ChatRequest
from clawback.daemon import memory
from clawback.daemon.samples import teacher_messages
from clawback.engine import Sampling
from clawback.engines.embedded import EmbeddedEngine
from clawback.sim.scenarios import CANDIDATE_CHECKS, SCENARIOS, STUDENT, Check, Rating, Scenario

# The OpenClaw-RL wording where it put it, the instruction wording in both places, and the notes
# memory keeps from the correction in both places.
VARIANTS = ["hint/user", "instruction/user", "instruction/system", "memory/user", "memory/system"]


def told(messages: list[dict], hint: str, variant: str) -> list[dict]:
    form, placement = variant.split("/")
    if form == "memory":
        return memory.inject(messages, memory.notes_from(hint)[0], placement)
    return teacher_messages(messages, hint, form, placement)


def _single(name: str, check: Check) -> Scenario:
    """One candidate check as a scenario of its own (the gates and the right answer apply too)."""
    return Scenario(name, check.ask, (), (), (check,), "Hmm.")


def cases(only: str | None, n_tasks: int) -> list[tuple[str, Scenario, list]]:
    """(preference, scenario, train tasks); candidate checks are asked about the student tasks."""
    out = [(name, s, list(s.train[:n_tasks])) for name, s in SCENARIOS.items()] + [
        (f"check:{name}", _single(name, check), list(STUDENT.train[:n_tasks]))
        for name, check in CANDIDATE_CHECKS.items()]
    return [c for c in out if c[0] in only.split(",")] if only else out


def hint_of(scen: Scenario) -> str:
    return scen.correction(Rating(0.0, scen.checks))  # everything failed: the full correction


async def generate(args, wanted: dict[str, list[dict]]) -> dict[str, dict]:
    """Greedy replies to every distinct message list, `args.batch` at a time: key -> text, done."""
    from transformers import AutoTokenizer

    from clawback.daemon.config import Settings
    from clawback.daemon.models import resolve_model

    model_dir = args.model if Path(args.model).is_dir() else resolve_model(args.model, Settings().models_dir)
    engine = EmbeddedEngine(model_dir, device="cpu", torch_threads=args.threads)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    stops = engine.info.eos_token_ids
    gate, done_count = asyncio.Semaphore(args.batch), [0]

    async def one(key: str, messages: list[dict]) -> tuple[str, dict]:
        async with gate:
            _, ids = renderer.render(ChatRequest.model_validate({"model": "m", "messages": messages}))
            sampling = Sampling(temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=stops)
            out = [t.id async for t in engine.generate(ids, sampling)]
        done_count[0] += 1
        print(f"{done_count[0]}/{len(wanted)} replies", file=sys.stderr, flush=True)
        return key, {"text": renderer.tokenizer.decode(out, skip_special_tokens=True),
                     "done": bool(out) and out[-1] in stops}

    try:
        return dict(await asyncio.gather(*(one(k, m) for k, m in wanted.items())))
    finally:
        await engine.close()


def rate(scen: Scenario, replies: list[dict], variants: list[str]) -> dict:
    """Per condition: meets (form and right answer), follows (form), right (answer), cut, meta."""
    out = {}
    for key in ["untold", *variants]:
        ratings = [(scen.rate(r[key]["text"], r["task"], r[key]["done"]), r[key]["done"]) for r in replies if key in r]
        if not ratings:
            continue
        n = len(ratings)
        out[key] = {"n": n, "meets": sum(x.meets for x, _ in ratings) / n,
                    "follows": sum(not x.failed for x, _ in ratings) / n,
                    "right": sum(x.right for x, _ in ratings) / n,
                    "cut": sum(not d for _, d in ratings), "meta": sum(x.gate == "meta" for x, _ in ratings)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--batch", type=int, default=32, help="generations decoded at once")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--out", default="bench/results/in_context_following.json")
    p.add_argument("--only", help="comma list of preferences to (re)measure; the other rows of --out are kept")
    p.add_argument("--rate-only", action="store_true", help="rate the replies kept in --out again; no model")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"unknown variants {bad}; choose from {VARIANTS}")
    chosen = cases(args.only, args.tasks)
    by_name = {name: (scen, tasks) for name, scen, tasks in cases(None, 10**6)}
    if args.rate_only:
        result = json.loads(Path(args.out).read_text())
        for row in result["rows"]:
            if "replies" in row and row["preference"] in by_name:
                scen, tasks = by_name[row["preference"]]
                prompts = {t.prompt: t for t in tasks}
                replies = [{**r, "task": prompts[r["task"]]} for r in row["replies"]]
                row["variants"] = rate(scen, replies, [v for v in VARIANTS if v in row["variants"]])
    else:
        started = time.time()
        wanted: dict[str, list[dict]] = {}
        for _, scen, tasks in chosen:
            for task in tasks:
                msgs = [{"role": "user", "content": task.prompt}]
                wanted[json.dumps(msgs)] = msgs  # untold: the same for every preference
                for v in variants:
                    m = told(msgs, hint_of(scen), v)
                    wanted[json.dumps(m)] = m
        texts = asyncio.run(generate(args, wanted))
        rows = []
        for name, scen, tasks in chosen:
            replies = []
            for task in tasks:
                msgs = [{"role": "user", "content": task.prompt}]
                replies.append({"task": task, "untold": texts[json.dumps(msgs)],
                                **{v: texts[json.dumps(told(msgs, hint_of(scen), v))] for v in variants}})
            rows.append({"preference": name, "hint": hint_of(scen), "n": len(tasks),
                         "variants": rate(scen, replies, variants),
                         "replies": [{**r, "task": r["task"].prompt} for r in replies]})
        result = {"model": str(args.model), "max_tokens": args.max_tokens, "tasks": args.tasks, "rows": rows,
                  "minutes": round((time.time() - started) / 60, 1),
                  "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if args.only and Path(args.out).is_file():  # merge: re-measured rows replace their old ones
            fresh = {r["preference"]: r for r in rows}
            old = json.loads(Path(args.out).read_text())["rows"]
            result["rows"] = [fresh.pop(r["preference"], r) for r in old] + list(fresh.values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    keys = ["untold", *variants]
    print("| preference | n | " + " | ".join(keys) + " |\n" + "|---" * (len(keys) + 2) + "|")
    for r in result["rows"]:
        cells = [f"meets {v['meets']:.2f}, follows {v['follows']:.2f}, right {v['right']:.2f} (cut {v['cut']}, "
                 f"meta {v['meta']})" if v and "follows" in v else "–" for v in (r["variants"].get(k) for k in keys)]
        print(f"| {r['preference']} | {r['n']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
