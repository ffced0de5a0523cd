"""How long does each dashboard section take to render as the store grows?

Fills a fresh store through the real writer (`Store.submit`) with S sessions of M main calls each
(prompts of 300 token ids, replies of 60, their logprobs), one untagged call per session, 👍/👎 on
a third of the main calls and a correction on a tenth, then starts the real daemon on it
(`python -m clawback.daemon.cli serve`, tiny random Llama, training and judge off, no key), logs
in to /ui and times, interleaved over R rounds, `GET /ui/part/<name>` for every section
and `GET /ui/` (all sections at once). The page re-fetches its sections after every store commit
(at most once per second while calls arrive), so a section's time is what an open dashboard
adds per second to a busy daemon's threads.

    .venv/bin/python bench/dashboard.py --sessions 100 1000 5000 --calls 10 --rounds 9

Prints a table of medians (ms) per store size. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from _common import DEFAULT_MODEL, Daemon, tiny_model

from clawback.daemon.store import Store
from clawback.records import Call, FeedbackRecord

PARTS = ("health", "learning", "feedback", "versions", "conversations")


async def fill(db: Path, sessions: int, calls: int, rng: random.Random) -> None:
    store = Store(db, queue_size=100_000)
    feedback = []
    t0 = time.time() - sessions * calls * 10
    for s in range(sessions):
        sid = f"bench-{s}"
        for i in range(calls + 1):
            main = i < calls
            ts = t0 + (s * calls + i) * 10
            rec = Call(
                call_id=f"c-{s}-{i}", session_id=sid if main else f"anon-{s}", turn_id=None,
                request_id=str(uuid.uuid4()), turn_type="main" if main else "side",
                state="awaiting_next_state" if main else "served", created_at=ts, finished_at=ts + 1,
                model="bench", adapter_version=None,
                request={"messages": [{"role": "user", "content": f"question {i}"}]},
                prompt_text="x" * 1200, prompt_ids=[rng.randrange(49152) for _ in range(300)],
                response_ids=[rng.randrange(49152) for _ in range(60)], behaviour_logprobs=[-1.0] * 60,
                response_text="an answer " * 25, tool_calls=None, finish_reason="stop", timings={})
            store.add_call(rec)
            if main and i % 3 == 0:
                kind = rng.choice(["thumbs_up", "thumbs_down"]) if i % 10 else "correction"
                ev = {"event_id": str(uuid.uuid4()), "kind": kind, "session_id": sid, "target": "last",
                      "text": "shorter, please" if kind == "correction" else None, "source": "bench"}
                feedback.append(store.apply_feedback(FeedbackRecord.of(ev), ts + 2))
        if s % 200 == 0:  # committed in the writer's batches, not one transaction each
            await asyncio.gather(*feedback)
            feedback = []
    await asyncio.gather(*feedback)
    store.flush(600)
    store.close()


def measure(url: str, rounds: int) -> dict[str, float]:
    with httpx.Client(base_url=url, timeout=600) as c:
        c.get("/ui/login")  # a daemon without a key logs the dashboard in at once
        assert "clawback_ui" in c.cookies, "login failed"
        times: dict[str, list[float]] = {name: [] for name in (*PARTS, "page")}
        for _ in range(rounds):
            for name in times:
                t = time.perf_counter()
                r = c.get("/ui/" if name == "page" else f"/ui/part/{name}")
                times[name].append(time.perf_counter() - t)
                r.raise_for_status()
        return {name: 1000 * statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[100, 1000, 5000])
    ap.add_argument("--calls", type=int, default=10, help="main calls per session")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="clawback-bench-dashboard-"))
    model = tiny_model(DEFAULT_MODEL, tmp / "tiny")
    env = {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__ENABLED": "false"}
    print(f"| main calls | {' | '.join(PARTS)} | whole page |\n|---|{'---|' * (len(PARTS) + 1)}")
    for sessions in args.sessions:
        data = tmp / f"data-{sessions}"
        data.mkdir()
        t = time.time()
        asyncio.run(fill(data / "clawback.db", sessions, args.calls, random.Random(0)))
        fill_s = time.time() - t
        d = Daemon(model, data, threads=1, device="cpu", log_level="warning", env=env).wait_ready()
        try:
            ms = measure(d.url, args.rounds)
        finally:
            d.stop()
        cells = " | ".join(f"{ms[name]:.1f}" for name in (*PARTS, "page"))
        print(f"| {sessions * args.calls:,} | {cells} |   (filled in {fill_s:.0f} s)", flush=True)
        shutil.rmtree(data)
    shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
