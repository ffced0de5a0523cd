"""Where an embedded decode step's time goes, for 1 and N rows.

Runs `EmbeddedEngine` in this process (SmolLM2-135M, fp32, `--threads` torch threads), sends N
concurrent generations of `--max-tokens` tokens (temperature 1, seeded), and times every decode
step on the engine's worker thread: the whole step (`_decode`: inputs, forward, sampling, logprobs,
emits), the model forward alone, and the rest, in wall time and in the worker thread's CPU time (which a
busy machine does not inflate). Then `--profiled` steps of the N-row batch run under
torch.profiler: time per operator, so that matmuls (the linear layers and the LM head), attention,
norms and rotary embeddings, and what is neither (Python, cache bookkeeping) can be told apart.

    nice -n 10 .venv/bin/python bench/decode_profile.py --streams 8

Writes bench/results/decode_profile-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_MODEL, write_result  # noqa: E402

from clawback.engine import Sampling  # noqa: E402
from clawback.engines.embedded import EmbeddedEngine  # noqa: E402

PROMPT = "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."


def instrument(engine: EmbeddedEngine, profiled: int, min_rows: int) -> dict[str, Any]:
    """Wrap the worker's `_decode` and `_forward` with timers; profile `profiled` steps of
    `min_rows` rows or more (after 3 such steps of warm-up)."""
    rec: dict[str, Any] = {"steps": [], "profile": None}
    decode, forward = engine._decode, engine._forward
    state = {"forward_s": 0.0, "forward_cpu_s": 0.0, "to_profile": profiled, "warm": 3, "prof": None}

    def timed_forward(*a: Any, **k: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        out = forward(*a, **k)
        state["forward_s"] += time.perf_counter() - t0
        state["forward_cpu_s"] += time.thread_time() - c0
        return out

    def timed_decode(batch: Any) -> None:
        rows = len(batch.gens)
        profile = rows >= min_rows and state["to_profile"] > 0 and state["warm"] == 0
        if rows >= min_rows and state["warm"]:
            state["warm"] -= 1
        if profile and state["prof"] is None:
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            state["prof"].__enter__()
        state["forward_s"] = state["forward_cpu_s"] = 0.0
        t0, c0 = time.perf_counter(), time.thread_time()
        decode(batch)
        total, cpu = time.perf_counter() - t0, time.thread_time() - c0
        if profile:
            state["to_profile"] -= 1
            if state["to_profile"] == 0:
                state["prof"].__exit__(None, None, None)
                rec["profile"] = state["prof"]
        else:
            rec["steps"].append({"rows": rows, "step_ms": 1000 * total, "forward_ms": 1000 * state["forward_s"],
                                 "step_cpu_ms": 1000 * cpu, "forward_cpu_ms": 1000 * state["forward_cpu_s"]})

    engine._decode, engine._forward = timed_decode, timed_forward  # type: ignore[method-assign]
    return rec


async def run(engine: EmbeddedEngine, ids: list[int], streams: int, max_tokens: int) -> float:
    async def one(i: int) -> int:
        n = 0
        async for _ in engine.generate(ids, Sampling(max_tokens=max_tokens, temperature=1.0, seed=i)):
            n += 1
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profiled", type=int, default=10)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model))
    ids = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"])
    engine = EmbeddedEngine(args.model, device="cpu", dtype="float32", torch_threads=args.threads)
    rec = instrument(engine, args.profiled, args.streams)
    loads = [Path("/proc/loadavg").read_text().split()[0]]
    rates = {}
    for n in (1, args.streams, 1, args.streams):
        start = len(rec["steps"])
        rate = asyncio.run(run(engine, ids, n, args.max_tokens))
        rates.setdefault(n, []).append(rate)
        print(f"{n} streams: {rate:.1f} tokens/s", flush=True)
        for s in rec["steps"][start:]:
            s["burst"] = n
    loads.append(Path("/proc/loadavg").read_text().split()[0])
    asyncio.run(engine.close())

    by_rows: dict[int, list[dict[str, float]]] = {}
    for s in rec["steps"]:
        by_rows.setdefault(s["rows"], []).append(s)
    steps = {rows: {"n": len(xs), **{f"{k}_p50": statistics.median(x[k] for x in xs) for k in xs[0] if k.endswith("ms")},
                    "rest_cpu_ms_p50": statistics.median(x["step_cpu_ms"] - x["forward_cpu_ms"] for x in xs)}
             for rows, xs in sorted(by_rows.items())}
    for rows, s in steps.items():
        print(f"{rows} rows: step {s['step_ms_p50']:.1f} ms, forward {s['forward_ms_p50']:.1f} ms (wall); CPU: step "
              f"{s['step_cpu_ms_p50']:.1f} ms, forward {s['forward_cpu_ms_p50']:.1f} ms, rest {s['rest_cpu_ms_p50']:.1f} ms "
              f"(n={s['n']})")
    ops = []
    if rec["profile"] is not None:
        table = rec["profile"].key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=20))
        ops = sorted(({"op": e.key, "calls": e.count, "self_ms_per_step": e.self_cpu_time_total / 1000 / args.profiled}
                      for e in table), key=lambda o: -o["self_ms_per_step"])[:30]
    write_result("decode_profile", {"args": {k: str(v) for k, v in vars(args).items()}, "loadavg": loads,
                                    "tokens_per_s": rates, "steps_by_rows": steps, "ops": ops,
                                    "steps": rec["steps"]})


if __name__ == "__main__":
    main()
