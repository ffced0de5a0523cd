"""Stop and start the real daemon on the same data dir: the store and session pairing continue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from clawback.daemon.store import migrations
from tests.conftest import DaemonProcess, query, scaled


def post(d: DaemonProcess, messages: list[dict], session: str, **headers: str) -> dict:
    r = httpx.post(f"{d.url}/v1/chat/completions", timeout=scaled(60),
                   json={"model": "clawback", "messages": messages, "max_tokens": 6, "temperature": 0},
                   headers={"authorization": f"Bearer {d.api_key}", "x-session-id": session, "x-turn-type": "main", **headers})
    assert r.status_code == 200, r.text
    return r.json()


def rows(db: Path, sql: str) -> list[tuple]:
    return [tuple(r) for r in query(db, sql)]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clawback.daemon.cli", *args], capture_output=True, text=True)


def test_restart_keeps_store_and_pairing(tiny_model_dir: Path, tmp_path: Path):
    data = tmp_path / "data"
    first = DaemonProcess(data, tiny_model_dir).start()
    key = first.api_key
    messages = [{"role": "user", "content": "Remember the number 7."}]
    reply = post(first, messages, "keep-1")
    status = json.loads(cli("status", "--data-dir", str(data), "--port", str(first.port)).stdout)
    assert status["daemon"] == "running" and status["store"]["schema_version"] == len(migrations())
    first.stop()  # SIGTERM: the writer drains before exit

    assert rows(data / "clawback.db", "SELECT state FROM calls") == [("awaiting_next_state",)]
    offline = cli("status", "--data-dir", str(data), "--port", str(first.port))
    assert offline.returncode == 0 and "not reachable" in json.loads(offline.stdout)["daemon"]

    second = DaemonProcess(data, tiny_model_dir).start()
    try:
        assert second.api_key == key, "the key survives a restart"
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Which number was it?"}]
        post(second, messages, "keep-1", **{"x-session-done": "1"})
    finally:
        second.stop()

    db = data / "clawback.db"
    assert rows(db, "SELECT state FROM calls ORDER BY created_at") == [("paired",), ("closed_without_next_state",)]
    (next_state,) = rows(db, "SELECT messages_json, reply_matched FROM next_states")
    assert json.loads(next_state[0]) == [{"role": "user", "content": "Which number was it?"}]
    assert next_state[1] == 1
    kinds = [k for (k,) in rows(db, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("schema.migrated") == len(migrations()), "migrations ran once, not again on restart"
    lifecycle = [k for k in kinds if k.startswith(("call.", "session."))]
    assert lifecycle == ["call.awaiting_next_state", "call.paired", "call.awaiting_next_state",
                         "call.closed_without_next_state", "session.closed"]
