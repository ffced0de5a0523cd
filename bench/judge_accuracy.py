"""How often does the judge's majority vote agree with a human label of the next state?

Runs `judge_prm` over the hand-labelled cases in bench/judge_cases.jsonl for every backend it can
run, next to two baselines that never read a case:

    embedded        EngineBackend on the embedded engine (CPU), once per --models entry (catalogue
                    names, pulled into ~/.clawback/models if needed; default smollm2-135m-instruct)
    openai          OpenAIBackend on --openai-url/--openai-model (a second clawback daemon, vLLM, ...)
    majority-class  always answers the most common label among the cases run
    random          uniform over {-1, 0, 1} (seeded)

    .venv/bin/python bench/judge_accuracy.py                                  # embedded + baselines, m=3
    .venv/bin/python bench/judge_accuracy.py --m 1 --limit 24 --max-tokens 160
    .venv/bin/python bench/judge_accuracy.py --backends embedded --models qwen2.5-coder-0.5b-instruct
    .venv/bin/python bench/judge_accuracy.py --backends openai majority-class random \\
        --openai-url http://127.0.0.1:8000/v1 --openai-model Qwen3-4B

Reports accuracy (a failed verdict counts as wrong), per-class recall, balanced accuracy (mean
recall: chance is 1/3 whatever the label mix), the 3x3 confusion matrix (+ a failed column),
failed-vote rate, seconds per case and a one-sided binomial p-value of the accuracy against 1/3.
Writes bench/results/judge_accuracy-<timestamp>.json with every case's votes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
LABELS = (-1, 0, 1)
SHOWN = {-1: "-1", 0: "0", 1: "+1"}
BASELINES = ("majority-class", "random")


def load_cases(path: Path, limit: int | None) -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not limit or limit >= len(cases):
        return cases
    # Take categories in turn so a subsample still covers every kind of next state.
    by_category: dict[str, list[dict[str, Any]]] = {}
    for case in cases:
        by_category.setdefault(case["category"], []).append(case)
    picked: list[dict[str, Any]] = []
    while len(picked) < limit:
        for group in by_category.values():
            if group and len(picked) < limit:
                picked.append(group.pop(0))
    return picked


def binomial_p_at_least(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): how likely chance alone is to score this well."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def summarise(name: str, rows: list[dict[str, Any]], seconds: float, votes_total: int, votes_failed: int) -> dict[str, Any]:
    n = len(rows)
    correct = sum(r["predicted"] == r["expected"] for r in rows)
    confusion = {str(e): {str(p): 0 for p in (*LABELS, None)} for e in LABELS}
    for r in rows:
        confusion[str(r["expected"])][str(r["predicted"])] += 1
    recall = {}
    for e in LABELS:
        support = sum(confusion[str(e)].values())
        recall[str(e)] = confusion[str(e)][str(e)] / support if support else None
    present = [v for v in recall.values() if v is not None]
    return {
        "backend": name,
        "cases": n,
        "accuracy": correct / n if n else 0.0,
        "balanced_accuracy": sum(present) / len(present) if present else 0.0,
        "recall": recall,
        "confusion": confusion,  # confusion[expected][predicted]; predicted "None" = failed verdict
        "failed_verdicts": sum(r["predicted"] is None for r in rows),
        "failed_vote_rate": votes_failed / votes_total if votes_total else 0.0,
        "seconds_per_case": seconds / n if n else 0.0,
        "p_vs_chance": binomial_p_at_least(correct, n, 1 / 3) if n else 1.0,
        "rows": rows,
    }


def run_baseline(name: str, cases: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    if name == "majority-class":
        counts = Counter(c["expected"] for c in cases)
        top = max(LABELS, key=lambda label: (counts[label], label))  # ties go to the larger label
        predict = lambda case: top  # noqa: E731
    else:
        rng = random.Random(seed)
        predict = lambda case: rng.choice(LABELS)  # noqa: E731
    rows = [{"id": c["id"], "category": c["category"], "expected": c["expected"], "predicted": predict(c)} for c in cases]
    return summarise(name, rows, 0.0, 0, 0)


async def run_judge(name: str, backend: Any, cases: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    from clawback.judge.prm import judge_prm

    rows, votes_total, votes_failed = [], 0, 0
    started = time.monotonic()
    for i, case in enumerate(cases):
        t0 = time.monotonic()
        verdict = await judge_prm(
            backend, case["request_messages"], case["response"], case["next_state"], m=args.m,
            temperature=args.temperature, max_tokens=args.max_tokens, timeout_s=args.timeout,
            retries=args.retries, seed=args.seed + 1000 * i,
        )
        votes_total += len(verdict.votes)
        votes_failed += verdict.failed_votes
        rows.append({
            "id": case["id"], "category": case["category"], "expected": case["expected"], "predicted": verdict.score,
            "votes": [{"score": v.score, "error": v.error, "attempts": v.attempts, "raw": v.raw[-600:]} for v in verdict.votes],
            "seconds": round(time.monotonic() - t0, 2),
        })
        mark = "ok" if verdict.score == case["expected"] else "--"
        print(f"  [{name}] {i + 1}/{len(cases)} {case['id']:<16} expected {case['expected']:>2} got "
              f"{str(verdict.score):>4} votes {[v.score for v in verdict.votes]} {mark} ({rows[-1]['seconds']}s)",
              file=sys.stderr, flush=True)
    return summarise(name, rows, time.monotonic() - started, votes_total, votes_failed)


def embedded_backend(args: argparse.Namespace, model: str):
    from transformers import AutoTokenizer

    from clawback.chat import ChatRenderer
    from clawback.daemon.config import Settings
    from clawback.daemon.models import resolve_model
    from clawback.engines.embedded import EmbeddedEngine
    from clawback.judge.backends import EngineBackend

    model_dir = resolve_model(model, Settings().models_dir, progress=print)
    engine = EmbeddedEngine(model_dir, device=args.device, torch_threads=args.threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return engine, EngineBackend(engine, ChatRenderer(tokenizer), tokenizer)


async def run_all(args: argparse.Namespace, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for name in args.backends:
        if name in BASELINES:
            results.append(run_baseline(name, cases, args.seed))
        elif name == "embedded":
            for model in args.models:
                engine, backend = embedded_backend(args, model)
                try:
                    results.append(await run_judge(f"embedded:{model}", backend, cases, args))
                finally:
                    await engine.close()
        elif name == "openai":
            from clawback.judge.backends import OpenAIBackend

            if not args.openai_url or not args.openai_model:
                sys.exit("--backends openai needs --openai-url and --openai-model")
            async with OpenAIBackend(args.openai_url, args.openai_key, args.openai_model, args.timeout) as backend:
                results.append(await run_judge(f"openai:{args.openai_model}", backend, cases, args))
        else:
            sys.exit(f"unknown backend {name!r}")
    return results


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | cases | accuracy | balanced acc. | recall -1 / 0 / +1 | failed votes | s/case | p vs 1/3 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rec = r["recall"]
        lines.append(
            f"| {r['backend']} | {r['cases']} | {pct(r['accuracy'])} | {pct(r['balanced_accuracy'])} | "
            f"{pct(rec['-1'])} / {pct(rec['0'])} / {pct(rec['1'])} | {pct(r['failed_vote_rate'])} | "
            f"{r['seconds_per_case']:.1f} | {r['p_vs_chance']:.2g} |"
        )
    for r in results:
        lines += ["", f"Confusion, {r['backend']} (rows expected, columns predicted):", "",
                  "| expected \\ predicted | -1 | 0 | +1 | failed |", "|---|---|---|---|---|"]
        for e in LABELS:
            row = r["confusion"][str(e)]
            lines.append(f"| {SHOWN[e]} | {row['-1']} | {row['0']} | {row['1']} | {row['None']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["embedded", *BASELINES],
                   help="embedded, openai, majority-class, random")
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"],
                   help="embedded: the models to judge with (catalogue names or model dirs)")
    p.add_argument("--cases", type=Path, default=ROOT / "judge_cases.jsonl")
    p.add_argument("--limit", type=int, default=None, help="run a category-balanced subsample of this many cases")
    p.add_argument("--m", type=int, default=3, help="votes per case (odd)")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--retries", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per vote attempt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads for the embedded engine (0 = torch default)")
    p.add_argument("--openai-url", default=None, help="API root, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--openai-key", default=os.environ.get("JUDGE_OPENAI_KEY"))
    p.add_argument("--openai-model", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "results")
    args = p.parse_args()

    cases = load_cases(args.cases, args.limit)
    started = dt.datetime.now()
    results = asyncio.run(run_all(args, cases))
    print(table(results))

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"judge_accuracy-{started:%Y%m%d-%H%M%S}.json"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "openai_key"}
    path.write_text(json.dumps({
        "started": started.isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "config": config,
        "case_ids": [c["id"] for c in cases],
        "results": results,
    }, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
