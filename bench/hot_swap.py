"""What does a hot-swap cost the clients that are streaming while it happens?

Starts the real daemon (`python -m clawback.daemon.cli serve ...`, embedded engine, judge and
training off) and, from this process, N clients (default 8) that stream chat completions back to
back (each asks for a random max_tokens in [m/2, 1.5 m], so they do not finish in lockstep). Time
is cut into pairs of windows, interleaved: a window in which the live version is switched with
`POST /v1/adapters/rollback` (default 3 swaps, 2 s apart, each to a version that is not loaded, so
each is a full go-live: validate, load into the engine, activate, unload the old version once its
last generation ends), then a window of the same length without swaps. A window with swaps lasts
until every generation started before its last swap has ended, so the deferred unload is counted
in it and never leaks into the next window (the run reports any that did). Per window: the
longest gap between two consecutive SSE tokens of any one stream, and the p99 gap.

    added stall = median over repetitions of (max gap in a window with swaps)
                - median over repetitions of (max gap in a window without swaps)

also for the p99 gap, and paired per repetition. Swap latency is reported as the daemon sees it
(`swap_s` in the rollback response) and as the caller sees it (request to response), with the
longest token gap that overlaps each swap call. Errors (non-200, a stream that does not end in
`[DONE]`, an error event, a failed swap) must be 0. Last, a rollback probe: one swap, then at once
back to the version that was live before it, while its generations still run (counts in errors).

The adapter versions are real ones: before measuring, a daemon with training on (binary method,
batch size 1) gets K thumbs-up'd replies and trains v1..vK; that data dir is cached under the
temp dir and reused by later runs of the same model and K (`--fresh` retrains). The measuring
daemon runs on a copy of its store with training off.

    .venv/bin/python bench/hot_swap.py                 # embedded SmolLM2-135M, 8 clients
    .venv/bin/python bench/hot_swap.py --model tiny    # 2-layer random Llama, same tokenizer
    .venv/bin/python bench/hot_swap.py --instrument    # + per-step timing of each go-live in the daemon

After the daemon stops, the same model is loaded in this process and the engine-side steps of a
swap (validate, load on the engine's worker thread, unload) are timed on an idle engine, with a
cProfile split of one load and the cost of copying weights into an existing adapter slot, to show
where the stall comes from.

Prints a table and writes bench/results/hot_swap-<timestamp>.json (every window, gap, swap and
stream). Target: 0 errors, added stall <= 50 ms. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime as dt
import hashlib
import json
import os
import pstats
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from _common import DEFAULT_MODEL, REPO, Daemon, cpu_ns, machine, machine_busy_ns, pct, summary, tiny_model

CACHE = Path(tempfile.gettempdir()) / "clawback-bench-hot-swap"
TARGET_STALL_MS = 50.0

PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, covering the frame, gears, brakes and wheels.",
    "Describe the water cycle step by step for a school textbook chapter.",
    "Write a travel guide to a small coastal town: food, walks, history and where to stay.",
    "List twenty ideas for a rainy weekend at home and explain each one.",
    "Tell me everything you know about the history of the printing press.",
]


# ---------------------------------------------------------------- small helpers


def now() -> float:
    return time.perf_counter()


# ---------------------------------------------------------------- the daemon

# --instrument only: the daemon is started as `python <this shim> serve ...`, which times the steps
# of a go-live (patched wrappers, nothing else changes) into $CLAWBACK_BENCH_SWAP_LOG, then runs
# clawback.daemon.cli.main. "call" = as awaited on the event loop; "worker" = the part that runs
# on the engine's worker thread; their difference is the wait for the worker to finish its round.
SHIM = r'''
import functools, json, os, sys, threading, time
LOG = os.environ["CLAWBACK_BENCH_SWAP_LOG"]
_lock = threading.Lock()

def rec(phase, t0, arg=None):
    t1 = time.perf_counter()
    with _lock, open(LOG, "a") as f:
        f.write(json.dumps({"phase": phase, "start": t0, "ms": (t1 - t0) * 1e3, "arg": arg,
                            "thread": threading.current_thread().name}) + "\n")

def wrap_sync(obj, name, phase):
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            rec(phase, t0, str(a[1]) if len(a) > 1 else None)
    setattr(obj, name, w)

def wrap_async(obj, name, phase, only=None):
    orig = getattr(obj, name)
    @functools.wraps(orig)
    async def w(*a, **k):
        if only is not None and (len(a) < 2 or a[1] != only):
            return await orig(*a, **k)
        t0 = time.perf_counter()
        try:
            return await orig(*a, **k)
        finally:
            rec(phase, t0, str(a[1]) if len(a) > 1 else None)
    setattr(obj, name, w)

import clawback.adapter_format as files
from clawback.daemon import adapters, store
from clawback.engines import embedded
wrap_async(adapters.AdapterManager, "go_live", "go_live (swap_s)")
wrap_sync(files, "validate", "validate (thread)")
wrap_async(embedded.EmbeddedEngine, "load_adapter", "load_adapter call")
wrap_sync(embedded.EmbeddedEngine, "_load", "load_adapter worker")
wrap_async(embedded.EmbeddedEngine, "activate", "activate")
wrap_async(store.Store, "set_live", "store commit adapter_live")
wrap_async(embedded.EmbeddedEngine, "unload", "unload call")
wrap_sync(embedded.EmbeddedEngine, "_unload", "unload worker")
wrap_sync(embedded.EmbeddedEngine, "_delete_adapter", "delete_adapter worker")
from clawback.daemon.cli import main
sys.exit(main(sys.argv[1:]))
'''


def start_daemon(model_dir: Path, data_dir: Path, env: dict[str, str], threads: int, device: str, log_level: str,
                 instrument: bool = False) -> Daemon:
    """The daemon; with `instrument`, run through SHIM, which logs each step of a go-live."""
    if not instrument:
        return Daemon(model_dir, data_dir, threads, device, log_level, env)
    data_dir.mkdir(parents=True, exist_ok=True)
    shim = data_dir / "instrument_shim.py"
    shim.write_text(SHIM)
    return Daemon(model_dir, data_dir, threads, device, log_level,
                  {**env, "CLAWBACK_BENCH_SWAP_LOG": str(data_dir / "swap_phases.jsonl")}, entry=[str(shim)])


# ---------------------------------------------------------------- adapter versions (trained once, cached)


def prepare_versions(model_dir: Path, k: int, fresh: bool, threads: int, device: str, log_level: str) -> dict[str, Any]:
    """A data dir whose store holds committed versions v1..vK, trained by a real daemon from K
    thumbs-up'd replies (binary method, batch size 1). Cached per model dir and K."""
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:8]
    root = CACHE / f"{model_dir.name}-{key}-k{k}"
    marker = root / "ready.json"
    if marker.is_file() and not fresh:
        info = json.loads(marker.read_text())
        if all(Path(p).is_dir() for p in info["paths"].values()):
            info["cached"] = True
            return info
    shutil.rmtree(root, ignore_errors=True)
    data = root / "data"
    env = {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__ENABLED": "true", "CLAWBACK_TRAIN__METHOD": "binary", "CLAWBACK_TRAIN__BATCH_SIZE": "1",
           "CLAWBACK_TRAIN__KEEP_VERSIONS": str(max(k, 5))}
    print(f"training v1..v{k} with a daemon (binary, batch size 1) into {root}", flush=True)
    t0 = time.time()
    d = start_daemon(model_dir, data, env, threads, device, log_level)
    train_s: list[float] = []
    try:
        d.wait_ready()
        with httpx.Client(base_url=d.url, timeout=600) as c:
            for v in range(1, k + 1):
                t = time.time()
                session = f"hot-swap-train-{v}"
                c.post("/v1/chat/completions", json={
                    "model": "clawback", "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"Say something nice about number {v}."}]},
                    headers={"x-session-id": session, "x-turn-type": "main"}).raise_for_status()
                time.sleep(0.3)  # the call reaches the store before its feedback
                ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "thumbs_up",
                                                   "session_id": session}).json()
                if ack.get("type") != "ack":
                    raise RuntimeError(f"feedback not acked: {ack}")
                deadline = time.time() + 900
                while c.get("/v1/adapters").json()["live"] != v:
                    if time.time() > deadline or d.proc.poll() is not None:
                        raise RuntimeError(f"v{v} did not go live; daemon log:\n{d.log.read_text()[-4000:]}")
                    time.sleep(0.3)
                train_s.append(time.time() - t)
                print(f"  v{v} live after {train_s[-1]:.1f} s", flush=True)
            rows = c.get("/v1/adapters").json()["data"]
    finally:
        d.stop()
    paths = {str(r["version"]): r["path"] for r in rows if r["version"] <= k}
    sizes = {v: {f.name: f.stat().st_size for f in Path(p).iterdir()} for v, p in paths.items()}
    info = {"root": str(root), "data_dir": str(data), "versions": list(range(1, k + 1)), "paths": paths,
            "file_bytes": sizes, "train_s_per_version": train_s, "prepare_s": time.time() - t0,
            "daemon_env": d.env, "created": dt.datetime.now().astimezone().isoformat()}
    marker.write_text(json.dumps(info, indent=1))
    info["cached"] = False
    return info


def serving_copy(prepared: dict[str, Any]) -> Path:
    """A fresh data dir with a copy of the prepared store (its adapter rows point at the cached
    version dirs, which are only read)."""
    dst = Path(tempfile.mkdtemp(prefix="clawback-bench-hot-swap-"))
    src = Path(prepared["data_dir"])
    for f in src.iterdir():
        if f.is_file() and f.name.startswith("clawback.db"):
            shutil.copy2(f, dst / f.name)
    return dst


# ---------------------------------------------------------------- the measurement


class Run:
    """Streaming clients, swaps, windows: all timestamps are perf_counter seconds of this process."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.n_clients, self.max_tokens = url, clients, max_tokens
        self.longest = int(max_tokens * 1.5)  # each request asks for a random length in [mt/2, 1.5 mt]
        self.streams: list[dict[str, Any]] = []
        self.swaps: list[dict[str, Any]] = []
        self.windows: list[dict[str, Any]] = []
        self.stop = asyncio.Event()
        self.running: dict[int, dict[str, Any]] = {}  # id -> stream record, while it runs

    async def client(self, i: int, http: httpx.AsyncClient) -> None:
        # Random lengths keep the clients from finishing (and prefilling) in lockstep; the seed
        # makes a run's sequence of requests repeatable.
        rng = random.Random(i)
        await asyncio.sleep(0.1 * i)
        n = 0
        while not self.stop.is_set():
            length = rng.randint(max(1, self.max_tokens // 2), self.longest)
            body = {"model": "clawback", "stream": True, "max_tokens": length, "temperature": 1.0,
                    "messages": [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}]}
            n += 1
            rec: dict[str, Any] = {"client": i, "t_send": now(), "tokens": [], "status": None, "adapter": None,
                                   "done": False, "error": None, "finish": None}
            self.running[id(rec)] = rec
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body,
                                       headers={"x-session-id": f"hot-swap-{i}", "x-turn-type": "side"}) as r:
                    rec["status"] = r.status_code
                    rec["adapter"] = r.headers.get("x-clawback-adapter")
                    if r.status_code != 200:
                        rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            payload = line[6:]
                            if payload == "[DONE]":
                                rec["done"] = True
                                break
                            data = json.loads(payload)
                            if "error" in data:
                                rec["error"] = f"error event: {data['error']}"
                                break
                            t = now()
                            for choice in data.get("choices", []):
                                if choice["delta"].get("content"):
                                    rec["tokens"].append(t)
                                rec["finish"] = choice.get("finish_reason") or rec["finish"]
                        if not rec["done"] and rec["error"] is None:
                            rec["error"] = "stream ended without [DONE]"
            except Exception as e:  # every failure counts
                rec["error"] = repr(e)
            rec["t_end"] = now()
            self.running.pop(id(rec), None)
            self.streams.append(rec)
            if rec["error"]:
                await asyncio.sleep(0.05)  # do not spin on a dead daemon

    async def swap(self, ctl: httpx.AsyncClient, version: int, warmup: bool, probe: bool = False) -> dict[str, Any]:
        before = (await ctl.get("/v1/adapters")).json()["live"]
        rec: dict[str, Any] = {"version": version, "previous": before, "warmup": warmup, "probe": probe, "t_send": now()}
        try:
            r = await ctl.post("/v1/adapters/rollback", json={"version": version, "force": True})  # also back to one it left
            rec["t_recv"] = now()
            rec["status"] = r.status_code
            body = r.json()
            rec["swap_s"] = body.get("swap_s")
            rec["live"] = body.get("live")
            if r.status_code != 200 or body.get("live") != version:
                rec["error"] = f"HTTP {r.status_code}: {body}"
        except Exception as e:
            rec["t_recv"] = now()
            rec["error"] = repr(e)
        rec["client_s"] = rec["t_recv"] - rec["t_send"]
        self.swaps.append(rec)
        return rec

    async def main(self, versions: list[int], reps: int, swaps_per_window: int, spacing_s: float, window_s: float,
                   warmup_s: float, warmup_swaps: int, lead_s: float, rollback_probe: bool = True) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=self.n_clients + 4, max_keepalive_connections=self.n_clients + 4)
        async with httpx.AsyncClient(base_url=self.url, timeout=600, limits=limits) as http, \
                httpx.AsyncClient(base_url=self.url, timeout=600) as ctl:
            live = (await ctl.get("/v1/adapters")).json()["live"]
            order = [v for v in versions if v != live] + ([live] if live in versions else [])
            targets = iter(order * (reps * swaps_per_window + warmup_swaps + 2))
            tasks = [asyncio.create_task(self.client(i, http)) for i in range(self.n_clients)]
            t_start = now()
            try:
                await asyncio.sleep(warmup_s)
                for _ in range(warmup_swaps):  # first swaps of a process pay one-time costs
                    await self.swap(ctl, next(targets), warmup=True)
                    await asyncio.sleep(spacing_s)
                await self.settle(self.swaps[-1]["t_recv"] if self.swaps else now(), 0.0)
                print(f"  warm-up done: {len(self.streams)} streams; {reps} repetitions of a window with "
                      f"{swaps_per_window} swaps, then one without", flush=True)
                m0, c0, w0 = machine_busy_ns(), cpu_ns(), now()
                for rep in range(reps):
                    # With swaps: the window lasts until every generation that started before its
                    # last swap answered has ended (plus a margin), so the old versions' deferred
                    # unloads fall inside it. Then a window without swaps of the same length.
                    w = {"rep": rep, "kind": "swap", "start": now(), "swaps": []}
                    for j in range(swaps_per_window):
                        at = w["start"] + lead_s + j * spacing_s
                        await asyncio.sleep(max(0.0, at - now()))
                        rec = await self.swap(ctl, next(targets), warmup=False)
                        w["swaps"].append(len(self.swaps) - 1)
                        rec["window"] = len(self.windows)
                    w["end"] = await self.settle(self.swaps[-1]["t_recv"], w["start"] + window_s)
                    self.windows.append(w)
                    q = {"rep": rep, "kind": "quiet", "start": now(), "swaps": []}
                    q["end"] = q["start"] + (w["end"] - w["start"])
                    await asyncio.sleep(max(0.0, q["end"] - now()))
                    self.windows.append(q)
                    print(f"  repetition {rep + 1}/{reps} done (windows of {w['end'] - w['start']:.1f} s)", flush=True)
                busy = {"machine_ns": machine_busy_ns() - m0, "self_ns": cpu_ns() - c0, "wall_s": now() - w0}
                if rollback_probe:
                    # The rollback an operator does when a new version is bad: straight back to the
                    # one that was live a moment ago, while its generations are still running.
                    first = await self.swap(ctl, next(targets), warmup=False, probe=True)
                    if not first.get("error") and first["previous"] is not None:
                        await self.swap(ctl, first["previous"], warmup=False, probe=True)
            finally:
                self.stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)
            metrics = (await ctl.get("/metrics")).text
        lengths = [w["end"] - w["start"] for w in self.windows if w["kind"] == "swap"]
        return {"t_start": t_start, "window_s": statistics.median(lengths) if lengths else None, "busy": busy,
                "metrics": metrics}

    async def settle(self, since: float, not_before: float, margin_s: float = 0.5) -> float:
        """Wait until no stream sent before `since` is still running, then `margin_s` more (and
        at least until `not_before`); returns that time."""
        while any(r["t_send"] < since for r in self.running.values()):
            await asyncio.sleep(0.05)
        end = max(now() + margin_s, not_before)
        await asyncio.sleep(max(0.0, end - now()))
        return end


def analyse(run: Run, versions_at: dict[str, Any]) -> dict[str, Any]:
    gaps: list[tuple[float, float, int]] = []  # (start, end, client)
    ttfts: list[tuple[float, float]] = []  # (first token time, ttft)
    for s in run.streams:
        toks = s["tokens"]
        gaps += [(a, b, s["client"]) for a, b in zip(toks, toks[1:])]
        if toks:
            ttfts.append((toks[0], toks[0] - s["t_send"]))
    for i, w in enumerate(run.windows):
        g = [(b - a) * 1e3 for a, b, _ in gaps if w["start"] <= b < w["end"]]
        t = [x * 1e3 for at, x in ttfts if w["start"] <= at < w["end"]]
        w.update(index=i, n_gaps=len(g), max_gap_ms=max(g) if g else float("nan"), p99_gap_ms=pct(g, 99),
                 p50_gap_ms=pct(g, 50), max_ttft_ms=max(t) if t else float("nan"),
                 tokens_per_s=len(g) / (w["end"] - w["start"]), gaps_ms=[round(x, 2) for x in g])
    # per swap: the longest token gap that overlaps the swap call, and when the old version's last
    # generation ended (its deferred unload runs then), relative to the end of the swap's window
    for s in run.swaps:
        over = [(b - a) * 1e3 for a, b, _ in gaps if a < s["t_recv"] and b > s["t_send"]]
        s["max_gap_over_swap_ms"] = max(over) if over else None
        old = f"v{s['previous']}" if s["previous"] is not None else None
        ends = [x["t_end"] for x in run.streams if x["adapter"] == old and x["t_send"] < s["t_recv"]]
        s["old_version_last_stream_end"] = max(ends) if ends else None
    # the same interval as each swap call, at the same offset in the window without swaps of its pair
    for w in run.windows:
        q = next((x for x in run.windows if x["rep"] == w["rep"] and x["kind"] == "quiet"), None)
        for k in w["swaps"]:
            s = run.swaps[k]
            if q is None:
                continue
            a0 = q["start"] + (s["t_send"] - w["start"])
            a1 = a0 + (s["t_recv"] - s["t_send"])
            over = [(b - a) * 1e3 for a, b, _ in gaps if a < a1 and b > a0]
            s["max_gap_same_interval_no_swap_ms"] = max(over) if over else None
    outside = sum(1 for w in run.windows for k in w["swaps"]
                  if (run.swaps[k]["old_version_last_stream_end"] or 0) > w["end"])
    # routing: a stream sent after a swap answered (and before the next one was sent) must be served by it
    wrong = 0
    ordered = sorted(run.swaps, key=lambda x: x["t_send"])
    for a, b in zip(ordered, ordered[1:] + [None]):
        if a.get("error"):
            continue
        hi = b["t_send"] if b else float("inf")
        wrong += sum(1 for x in run.streams if a["t_recv"] < x["t_send"] < hi and x["status"] == 200
                     and x["adapter"] != f"v{a['version']}")
    errors = [{"client": s["client"], "t": s["t_send"] - versions_at["t_start"], "error": s["error"]}
              for s in run.streams if s["error"]]
    errors += [{"swap": s["version"], "error": s["error"]} for s in run.swaps if s.get("error")]

    def med(ws: list[dict], key: str) -> float:
        return statistics.median(w[key] for w in ws) if ws else float("nan")

    measured = [s for s in run.swaps if not s["warmup"] and not s["probe"] and not s.get("error")]
    probe = [s for s in run.swaps if s["probe"]]
    quiet = [w for w in run.windows if w["kind"] == "quiet"]
    swapw = [w for w in run.windows if w["kind"] == "swap"]
    reps = sorted({w["rep"] for w in run.windows})
    by_rep = {r: {w["kind"]: w for w in run.windows if w["rep"] == r} for r in reps}

    paired_max = [by_rep[r]["swap"]["max_gap_ms"] - by_rep[r]["quiet"]["max_gap_ms"] for r in reps]
    paired_p99 = [by_rep[r]["swap"]["p99_gap_ms"] - by_rep[r]["quiet"]["p99_gap_ms"] for r in reps]
    out = {
        "swaps_measured": len(measured),
        "swap_s_daemon_ms": summary([s["swap_s"] * 1e3 for s in measured]),
        "swap_client_ms": summary([s["client_s"] * 1e3 for s in measured]),
        "max_gap_over_swap_ms": summary([s["max_gap_over_swap_ms"] for s in measured if s["max_gap_over_swap_ms"]]),
        "max_gap_same_interval_no_swap_ms": summary([s["max_gap_same_interval_no_swap_ms"] for s in measured
                                                     if s.get("max_gap_same_interval_no_swap_ms")]),
        # per swap: the longest gap over the swap call minus the longest gap over the same interval
        # of the window without swaps of its pair
        "stall_at_swap_ms": summary([s["max_gap_over_swap_ms"] - s["max_gap_same_interval_no_swap_ms"]
                                     for s in measured if s["max_gap_over_swap_ms"]
                                     and s.get("max_gap_same_interval_no_swap_ms")]),
        "windows": {"per_kind": len(quiet), "length_s": run.windows[0]["end"] - run.windows[0]["start"] if run.windows else None},
        "max_gap_ms": {"quiet": med(quiet, "max_gap_ms"), "swap": med(swapw, "max_gap_ms")},
        "p99_gap_ms": {"quiet": med(quiet, "p99_gap_ms"), "swap": med(swapw, "p99_gap_ms")},
        "p50_gap_ms": {"quiet": med(quiet, "p50_gap_ms"), "swap": med(swapw, "p50_gap_ms")},
        "max_ttft_ms": {"quiet": med(quiet, "max_ttft_ms"), "swap": med(swapw, "max_ttft_ms")},
        "tokens_per_s": {"quiet": med(quiet, "tokens_per_s"), "swap": med(swapw, "tokens_per_s")},
        "added_stall_ms": med(swapw, "max_gap_ms") - med(quiet, "max_gap_ms"),
        "added_p99_gap_ms": med(swapw, "p99_gap_ms") - med(quiet, "p99_gap_ms"),
        "added_stall_paired_median_ms": statistics.median(paired_max) if paired_max else float("nan"),
        "added_p99_paired_median_ms": statistics.median(paired_p99) if paired_p99 else float("nan"),
        "max_gap_range_ms": {"quiet": [min((w["max_gap_ms"] for w in quiet), default=None),
                                       max((w["max_gap_ms"] for w in quiet), default=None)],
                             "swap": [min((w["max_gap_ms"] for w in swapw), default=None),
                                      max((w["max_gap_ms"] for w in swapw), default=None)]},
        "streams": len(run.streams),
        "streams_ok": sum(1 for s in run.streams if not s["error"]),
        "adapters_seen": sorted({s["adapter"] for s in run.streams if s["adapter"]}),
        "errors": len(errors),
        "error_samples": errors[:10],
        "wrong_version_streams": wrong,
        "rollback_probe": [{"version": s["version"], "previous": s["previous"], "status": s.get("status"),
                            "swap_s": s.get("swap_s"), "error": s.get("error")} for s in probe],
        "deferred_unloads_outside_window": outside,
    }
    out["meets"] = {"errors": out["errors"] == 0, "stall": out["added_stall_ms"] <= TARGET_STALL_MS,
                    "stall_at_swap": out["stall_at_swap_ms"].get("p50", float("inf")) <= TARGET_STALL_MS}
    return out


# ---------------------------------------------------------------- where the time of a swap goes


def engine_breakdown(model_dir: Path, paths: dict[str, str], threads: int, device: str, n: int) -> dict[str, Any]:
    """The engine-side steps of a go-live, in this process on an idle engine: validate (a thread in
    the daemon), load_adapter (the engine's worker thread: every stream waits), unload. Then one
    load under cProfile, the cost of copying weights into an already-built slot, and a decode step."""
    import torch

    from clawback.adapter_format import validate
    from clawback.engines.embedded import EmbeddedEngine

    torch.set_num_threads(threads)
    engine = EmbeddedEngine(model_dir, device=device, torch_threads=threads)
    loop = asyncio.new_event_loop()
    versions = sorted(int(v) for v in paths)
    res: dict[str, Any] = {"validate_ms": [], "load_ms": [], "unload_ms": []}
    try:
        t = now()
        loop.run_until_complete(engine.load_adapter(f"v{versions[0]}", paths[str(versions[0])]))
        res["first_load_wraps_model_ms"] = (now() - t) * 1e3
        live = versions[0]
        loop.run_until_complete(engine.activate(f"v{live}"))
        for i in range(n):
            nxt = versions[(versions.index(live) + 1) % len(versions)]
            t = now()
            validate(paths[str(nxt)])
            res["validate_ms"].append((now() - t) * 1e3)
            t = now()
            loop.run_until_complete(engine.load_adapter(f"v{nxt}", paths[str(nxt)]))
            res["load_ms"].append((now() - t) * 1e3)
            loop.run_until_complete(engine.activate(f"v{nxt}"))
            t = now()
            loop.run_until_complete(engine.unload(f"v{live}"))
            res["unload_ms"].append((now() - t) * 1e3)
            live = nxt
        # one load under cProfile, called directly (the worker is idle, blocked on its queue)
        other = versions[(versions.index(live) + 1) % len(versions)]
        prof = cProfile.Profile()
        from clawback.engines.embedded_adapters import read_adapter

        weights, config = read_adapter(paths[str(other)])
        with torch.inference_mode():
            prof.runcall(engine._load, f"v{other}", paths[str(other)], weights, config)
        st = pstats.Stats(prof).stats  # (file, line, func) -> (cc, nc, tottime, cumtime, callers)
        total = sum(v[2] for v in st.values())

        def cum(func: str, file_part: str = "") -> float:
            return sum(v[3] for k, v in st.items() if k[2] == func and file_part in k[0]) * 1e3

        torch_tot = sum(v[2] for k, v in st.items() if k[0] == "~" and "torch" in k[2]) * 1e3
        res["profile_one_load"] = {
            "note": "cProfile times are inflated by the profiler; compare them with each other",
            "total_ms": total * 1e3,
            "inject_adapter_ms": cum("inject_adapter"),
            "create_and_replace_ms": cum("_create_and_replace"),
            "set_peft_model_state_dict_ms": cum("set_peft_model_state_dict"),
            "load_peft_weights_ms": cum("load_peft_weights"),
            "named_modules_tottime_ms": sum(v[2] for k, v in st.items() if k[2] == "named_modules") * 1e3,
            "builtin_torch_ops_tottime_ms": torch_tot,
            "top_cumulative": [
                {"func": f"{Path(k[0]).name}:{k[1]}({k[2]})", "calls": v[1], "cum_ms": round(v[3] * 1e3, 2),
                 "own_ms": round(v[2] * 1e3, 2)}
                for k, v in sorted(st.items(), key=lambda kv: -kv[1][3])[:15]],
        }
        # a slot that already exists: only the weights change (what a slot-reusing engine would pay)
        try:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            times = []
            for _ in range(max(3, n // 2)):
                t = now()
                sd = load_file(str(Path(paths[str(versions[0])]) / "adapter_model.safetensors"))
                with torch.inference_mode():
                    set_peft_model_state_dict(engine.model, sd, adapter_name=f"v{other}")
                times.append((now() - t) * 1e3)
            res["copy_weights_into_existing_slot_ms"] = times
            # the floor: the file read plus one tensor copy per LoRA matrix, no PEFT bookkeeping
            slot = f".v{other}."
            params = {name.replace(slot, "."): p for name, p in engine.model.named_parameters() if slot in name}
            times = []
            for _ in range(max(3, n // 2)):
                t = now()
                sd = load_file(str(Path(paths[str(versions[0])]) / "adapter_model.safetensors"))
                with torch.inference_mode():  # the slot's tensors were made on the worker, in inference mode
                    copied = sum(params[k].copy_(v) is not None for k, v in sd.items() if k in params)
                times.append((now() - t) * 1e3)
            res["raw_tensor_copy_ms"] = times
            res["raw_tensor_copy_matched"] = f"{copied}/{len(sd)}"
        except Exception as e:  # an experiment; the numbers above stand without it
            res["copy_experiment_error"] = repr(e)
        # a decode step with the adapter, one stream: the unit a stall is counted in
        info = engine.info

        def decode(adapter: str | None, steps: int = 24) -> list[float]:
            """Decode steps as the worker runs them (forward + log_softmax), here on this thread while
            the worker is idle; the first steps are not counted."""
            from transformers import DynamicCache

            times, cache, inp = [], DynamicCache(), [1, 2, 3, 4, 5, 6, 7, 8]
            with torch.inference_mode():
                for _ in range(steps + 4):
                    t = now()
                    out = engine._forward(inp, adapter, cache)
                    cache = out.cache
                    logits = out.logits[0, -1].float()
                    tok = int(torch.argmax(logits))
                    float(torch.log_softmax(logits, dim=-1)[tok])
                    inp = [tok]
                    times.append((now() - t) * 1e3)
            return times[4:]

        res["decode_step_ms"] = summary(decode(f"v{live}"))
        res["decode_step_base_ms"] = summary(decode(None))
        res["n_params"] = info.n_params
        res["lora_modules"] = sum(1 for m in engine.model.modules() if hasattr(m, "lora_A") and f"v{live}" in m.lora_A)
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    for k in ("validate_ms", "load_ms", "unload_ms", "copy_weights_into_existing_slot_ms", "raw_tensor_copy_ms"):
        if k in res:
            res[k + "_summary"] = summary(res[k])
    return res


def swap_phases(log: Path, run: Run, t_start: float) -> dict[str, Any]:
    """The --instrument log: per step of a go-live, its duration; for the steps on the engine's
    worker thread, also the longest token gap that overlaps them (perf_counter is the same
    monotonic clock in both processes)."""
    events = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    gaps = [(a, b) for s in run.streams for a, b in zip(s["tokens"], s["tokens"][1:])]
    for e in events:
        e["t"] = round(e["start"] - t_start, 4)
        if "worker" in e["phase"]:
            end = e["start"] + e["ms"] / 1e3
            over = [(b - a) * 1e3 for a, b in gaps if a < end and b > e["start"]]
            e["max_gap_over_ms"] = max(over) if over else None
    by: dict[str, list[float]] = {}
    over: dict[str, list[float]] = {}
    for e in events:
        if e["t"] < 0:
            continue  # restore() at start-up
        by.setdefault(e["phase"], []).append(e["ms"])
        if e.get("max_gap_over_ms"):
            over.setdefault(e["phase"], []).append(e["max_gap_over_ms"])
    return {"phases_ms": {k: summary(v) for k, v in by.items()},
            "max_gap_over_ms": {k: summary(v) for k, v in over.items()}, "events": events}


def print_phases(p: dict[str, Any]) -> None:
    print()
    print(f"{'--instrument: steps of a go-live (ms)':<40} {'n':>4} {'p50':>9} {'max':>9}  longest token gap over it p50")
    for k, v in p["phases_ms"].items():
        g = p["max_gap_over_ms"].get(k)
        print(f"{k:<40} {v['n']:>4} {v['p50']:>9.1f} {v['max']:>9.1f}  {g['p50'] if g else float('nan'):>9.1f}")


# ---------------------------------------------------------------- report


def print_table(a: dict[str, Any], eng: dict[str, Any] | None, window_s: float) -> None:
    def row(name: str, s: dict[str, float]) -> str:
        if not s.get("n"):
            return f"{name:<34} {'-':>6}"
        return f"{name:<34} {s['n']:>6} {s['p50']:>9.1f} {s['p99']:>9.1f} {s['max']:>9.1f}"

    print(f"{'swap latency (ms)':<34} {'n':>6} {'p50':>9} {'p99':>9} {'max':>9}")
    print(row("daemon (swap_s)", a["swap_s_daemon_ms"]))
    print(row("client (request -> response)", a["swap_client_ms"]))
    print(row("longest token gap over a swap call", a["max_gap_over_swap_ms"]))
    print(row("  same interval, window w/o swaps", a["max_gap_same_interval_no_swap_ms"]))
    print(row("  stall at the swap (difference)", a["stall_at_swap_ms"]))
    print()
    n = a["windows"]["per_kind"]
    print(f"token gaps, {n} windows per kind (median length {window_s:.1f} s), medians over windows (ms)")
    print(f"{'':<22} {'no swaps':>10} {'swaps':>10} {'added':>10}")
    for key, label in (("max_gap_ms", "max gap"), ("p99_gap_ms", "p99 gap"), ("p50_gap_ms", "p50 gap"),
                       ("max_ttft_ms", "max TTFT")):
        q, s = a[key]["quiet"], a[key]["swap"]
        print(f"{label:<22} {q:>10.1f} {s:>10.1f} {s - q:>+10.1f}")
    q, s = a["tokens_per_s"]["quiet"], a["tokens_per_s"]["swap"]
    print(f"{'tokens/s (all clients)':<22} {q:>10.1f} {s:>10.1f} {s - q:>+10.1f}")
    print(f"added stall (paired per repetition, median): max {a['added_stall_paired_median_ms']:+.1f} ms, "
          f"p99 {a['added_p99_paired_median_ms']:+.1f} ms")
    print(f"errors {a['errors']} (streams {a['streams_ok']}/{a['streams']} ok), streams on the wrong version "
          f"{a['wrong_version_streams']}, deferred unloads outside their window {a['deferred_unloads_outside_window']}, "
          f"versions seen {', '.join(a['adapters_seen'])}")
    for i, s in enumerate(a["rollback_probe"]):
        what = "swap to" if i == 0 else "immediate rollback to"
        print(f"rollback probe: {what} v{s['version']} (from v{s['previous']}): "
              + (f"HTTP {s['status']}, swap_s {s['swap_s'] * 1e3:.0f} ms" if not s["error"] else f"FAILED {s['error'][:160]}"))
    verdict = "met" if all(a["meets"].values()) else "MISSED: " + ", ".join(k for k, v in a["meets"].items() if not v)
    print(f"target: 0 errors, added stall <= {TARGET_STALL_MS:.0f} ms (windows, and p50 at the swap) -> {verdict}")
    if eng:
        print()
        print(f"engine alone, idle, {len(eng['load_ms'])} swaps (ms): validate p50 {eng['validate_ms_summary']['p50']:.1f}, "
              f"load (worker thread) p50 {eng['load_ms_summary']['p50']:.1f} / max {eng['load_ms_summary']['max']:.1f}, "
              f"unload p50 {eng['unload_ms_summary']['p50']:.1f}; decode step p50 {eng['decode_step_ms']['p50']:.1f} "
              f"with an adapter, {eng['decode_step_base_ms']['p50']:.1f} base; "
              f"{eng['lora_modules']} LoRA modules per version")
        p = eng["profile_one_load"]
        print(f"  one load under cProfile: {p['total_ms']:.0f} ms, of which PEFT inject_adapter {p['inject_adapter_ms']:.0f} "
              f"(module-tree walks named_modules {p['named_modules_tottime_ms']:.0f}), set_peft_model_state_dict "
              f"{p['set_peft_model_state_dict_ms']:.0f}, reading the file {p['load_peft_weights_ms']:.0f}")
        if "copy_weights_into_existing_slot_ms_summary" in eng:
            print(f"  copying a version's weights into an existing slot instead: p50 "
                  f"{eng['copy_weights_into_existing_slot_ms_summary']['p50']:.1f} ms with set_peft_model_state_dict")
        if "raw_tensor_copy_ms_summary" in eng:
            print(f"  ... or {eng['raw_tensor_copy_ms_summary']['p50']:.1f} ms as a file read + plain tensor copies "
                  f"({eng['raw_tensor_copy_matched']} tensors matched)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"model dir (default: the embedded model, {DEFAULT_MODEL}); 'tiny' = a 2-layer random Llama "
                         "with the same tokenizer")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    ap.add_argument("--versions", type=int, default=4, help="adapter versions to swap among (default 4)")
    ap.add_argument("--reps", type=int, default=6, help="repetitions of (window without swaps, window with swaps) (default 6)")
    ap.add_argument("--swaps-per-window", type=int, default=3, help="swaps in each swap window (default 3)")
    ap.add_argument("--spacing-s", type=float, default=2.0, help="seconds between swaps in a window (default 2)")
    ap.add_argument("--lead-s", type=float, default=1.0, help="seconds from a window's start to its first swap (default 1)")
    ap.add_argument("--window-s", type=float, default=6.0,
                    help="minimum window length; a window with swaps lasts at least until every generation that "
                         "started before its last swap has ended, and the window without swaps after it gets the "
                         "same length (default 6)")
    ap.add_argument("--max-tokens", type=int, default=16,
                    help="each streamed request asks for max_tokens drawn from [m/2, 1.5 m] (default m = 16)")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="streaming before the warm-up swaps (default 5)")
    ap.add_argument("--warmup-swaps", type=int, default=2, help="unmeasured swaps first (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the daemon's engine (default 1)")
    ap.add_argument("--device", default="auto", help="engine device (default auto)")
    ap.add_argument("--engine-swaps", type=int, default=10,
                    help="swaps timed on an idle in-process engine afterwards (0 = skip) (default 10)")
    ap.add_argument("--no-rollback-probe", action="store_true",
                    help="skip the last check: a swap, then at once back to the version live before it, whose "
                         "generations are still running (its result counts in errors)")
    ap.add_argument("--fresh", action="store_true", help="retrain the adapter versions instead of reusing the cached ones")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    ap.add_argument("--daemon-log-level", default="warning", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--keep-data", action="store_true", help="keep the measuring daemon's data dir (log and store)")
    ap.add_argument("--instrument", action="store_true",
                    help="evidence run: start the daemon through a shim that times each step of a go-live "
                         "(validate, load on the worker, activate, store commit, unload) instead of plain "
                         "`python -m clawback.daemon.cli serve`")
    args = ap.parse_args(argv)
    if args.versions < 2:
        ap.error("--versions must be at least 2")

    from clawback.daemon.models import ensure_embedded_model

    if args.model in (None, "tiny"):
        model_dir = ensure_embedded_model(DEFAULT_MODEL)
        if args.model == "tiny":
            model_dir = tiny_model(model_dir, Path(tempfile.gettempdir()) / "clawback-bench-tiny-llama")
    else:
        model_dir = Path(args.model).expanduser().resolve()
    started = dt.datetime.now().astimezone()
    print(f"hot_swap: model {model_dir}, {args.clients} streaming clients, {args.versions} versions, "
          f"torch threads {args.threads}", flush=True)
    info = machine()
    prepared = prepare_versions(model_dir, args.versions, args.fresh, args.threads, args.device, args.daemon_log_level)
    print(f"versions v1..v{args.versions}: {'cached' if prepared['cached'] else 'trained'} in {prepared['root']}", flush=True)

    data_dir = serving_copy(prepared)
    daemon = start_daemon(model_dir, data_dir, {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__ENABLED": "false"}, args.threads,
                          args.device, args.daemon_log_level, args.instrument)
    swap_log = data_dir / "swap_phases.jsonl" if args.instrument else None
    run = Run(daemon.url, args.clients, args.max_tokens)
    try:
        daemon.wait_ready()
        d_cpu0 = cpu_ns(daemon.proc.pid)
        print(f"daemon pid {daemon.proc.pid} at {daemon.url}, live v{httpx.get(daemon.url + '/v1/adapters').json()['live']}",
              flush=True)
        meta = asyncio.run(run.main(prepared["versions"], args.reps, args.swaps_per_window, args.spacing_s,
                                    args.window_s, args.warmup_s, args.warmup_swaps, args.lead_s,
                                    not args.no_rollback_probe))
        d_cpu = cpu_ns(daemon.proc.pid) - d_cpu0
    finally:
        daemon.stop()
    busy = meta["busy"]
    other_cores = max(busy["machine_ns"] - busy["self_ns"] - d_cpu, 0) / 1e9 / busy["wall_s"]
    analysis = analyse(run, meta)
    analysis["other_cores_approx"] = other_cores
    phases = swap_phases(swap_log, run, meta["t_start"]) if swap_log else None

    eng = None
    if args.engine_swaps:
        print("timing the engine-side steps of a swap on an idle in-process engine", flush=True)
        eng = engine_breakdown(model_dir, prepared["paths"], args.threads, args.device, args.engine_swaps)
    finished = dt.datetime.now().astimezone()

    print()
    print_table(analysis, eng, meta["window_s"])
    print(f"(other processes kept ~{other_cores:.2f} cores busy during the measurement, of {os.cpu_count()})")
    if phases:
        print_phases(phases)

    t0 = meta["t_start"]

    def rel(x: float | None) -> float | None:
        return None if x is None else round(x - t0, 4)

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"hot_swap-{started.strftime('%Y%m%d-%H%M%S')}.json"
    report = {
        "started": started.isoformat(), "finished": finished.isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "daemon_command": daemon.cmd, "daemon_env": daemon.env,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_dir": str(model_dir), "machine": info, "loadavg_at_end": Path("/proc/loadavg").read_text().strip(),
        "target": {"errors": 0, "added_stall_ms": TARGET_STALL_MS},
        "prepared_versions": prepared,
        "summary": analysis,
        "engine_breakdown": eng,
        "swap_phases": phases,
        "window_s": meta["window_s"],
        "times": "seconds since the clients started",
        "windows": [{**{k: v for k, v in w.items() if k not in ("start", "end")}, "start": rel(w["start"]),
                     "end": rel(w["end"])} for w in run.windows],
        "swaps": [{**{k: v for k, v in s.items() if not k.startswith("t_") and k != "old_version_last_stream_end"},
                   "t_send": rel(s["t_send"]), "t_recv": rel(s["t_recv"]),
                   "old_version_last_stream_end": rel(s["old_version_last_stream_end"])} for s in run.swaps],
        "streams": [{"client": s["client"], "t_send": rel(s["t_send"]), "t_end": rel(s["t_end"]), "status": s["status"],
                     "adapter": s["adapter"], "finish": s["finish"], "error": s["error"],
                     "tokens": [rel(t) for t in s["tokens"]]} for s in run.streams],
        "daemon_metrics": [ln for ln in meta["metrics"].splitlines()
                           if ln.startswith(("clawback_requests_total", "clawback_store_dropped", "clawback_swap_seconds"))],
    }
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {path}")
    if args.keep_data:
        print(f"daemon data dir kept: {data_dir}")
    else:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0 if analysis["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
