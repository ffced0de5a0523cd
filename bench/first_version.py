"""From a running daemon to the first trained version, with the defaults a newcomer gets.

Starts `clawback serve` on the embedded model (defaults: batch 16, judge off), sends 16 tagged main
turns (the way the OpenClaw plugin tags them), rates each reply with 👍 or 👎 over `POST
/v1/feedback` (as /good and /bad do), and times: daemon start, the 16 turns, and the wait until
version v1 is live. Prints one JSON object.

    nice -n 10 .venv/bin/python bench/first_version.py [--turns 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=16)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="clawback-first-version-"))
    port = 30000 + os.getpid() % 20000
    env = {**os.environ, "CLAWBACK_TORCH_THREADS": "2"}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "clawback.cli", "serve", "--data-dir", str(data), "--port", str(port)],
                            stdout=(data / "daemon.log").open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    times: dict[str, float] = {}
    try:
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit((data / "daemon.log").read_text()[-3000:])
            time.sleep(0.5)
        times["daemon_start_s"] = round(time.time() - t0, 1)
        key = (data / "api_key").read_text().strip()
        c = httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=300)
        t1 = time.time()
        for i in range(args.turns):
            session = f"s{i}"
            r = c.post("/v1/chat/completions", json={
                "model": "clawback", "max_tokens": 32,
                "messages": [{"role": "user", "content": f"Give me one tip about topic number {i}."}]},
                headers={"x-session-id": session, "x-turn-type": "main", "x-turn-id": f"t{i}"})
            r.raise_for_status()
            ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "session_id": session,
                                                "kind": "thumbs_up" if i % 2 == 0 else "thumbs_down"}).json()
            assert ack["type"] == "ack", ack
        times["turns_and_feedback_s"] = round(time.time() - t1, 1)
        t2 = time.time()
        while c.get("/v1/adapters").json()["live"] is None:
            if time.time() - t2 > 1800:
                raise SystemExit("no version after 30 min:\n" + (data / "daemon.log").read_text()[-3000:])
            time.sleep(1)
        times["until_v1_live_s"] = round(time.time() - t2, 1)
        status = c.get("/v1/status").json()
        times["total_s"] = round(time.time() - t0, 1)
        print(json.dumps({"turns": args.turns, **times, "adapter": status["adapter_version"],
                          "last_step": status["training"]["last_step"]}, default=str))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
