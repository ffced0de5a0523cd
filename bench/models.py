"""The catalogue's models side by side, each served by a real daemon on the embedded engine.

All models' daemons run at once and every round measures each model in turn (the order flips every
round), so that all see the same machine load; medians over rounds are reported. For every model
(catalogue names, pulled first if needed):
- start: seconds from `clawback serve` to a healthy daemon, and to its first reply;
- resident memory of the daemon after the bursts (RSS, with children);
- decode: aggregate tokens/s and TTFT p50 at 1 stream and at `--streams` streams, `--rounds` rounds
  (medians), streaming 48-token replies as `serve_concurrency.py` does;
- the gate's probe set answered through the API exactly as the gate asks it (greedy, 32 tokens,
  the probe's tools): the share that passes, per kind;
- a tool-call round trip: a request with one tool must come back as a tool call with arguments that
  fit the schema; the tool's result sent back must give a reply that uses it;
- the told preference: a system note "begin with 'Sure', under 40 words" on 6 word problems with
  known answers: how many replies follow it, and how many end on the right number.

    nice -n 10 .venv/bin/python bench/models.py --models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct

Training and the judge are off, so that only serving is measured. Writes
bench/results/models-<timestamp>.json with every reply behind the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Daemon, write_result  # noqa: E402
from serve_concurrency import burst  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PROBLEMS = [("A pen costs $3. How much do 7 pens cost?", 21), ("Tom has 12 apples and gives away 5. How many are left?", 7),
            ("A box holds 6 eggs. How many eggs are in 4 boxes?", 24), ("What is 15% of 200?", 30),
            ("A train travels 60 km per hour for 3 hours. How far does it go?", 180),
            ("Sara reads 25 pages a day. How many pages does she read in 8 days?", 200)]
NOTE = "Always begin your reply with the word 'Sure'; keep replies under 40 words."


def chat(url: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": "clawback", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
    r.raise_for_status()
    return r.json()["choices"][0]


def probe_text(choice: dict[str, Any]) -> str:
    """The reply as the gate reads it: tool calls in the chat template's own markup."""
    calls = choice["message"].get("tool_calls") or []
    return (choice["message"].get("content") or "") + "".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>'
        for c in calls)


def probes(url: str) -> dict[str, Any]:
    from clawback.daemon.probes import load_probes, passes

    rows = []
    for p in load_probes():
        choice = chat(url, [{"role": "user", "content": p.prompt}], 32, **({"tools": list(p.tools)} if p.tools else {}))
        text = probe_text(choice)
        rows.append({"id": p.id, "kind": p.kind, "passed": passes(p, text), "reply": text})
    kinds = sorted({r["kind"] for r in rows})
    return {"score": 100 * sum(r["passed"] for r in rows) / len(rows), "passed": sum(r["passed"] for r in rows),
            "probes": len(rows), "by_kind": {k: f"{sum(r['passed'] for r in rows if r['kind'] == k)}/"
                                               f"{sum(r['kind'] == k for r in rows)}" for k in kinds}, "replies": rows}


def tool_round_trip(url: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = chat(url, messages, 96, tools=[WEATHER])
    calls = first["message"].get("tool_calls") or []
    out: dict[str, Any] = {"first": first["message"], "called": False, "used_result": False}
    if not calls:
        return out
    args = json.loads(calls[0]["function"]["arguments"] or "{}")
    out["called"] = calls[0]["function"]["name"] == "get_weather" and isinstance(args.get("city"), str)
    messages += [first["message"], {"role": "tool", "tool_call_id": calls[0]["id"],
                                    "content": json.dumps({"city": args.get("city"), "temp_c": 17, "sky": "light rain"})}]
    second = chat(url, messages, 96, tools=[WEATHER])
    text = second["message"].get("content") or ""
    out["second"] = text
    out["used_result"] = "17" in text and "rain" in text.lower()
    return out


def told_preference(url: str) -> dict[str, Any]:
    rows = []
    for q, answer in PROBLEMS:
        text = chat(url, [{"role": "system", "content": NOTE}, {"role": "user", "content": q}], 80)["message"]["content"]
        numbers = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
        rows.append({"q": q, "reply": text, "sure": (text or "").startswith("Sure"),
                     "under_40_words": len((text or "").split()) < 40,
                     "right": bool(numbers) and float(numbers[-1]) == answer})
    return {"follows": sum(r["sure"] and r["under_40_words"] for r in rows), "right": sum(r["right"] for r in rows),
            "of": len(rows), "replies": rows}


def rss_mb(pid: int) -> float:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(p.memory_info().rss for p in procs) / 2**20


def start(model: str) -> tuple[Daemon, dict[str, Any]]:
    """A daemon on `model`, timed from the command to healthy and to its first reply."""
    from clawback.daemon.config import Settings
    from clawback.daemon.models import resolve_model

    model_dir = Path(resolve_model(model, Settings().models_dir, progress=print))
    env = {"CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_MEMORY": "false"}
    t0 = time.perf_counter()
    d = Daemon(model_dir, Path(tempfile.mkdtemp(prefix="clawback-bench-models-")), 0, "cpu", "warning", env=env)
    d.wait_ready(timeout=1800)
    out: dict[str, Any] = {"model": model, "healthy_s": time.perf_counter() - t0}
    chat(d.url, [{"role": "user", "content": "Hello!"}], 16)
    out["first_reply_s"] = time.perf_counter() - t0
    print(f"{model}: healthy {out['healthy_s']:.1f} s, first reply {out['first_reply_s']:.1f} s", flush=True)
    return d, out


def checks(d: Daemon, out: dict[str, Any]) -> None:
    out["probes"] = probes(d.url)
    print(f"{out['model']}: probes {out['probes']['passed']}/{out['probes']['probes']} {out['probes']['by_kind']}", flush=True)
    out["tool_call"] = tool_round_trip(d.url)
    print(f"  tool call: called {out['tool_call']['called']}, used the result {out['tool_call']['used_result']}", flush=True)
    out["told_preference"] = t = told_preference(d.url)
    print(f"  told 'Sure, < 40 words': follows {t['follows']}/{t['of']}, right answer {t['right']}/{t['of']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    names = args.models.split(",")
    daemons: dict[str, Daemon] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in names:  # one at a time, so that each start is timed on its own
            daemons[name], results[name] = start(name)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            row: dict[str, Any] = {"loadavg": os.getloadavg()[0]}
            for name in names if r % 2 == 0 else names[::-1]:
                for n in (1, args.streams):
                    res = asyncio.run(burst(daemons[name].url, n, 48, 1000 * r))
                    row[f"{name}/{n}"] = {"tokens_per_s": res["tokens_per_s"], "ttft_p50_s": res["ttft_p50_s"]}
                    print(f"round {r} {name} {n} streams: {res['tokens_per_s']:.1f} tok/s, "
                          f"ttft p50 {res['ttft_p50_s']:.2f} s (load {row['loadavg']:.1f})", flush=True)
            rounds.append(row)
        for name in names:
            results[name]["decode"] = {f"{n} streams": {k: statistics.median(r[f"{name}/{n}"][k] for r in rounds)
                                                        for k in ("tokens_per_s", "ttft_p50_s")} for n in (1, args.streams)}
            results[name]["rss_mb"] = rss_mb(daemons[name].proc.pid)
            checks(daemons[name], results[name])
    finally:
        for d in daemons.values():
            d.stop()
    print("\n| model | healthy s | first reply s | tok/s 1 | TTFT 1 s | tok/s 8 | TTFT 8 s | RSS MB | probes | tool call | told: follows / right |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        d1, d8 = r["decode"]["1 streams"], r["decode"][f"{args.streams} streams"]
        t = r["told_preference"]
        print(f"| {r['model']} | {r['healthy_s']:.0f} | {r['first_reply_s']:.0f} | {d1['tokens_per_s']:.1f} | "
              f"{d1['ttft_p50_s']:.2f} | {d8['tokens_per_s']:.1f} | {d8['ttft_p50_s']:.2f} | {r['rss_mb']:.0f} | "
              f"{r['probes']['passed']}/{r['probes']['probes']} | {'yes' if r['tool_call']['called'] and r['tool_call']['used_result'] else 'no'} | "
              f"{t['follows']}/{t['of']} / {t['right']}/{t['of']} |")
    write_result("models", {"args": vars(args), "results": results, "rounds": rounds})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
