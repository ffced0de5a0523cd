"""Trainer memory over many steps: does the actor's RSS plateau?

Runs `TrainerWorker` (the class the daemon runs as a Ray actor, here in this process so that
/proc/self is the trainer) on SmolLM2-135M for `--steps` steps, each on a fresh batch of random
samples of mixed lengths (prompts 16-512, replies 8-128 tokens, like agent traffic), and records
the resident set size (VmRSS) and its high-water mark (VmHWM) after every step, publish included.

    nice -n 10 .venv/bin/python bench/trainer_rss.py --steps 20
    nice -n 10 .venv/bin/python bench/trainer_rss.py --steps 20 --no-trim   # without the worker's malloc_trim

Plateau criterion: RSS growth over the second half of the steps is < 5% of the RSS at the half-way
point. Writes bench/results/trainer_rss-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from train_throughput import DEFAULT_MODEL, make_samples  # noqa: E402

from clawback.trainer.config import TrainConfig  # noqa: E402


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batch-tokens", type=int, default=TrainConfig.micro_batch_tokens)
    ap.add_argument("--checkpointing", choices=("on", "off"), default="on")
    ap.add_argument("--no-trim", action="store_true", help="skip the worker's malloc_trim after each step (for comparison)")
    args = ap.parse_args()

    from clawback.trainer import worker as worker_module
    from clawback.trainer.worker import TrainerWorker

    if args.no_trim:
        worker_module.release_freed_memory = lambda: None

    cfg = TrainConfig(method="binary", batch_size=args.batch, micro_batch_tokens=args.micro_batch_tokens,
                      gradient_checkpointing=args.checkpointing == "on")
    worker = TrainerWorker(str(args.model), cfg, None, "cpu", args.threads)
    worker.resume(None)
    vocab = int(worker.model.config.vocab_size)
    rows = [{"step": 0, "rss_mb": status_kb("VmRSS") / 1024, "hwm_mb": status_kb("VmHWM") / 1024}]
    print(f"loaded: rss {rows[0]['rss_mb']:.0f} MB", flush=True)
    for step in range(1, args.steps + 1):
        samples = make_samples(args.batch, "mixed", vocab, seed=step)
        t0 = time.perf_counter()
        worker.train(samples, step, {"samples": args.batch})
        row = {"step": step, "step_s": time.perf_counter() - t0, "rss_mb": status_kb("VmRSS") / 1024,
               "hwm_mb": status_kb("VmHWM") / 1024}
        rows.append(row)
        print(f"step {step:2d}: {row['step_s']:5.1f} s  rss {row['rss_mb']:6.0f} MB  peak {row['hwm_mb']:6.0f} MB", flush=True)
    worker.close()
    half = rows[len(rows) // 2]["rss_mb"]
    growth = rows[-1]["rss_mb"] - half
    verdict = {"rss_half_mb": half, "rss_last_mb": rows[-1]["rss_mb"], "growth_second_half_mb": growth,
               "plateau": growth < 0.05 * half, "peak_mb": rows[-1]["hwm_mb"]}
    print(json.dumps(verdict, indent=1))
    out = REPO / "bench" / "results" / f"trainer_rss-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "verdict": verdict, "steps": rows},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
