"""The gate in the real daemon: a trained version is reviewed as a candidate while 8 streams are
served (none fails), goes live, and is rolled back by the live guard after a burst of 👎; the
CLI shows why and `promote` overrides."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx

from tests.conftest import DaemonProcess, query, stream_clients, wait_for
from tests.e2e.test_training import cli

ENV = {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__METHOD": "binary", "CLAWBACK_TRAIN__BATCH_SIZE": "6"}
# All rated calls train here (the replay has its own tests); a short guard window; 8 short
# probes, as the review yields to 8 busy streams (tests/daemon/test_gate.py uses the real set).
# No greedy replies to the person's own requests: which calls are newest depends on the streams'
# timing, and the tiny random model loops on some of them (tests/daemon/test_gate.py covers the check).
TOML = "[gate]\nheld_out_share = 0\nguard_replies = 10\nprobes = 8\nprobe_max_tokens = 8\nreplay_generate = 0\n"


def main_call(c: httpx.Client, session: str) -> None:
    c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 6,
                                         "messages": [{"role": "user", "content": f"tell me about {session}"}]},
           headers={"x-session-id": session, "x-turn-type": "main"}).raise_for_status()


def feedback(c: httpx.Client, session: str, kind: str) -> None:
    ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": kind, "session_id": session}).json()
    assert ack["type"] == "ack" and ack["status"] == "applied", ack


def test_gate_under_load_then_a_thumbs_down_burst_rolls_back(tiny_model_dir: Path, tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "clawback.toml").write_text(TOML)
    d = DaemonProcess(data, tiny_model_dir, "--no-auth", env=ENV).start()
    stop, served, errors = threading.Event(), [], []
    clients = stream_clients(d.url, 8, stop, served, errors)
    try:
        with httpx.Client(base_url=d.url, timeout=120) as c:
            for k in range(12):  # the base model's record: 12 replies, none rated down
                main_call(c, f"base-{k}")
            for t in clients:
                t.start()
            for k in range(6):  # a batch of 6 liked replies: v1 is trained and reviewed under load
                main_call(c, f"liked-{k}")
                feedback(c, f"liked-{k}", "thumbs_up")
            # Polled once a second: the machine is busy enough serving 8 streams.
            # A refusal is final: fail at once with its reason instead of waiting out the deadline.
            gate = wait_for(lambda: (g := c.get("/v1/status").json()["gate"])["promoted"] + g["refused"] and g,
                            900, "v1 reviewed", interval=1)
            assert gate["promoted"] == 1, gate.get("newest")
            assert c.get("/v1/adapters").json()["live"] == 1 and len(served) > 8  # streams ran meanwhile
            row = c.get("/v1/adapters").json()["data"][0]
            assert row["state"] == "live" and row["gate"]["retention"]["probes"] == 8, row
            # v1's first replies draw 👎 (4 < batch size: nothing new is trained). Against 0 of the
            # base model's 18, 3 of 10 is not yet significant (p = 0.037 > 0.0167); 4 of 10 is (p = 0.010).
            for k in range(4):
                main_call(c, f"bad-{k}")
                feedback(c, f"bad-{k}", "thumbs_down")
                if k == 2:  # the guard has seen 3 of 10 and kept v1
                    last = wait_for(lambda: (c.get("/v1/status").json()["gate"]["guard"]["last"] or {}).get(
                        "new", {}).get("thumbs_down") == 3 and c.get("/v1/status").json()["gate"]["guard"]["last"],
                        120, "the guard saw 3 of 10", interval=1)
                    assert last["tests"]["thumbs_down"] == 0.03663 and c.get("/v1/adapters").json()["live"] == 1
            row = wait_for(lambda: next((a for a in c.get("/v1/adapters").json()["data"] if a["state"] == "refused"), None),
                           120, "v1 rolled back and refused", interval=1)
            assert c.get("/v1/adapters").json()["live"] is None
            status = c.get("/v1/status").json()["gate"]
            metrics = c.get("/metrics").text
    finally:
        stop.set()
        for t in clients:
            t.join(120)
    assert errors == [], errors[:3]
    assert row["state"] == "refused" and row["reason"].startswith("rolled back after going live: 👎 rate 4/10 vs 0/18"), row
    assert status["newest"] == {"version": 1, "state": "refused", "reason": row["reason"]}
    assert status["guard"]["rollbacks"] == 1
    assert 'clawback_gate_reviews_total{outcome="promoted"} 1.0' in metrics
    assert "clawback_guard_rollbacks_total 1.0" in metrics
    listing = cli(d, "list")
    assert "live: base model" in listing and "not promoted: rolled back after going live" in listing
    assert "promote 1" in subprocess.run(  # rollback does not bypass the gate ...
        [sys.executable, "-m", "clawback.daemon.cli", "adapters", "rollback", "1", "--data-dir", str(d.data_dir),
         "--port", str(d.port), "--no-auth"], capture_output=True, text=True).stderr
    out = cli(d, "promote", "1")  # ... promote does, and says what it overrides
    assert out.startswith("v1 is live; this overrides the gate: rolled back after going live: 👎 rate 4/10"), out
    assert httpx.get(f"{d.url}/v1/adapters").json()["live"] == 1
    d.stop()
    kinds = [r["kind"] for r in query(data / "clawback.db", "SELECT kind FROM events WHERE kind LIKE 'adapter.%' ORDER BY id")]
    assert kinds[:1] == ["adapter.candidate"] and "adapter.promoted" in kinds, kinds
    assert json.loads(query(data / "clawback.db", "SELECT gate FROM adapters WHERE version = 1")[0][0])["guard"]["new"]
