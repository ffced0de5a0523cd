"""Serving first: TTFT of short requests while the daemon trains and while its gate reviews.

Starts `--burners` CPU burners (each a `python -c "while True: pass"` process at nice 0), then the
real daemon with training on (method binary, judge off, `--batch` samples per step, the gate on
with its whole probe set or `--probes` of them, threads from the daemon's CPU budget). `--streams` clients send
streamed requests of `--max-tokens` tokens back to back for the whole run; each request is
labelled by what the daemon was doing when it started:

  idle      `--idle-s` seconds per round with no training and no review
  training  a training step is running (the store's `train_steps`: started_at to finished_at,
            i.e. the trainer's step, the transfer of the version and its load into the engine)
  gate      the gate is reviewing the version the step made (`/v1/status` gate.reviewing, polled
            every 0.1 s): probe generations, greedy replies to recent prompts, replay scoring;
            with `--gate-window-s N` only its first N s, after which the clients pause until the
            review ends (a review yields to every request, so under back-to-back requests a
            larger model's review can take an hour)

A round is: idle, then rating calls (alternately 👍 and 👎, so the gate holds some out for its
replay) until a step starts, then the step and the review. The first round is a warm-up (Ray
start, model load, the base model's probe pass) and is not measured. Per round: TTFT p50 and p99
per label and their ratios to idle in the same round; the summary is the median over rounds. The
result file also holds every request (start, TTFT, tokens).

    nice -n 10 .venv/bin/python bench/serve_while_training.py --rounds 4
    nice -n 10 .venv/bin/python bench/serve_while_training.py --rounds 4 --model DIR   # another model

Target: TTFT p99 during training and during a review <= 2x idle. Writes
bench/results/serve_while_training-<timestamp>.json. SIGTERM during the measured rounds ends the run
there and writes the rounds done so far.
"""

from __future__ import annotations

import argparse
import json
import signal
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
from _common import DEFAULT_MODEL, Daemon, pct, write_result  # noqa: E402

PROMPT = "Explain in detail how a bicycle works, covering the frame, gears, brakes and wheels."
LABELS = ("idle", "training", "gate")


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
    return {"start": t0, "end": t1, "ttft_s": ttft if ttft is not None else t1 - t0, "tokens": tokens}


class Clients:
    """`n` clients sending sequential requests until stopped."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        self.stop, self.paused, self.done, self.errors = threading.Event(), threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, args=(url, i, max_tokens)) for i in range(n)]

    def _run(self, url: str, i: int, max_tokens: int) -> None:
        with httpx.Client(base_url=url, timeout=3600) as c:
            k = 0
            while not self.stop.is_set():
                if self.paused.is_set():
                    self.stop.wait(0.1)
                    continue
                try:
                    self.done.append(request(c, max_tokens, 1000 * i + k))
                except Exception as e:
                    self.errors.append(repr(e))
                k += 1

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


class Reviews:
    """Intervals in which `/v1/status` showed a version under review."""

    def __init__(self, url: str) -> None:
        self.url, self.intervals, self.stop = url, [], threading.Event()
        self.started: float | None = None  # the start of the review under way
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        start = None
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                try:
                    reviewing = c.get("/v1/status").json()["gate"]["reviewing"]
                except (httpx.HTTPError, KeyError, ValueError):
                    reviewing = None
                now = time.time()
                if reviewing and start is None:
                    start = self.started = now
                elif not reviewing and start is not None:
                    self.intervals.append((start, now))
                    start = self.started = None
                time.sleep(0.1)

    def __enter__(self) -> Reviews:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join()


def steps(db: Path) -> list[dict[str, Any]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT version, started_at, finished_at, outcome, metrics FROM train_steps ORDER BY step").fetchall()
    finally:
        conn.close()
    return [{"version": v, "started_at": s, "finished_at": f, "outcome": o, **json.loads(m or "{}")} for v, s, f, o, m in rows]


def train_once(c: httpx.Client, db: Path, reviews: Reviews, load: Clients | None = None,
               window_s: float = 0) -> dict[str, Any]:
    """Rate fresh main calls until a step starts, then wait for it and its review to end.

    With `load` and `window_s`, the clients pause once the review has run `window_s` seconds, so
    the rest of it runs unmeasured at the speed of an idle daemon; they resume when it ends."""
    before, reviewed = len(steps(db)), len(reviews.intervals)
    k = 0
    while len(steps(db)) == before and not c.get("/v1/status").json()["training"]["training_now"]:
        session = uuid.uuid4().hex
        c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 6, "messages": [
            {"role": "user", "content": f"say something about {session[:6]}"}]},
               headers={"x-session-id": session, "x-turn-type": "main"}).raise_for_status()
        c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": ("thumbs_up", "thumbs_down")[k % 2],
                                     "session_id": session}).raise_for_status()
        k += 1
    while len(steps(db)) == before or len(reviews.intervals) == reviewed:
        if len(steps(db)) > before and steps(db)[-1]["outcome"] != "committed":
            break  # a failed step has no review
        if load and window_s and reviews.started and time.time() > reviews.started + window_s:
            load.paused.set()
        time.sleep(0.2)
    if load:
        load.paused.clear()
    return steps(db)[-1]


class Stopped(Exception):
    """SIGTERM during the measured rounds: summarise and write the rounds done so far."""


def stop(*_: object) -> None:
    raise Stopped


def label(r: dict[str, float], windows: dict[str, list[tuple[float, float]]]) -> str | None:
    return next((name for name, spans in windows.items() if any(a <= r["start"] < b for a, b in spans)), None)


def ttft(done: list[dict[str, float]]) -> dict[str, Any]:
    xs = [r["ttft_s"] for r in done]
    return {"n": len(xs), "p50": pct(xs, 50) if xs else None, "p99": pct(xs, 99) if xs else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds, after one warm-up")
    ap.add_argument("--burners", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--probes", type=int, default=0, help="gate probes used (0: the whole set)")
    ap.add_argument("--gate-window-s", type=float, default=0,
                    help="measure the first N s of each review, then pause the clients until it ends (0: all of it)")
    ap.add_argument("--micro-batch-tokens", type=int, default=0, help="the trainer's budget (0: the daemon's default)")
    args = ap.parse_args()

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    env = {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__METHOD": "binary", "CLAWBACK_TRAIN__BATCH_SIZE": str(args.batch),
           "CLAWBACK_TRAIN__MAX_STALENESS": "1000", "CLAWBACK_GATE": json.dumps({"guard_replies": 0, "probes": args.probes})}
    if args.micro_batch_tokens:
        env["CLAWBACK_TRAIN__MICRO_BATCH_TOKENS"] = str(args.micro_batch_tokens)
    d = Daemon(args.model, Path(tempfile.mkdtemp(prefix="clawback-bench-")), 0, "cpu", "warning", env=env)
    db = d.data_dir / "clawback.db"
    rounds: list[dict[str, Any]] = []
    try:
        d.wait_ready(timeout=1800)
        with httpx.Client(base_url=d.url, timeout=3600) as c, Reviews(d.url) as reviews:
            warm = train_once(c, db, reviews)
            print(f"warm-up step: {warm['outcome']}", flush=True)
            signal.signal(signal.SIGTERM, stop)
            with Clients(d.url, args.streams, args.max_tokens) as load:
                try:
                    for r in range(args.rounds):
                        loads = [Path("/proc/loadavg").read_text().split()[0]]
                        idle = (time.time(), time.time() + args.idle_s)
                        time.sleep(args.idle_s)
                        step = train_once(c, db, reviews, load, args.gate_window_s)
                        loads.append(Path("/proc/loadavg").read_text().split()[0])
                        whole = [(a, b) for a, b in reviews.intervals if a >= step["started_at"]]
                        review = [(a, min(b, a + args.gate_window_s) if args.gate_window_s else b) for a, b in whole]
                        windows = {"idle": [idle], "training": [(step["started_at"], step["finished_at"])], "gate": review}
                        by = {name: [x for x in list(load.done) if label(x, windows) == name] for name in LABELS}
                        row: dict[str, Any] = {"round": r, "loadavg": loads, "step": step, "review_s": [b - a for a, b in whole],
                                               **{name: ttft(by[name]) for name in LABELS}}
                        for name in ("training", "gate"):
                            for q in ("p50", "p99"):
                                row[f"{name}_{q}_ratio"] = (row[name][q] / row["idle"][q]
                                                            if row[name][q] and row["idle"][q] else None)
                        rounds.append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "step"}), flush=True)
                except Stopped:
                    print(f"stopped after {len(rounds)} measured rounds", flush=True)
            errors, requests = load.errors, list(load.done)
    finally:
        d.stop()
        for b in burners:
            b.kill()
            b.wait()

    def med(xs: list[Any]) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    summary: dict[str, Any] = {f"{name}_{q}_ratio": med([r[f"{name}_{q}_ratio"] for r in rounds])
                               for name in ("training", "gate") for q in ("p50", "p99")}
    summary.update({f"ttft_{name}_{q}_s": med([r[name][q] for r in rounds]) for name in LABELS for q in ("p50", "p99")})
    summary.update(requests={name: sum(r[name]["n"] for r in rounds) for name in LABELS},
                   step_time_s=med([r["step"].get("step_time_s") for r in rounds]),
                   yielded_s=med([r["step"].get("yielded_s") for r in rounds]),
                   review_s=med([sum(r["review_s"]) for r in rounds]),
                   steps_failed=sum(r["step"]["outcome"] != "committed" for r in rounds), request_errors=len(errors))
    print(json.dumps(summary, indent=1))
    write_result("serve_while_training", {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                          "rounds": rounds, "requests": requests})


if __name__ == "__main__":
    main()
