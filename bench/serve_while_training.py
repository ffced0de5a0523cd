"""Serving while the trainer trains, on a small busy machine: does serving keep its priority?

Starts `--burners` CPU burners (each a `python -c "while True: pass"` process at nice 0: the
documented background load), then the real daemon on SmolLM2-135M with training on (method
binary, judge off, `--batch` samples per step, threads from the daemon's CPU budget). Every round:

  idle     1 stream: `--requests` sequential requests, TTFT and tokens/s; then N concurrent
           streams once (aggregate tokens/s); no training running
  alone    a training step with no requests: its step time
  1 stream a training step while one client sends sequential requests: TTFT and tokens/s of the
           requests that started and ended inside the step, and the step time
  N streams the same with N concurrent clients (aggregate tokens/s)

A step is started by rating `--batch` fresh main calls (each rated reply becomes a sample); the
first step (Ray start, model load) is a warm-up and not measured. Step times are the trainer's own
`step_time_s` (forward/backward/optimizer) and the daemon's wall time for the step (start to
live), both from the store's `train_steps` table; `yielded_s` is the time the trainer waited for
requests between micro-batches.

    nice -n 10 .venv/bin/python bench/serve_while_training.py --rounds 3

Targets: TTFT p50 during training <= 2x idle; no starvation (every step finishes, every request
is served). Writes bench/results/serve_while_training-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_MODEL, Daemon, write_result  # noqa: E402

PROMPT = "Explain in detail how a bicycle works, covering the frame, gears, brakes and wheels."


def request(c: httpx.Client, max_tokens: int, seed: int) -> dict[str, float]:
    body = {"model": "clawback", "stream": True, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": PROMPT}]}
    t0 = time.time()
    ttft, tokens = None, 0
    with c.stream("POST", "/v1/chat/completions", json=body, headers={"x-turn-type": "side"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.time() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    t1 = time.time()
    return {"start": t0, "end": t1, "ttft_s": ttft if ttft is not None else t1 - t0, "tokens": tokens,
            "tokens_per_s": tokens / (t1 - t0)}


class Clients:
    """`n` clients sending sequential requests until stopped."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.stop, self.done, self.errors = threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, args=(url, i, max_tokens)) for i in range(n)]

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        with httpx.Client(base_url=url, timeout=3600) as c:
            k = 0
            while not self.stop.is_set():
                try:
                    self.done.append(request(c, max_tokens, 1000 * i + k))
                except Exception as e:
                    self.errors.append(repr(e))
                k += 1

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def aggregate(done: list[dict[str, float]], t0: float, t1: float) -> dict[str, Any]:
    inside = [r for r in done if r["start"] >= t0 and r["end"] <= t1]
    tokens = sum(r["tokens"] for r in done if r["start"] >= t0 and r["end"] <= t1)
    return {"requests": len(inside), "ttft_p50_s": statistics.median(r["ttft_s"] for r in inside) if inside else None,
            "tokens_per_s_p50": statistics.median(r["tokens_per_s"] for r in inside) if inside else None,
            "aggregate_tokens_per_s": tokens / (t1 - t0) if inside else None}


def steps(db: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT version, started_at, finished_at, outcome, metrics FROM train_steps ORDER BY step").fetchall()
    finally:
        conn.close()
    return [{"version": v, "started_at": s, "finished_at": f, "outcome": o, **json.loads(m or "{}")} for v, s, f, o, m in rows]


def train_once(c: httpx.Client, db: Path, batch: int, during: Any = None) -> dict[str, Any]:
    """Rate `batch` fresh main calls, then wait for the step they start (running `during` in the
    meantime); returns the step's row and the wall interval it ran in."""
    before = len(steps(db))
    for _ in range(batch):
        session = uuid.uuid4().hex
        c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 6, "messages": [
            {"role": "user", "content": f"say something about {session[:6]}"}]},
               headers={"x-session-id": session, "x-turn-type": "main"}).raise_for_status()
        time.sleep(0.2)
        ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": session})
        ack.raise_for_status()
    while len(steps(db)) == before:
        time.sleep(0.2)
    return steps(db)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burners", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help="the trainer's budget (0: the daemon's default)")
    args = ap.parse_args()

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    # The gate off: it would hold out a share of the rated calls (so `--batch` ratings would not
    # make a step) and review each candidate before it goes live (not part of the step measured).
    env = {"CLAWBACK_JUDGE": "off", "CLAWBACK_METHOD": "binary", "CLAWBACK_BATCH_SIZE": str(args.batch),
           "CLAWBACK_MAX_STALENESS": "1000", "CLAWBACK_GATE": '{"enabled": false, "guard_replies": 0}'}
    if args.micro_batch_tokens:
        env["CLAWBACK_MICRO_BATCH_TOKENS"] = str(args.micro_batch_tokens)
    d = Daemon(args.model, Path(tempfile.mkdtemp(prefix="clawback-bench-")), 0, "cpu", "warning", env=env)
    db = d.data_dir / "clawback.db"
    rounds: list[dict[str, Any]] = []
    try:
        d.wait_ready(timeout=1800)
        with httpx.Client(base_url=d.url, timeout=3600) as c:
            warm = train_once(c, db, args.batch)
            print(f"warm-up step: {warm['outcome']} in {warm['finished_at'] - warm['started_at']:.1f} s", flush=True)
            for r in range(args.rounds):
                row: dict[str, Any] = {"round": r, "loadavg": Path("/proc/loadavg").read_text().split()[0]}
                row["idle_1"] = [request(c, args.max_tokens, 100 * r + k) for k in range(args.requests)]
                with Clients(d.url, args.streams, args.max_tokens) as many:
                    t0 = time.time()
                    while len(many.done) < 2 * args.streams:
                        time.sleep(0.1)
                    row[f"idle_{args.streams}"] = aggregate(many.done, t0, time.time())
                row["alone"] = train_once(c, db, args.batch)
                for n in (1, args.streams):
                    with Clients(d.url, n, args.max_tokens) as load:
                        step = train_once(c, db, args.batch)
                    row[f"step_{n}"] = step
                    row[f"during_{n}"] = aggregate(load.done, step["started_at"], step["finished_at"])
                    row[f"errors_{n}"] = load.errors
                row["loadavg_end"] = Path("/proc/loadavg").read_text().split()[0]
                rounds.append(row)
                idle = statistics.median(x["ttft_s"] for x in row["idle_1"])
                print(f"round {r}: ttft idle {idle:.2f} s, during 1-stream step {row['during_1']['ttft_p50_s']} "
                      f"({row['during_1']['requests']} requests); step alone {row['alone'].get('step_time_s', 0):.1f} s, "
                      f"under 1 {row['step_1'].get('step_time_s', 0):.1f} s, under {args.streams} "
                      f"{row[f'step_{args.streams}'].get('step_time_s', 0):.1f} s", flush=True)
    finally:
        d.stop()
        for b in burners:
            b.kill()
            b.wait()

    def med(xs: list[float | None]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    n = args.streams
    summary = {
        "ttft_idle_p50_s": med([statistics.median(x["ttft_s"] for x in r["idle_1"]) for r in rounds]),
        "ttft_training_p50_s": med([r["during_1"]["ttft_p50_s"] for r in rounds]),
        "ttft_ratio_p50": med([r["during_1"]["ttft_p50_s"] / statistics.median(x["ttft_s"] for x in r["idle_1"])
                               for r in rounds if r["during_1"]["ttft_p50_s"]]),
        "tokens_per_s_idle_1": med([statistics.median(x["tokens_per_s"] for x in r["idle_1"]) for r in rounds]),
        "tokens_per_s_training_1": med([r["during_1"]["tokens_per_s_p50"] for r in rounds]),
        f"aggregate_tokens_per_s_idle_{n}": med([r[f"idle_{n}"]["aggregate_tokens_per_s"] for r in rounds]),
        f"aggregate_tokens_per_s_training_{n}": med([r[f"during_{n}"]["aggregate_tokens_per_s"] for r in rounds]),
        "step_time_s_alone": med([r["alone"].get("step_time_s") for r in rounds]),
        "step_time_s_under_1": med([r["step_1"].get("step_time_s") for r in rounds]),
        f"step_time_s_under_{n}": med([r[f"step_{n}"].get("step_time_s") for r in rounds]),
        "step_wall_s_alone": med([r["alone"]["finished_at"] - r["alone"]["started_at"] for r in rounds]),
        "step_wall_s_under_1": med([r["step_1"]["finished_at"] - r["step_1"]["started_at"] for r in rounds]),
        f"step_wall_s_under_{n}": med([r[f"step_{n}"]["finished_at"] - r[f"step_{n}"]["started_at"] for r in rounds]),
        "steps_failed": sum(r[k]["outcome"] != "committed" for r in rounds for k in ("alone", "step_1", f"step_{n}")),
        "request_errors": sum(len(r["errors_1"]) + len(r[f"errors_{n}"]) for r in rounds),
    }
    print(json.dumps(summary, indent=1))
    write_result("serve_while_training", {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary, "rounds": rounds})


if __name__ == "__main__":
    main()
