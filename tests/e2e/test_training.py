"""Background training on the real daemon: feedback -> Ray trainer -> adapter versions that go
live under load with zero failed requests; a killed trainer loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
from websockets.sync.client import connect

from clawback.daemon.store import blob_ids, blob_logprobs
from tests.conftest import DaemonProcess, query, scaled, stream_clients, wait_for

# Every trained version goes live at once: these tests are about swapping (tests/e2e/test_gate.py
# covers the gate in front of it).
TRAIN_ENV = {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__METHOD": "binary", "CLAWBACK_TRAIN__BATCH_SIZE": "1",
             "CLAWBACK_GATE": '{"enabled": false, "guard_replies": 0}'}


def rate(c: httpx.Client, session: str, kind: str = "thumbs_up") -> None:
    c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 6,
                                         "messages": [{"role": "user", "content": f"tell me about {session}"}]},
           headers={"x-session-id": session, "x-turn-type": "main"}).raise_for_status()
    time.sleep(0.2)
    ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": kind, "session_id": session}).json()
    assert ack["type"] == "ack", ack


def cli(d: DaemonProcess, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "clawback.daemon.cli", "adapters", *args, "--data-dir", str(d.data_dir),
                          "--port", str(d.port), "--no-auth"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_hot_swap_under_load_three_swaps_and_a_rollback(tiny_model_dir: Path, tmp_path: Path):
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, "--no-auth", env=TRAIN_ENV).start()
    stop, results, errors = threading.Event(), [], []
    pushes: list[dict] = []

    def listen() -> None:
        with connect(d.url.replace("http", "ws") + "/v1/feedback/ws") as sock:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    pushes.append(json.loads(sock.recv(timeout=0.5)))

    listener = threading.Thread(target=listen)
    listener.start()
    clients = stream_clients(d.url, 8, stop, results, errors)
    try:
        _swap_under_load(d, clients, listener, stop, results, errors, pushes)
    finally:
        d.stop()
    _check_served_versions(d, tiny_model_dir, results)


def _swap_under_load(d, clients, listener, stop, results, errors, pushes) -> None:
    try:
        for t in clients:
            t.start()
        with httpx.Client(base_url=d.url, timeout=scaled(120)) as c:
            for k in range(1, 4):  # each rated reply is a batch of one: v1, v2, v3 go live in turn
                rate(c, f"train-{k}")
                wait_for(lambda: c.get("/v1/adapters").json()["live"] == k, timeout=120, what=f"v{k} live")
                served_on(f"v{k}", results, since=0)  # streams ran on this version (a loaded machine may be slow)
            assert "live: v3" in cli(d, "list")
            before = len(results)
            assert cli(d, "rollback", "1").startswith("v1 is live now (swapped in ")
            assert c.get("/v1/adapters").json()["live"] == 1
            served_on("v1", results, since=before)
    finally:
        stop.set()
        for t in clients:
            t.join(scaled(120))
        listener.join(10)

    assert errors == [], errors[:3]
    seen = {fp for _, fp in results}
    assert {"base", "v1", "v2", "v3"} <= seen, seen
    assert [p["version"] for p in pushes if p["type"] == "adapter_live"] == ["v1", "v2", "v3", "v1"]
    assert [p["version"] for p in pushes if p["type"] == "trained"] == ["v1", "v2", "v3"]
    status = httpx.get(f"{d.url}/v1/status").json()["training"]
    assert status["last_step"]["outcome"] == "committed" and status["samples_ready"] == 0
    assert "clawback_swap_seconds" in httpx.get(f"{d.url}/metrics").text
    assert cli(d, "pin", "2") == "v2 pinned: prune keeps it\n"
    pruned = json.loads(cli(d, "prune", "--json"))["pruned"]
    assert pruned == []  # 3 versions, keep 5
    assert cli(d, "prune") == "nothing to prune\n"


def served_on(version: str, results: list, since: int) -> None:
    wait_for(lambda: any(fp == version for _, fp in results[since:]), timeout=60, what=f"a stream served by {version}")


def _check_served_versions(d: DaemonProcess, tiny_model_dir: Path, results: list) -> None:
    # Every call says which version served it, and it really was that version: re-scoring its
    # sampled ids under that adapter reproduces the recorded behaviour logprobs.
    db = d.data_dir / "clawback.db"
    rows = {r["call_id"]: r for r in query(db, "SELECT * FROM calls WHERE turn_type = 'side'")}
    assert len(rows) == len(results)
    for call_id, fingerprint in results:
        assert (rows[call_id]["adapter_version"] or "base") == fingerprint
    from clawback.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(tiny_model_dir)

    async def rescore() -> float:
        worst = 0.0
        for v in (1, 2, 3):
            await engine.load_adapter(f"v{v}", str(d.data_dir / "adapters" / f"v{v}"))
        for version in ("base", "v1", "v2", "v3"):
            sample = [r for r in rows.values() if (r["adapter_version"] or "base") == version][:3]
            for r in sample:
                lp = await engine.score(blob_ids(r["prompt_ids"]), blob_ids(r["response_ids"]),
                                        None if version == "base" else version)
                worst = max([worst] + [abs(a - b) for a, b in zip(lp, blob_logprobs(r["behaviour_logprobs"]))])
        await engine.close()
        return worst

    assert asyncio.run(rescore()) < 1e-4


def test_killed_trainer_loses_nothing_and_training_resumes(embedded_model_dir: Path, tmp_path: Path):
    """Kill -9 the trainer actor while a step is under way: the actor holds its step at a pause
    point (its hold file) and names its pid, so the kill always lands inside a step."""
    hold = tmp_path / "hold-step"
    hold.touch()
    env = {**TRAIN_ENV, "CLAWBACK_TRAIN__BATCH_SIZE": "2", "CLAWBACK_TRAIN_HOLD_FILE": str(hold)}
    d = DaemonProcess(tmp_path / "data", embedded_model_dir, "--no-auth", env=env).start()
    db = d.data_dir / "clawback.db"
    try:
        with httpx.Client(base_url=d.url, timeout=scaled(120)) as c:
            rate(c, "crash-a")
            rate(c, "crash-b")
            held = Path(f"{hold}.held")
            wait_for(lambda: held.is_file() and held.read_text(), timeout=300, what="a training step held")
            os.kill(int(held.read_text()), signal.SIGKILL)
            failed = wait_for(lambda: query(db, "SELECT * FROM train_steps WHERE outcome = 'failed'"),
                              timeout=120, what="the failed step recorded")
            assert "Error" in failed[0]["error"]
            assert c.get("/v1/adapters").json()["live"] is None, "the serving version is unchanged"
            assert query(db, "SELECT count(*) FROM samples WHERE state = 'ready'")[0][0] == 2
            assert not list((d.data_dir / "adapters").glob("v*")), "no half-written version"
            hold.unlink()  # the next actor's step goes through
            # Serving never stopped, and training resumes by itself with a fresh actor.
            assert c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 3,
                                                        "messages": [{"role": "user", "content": "still there?"}]}).status_code == 200
            wait_for(lambda: c.get("/v1/adapters").json()["live"] == 1, timeout=300, what="v1 after the restart")
            assert query(db, "SELECT count(*) FROM samples WHERE state = 'consumed'")[0][0] == 2
    finally:
        d.stop()
