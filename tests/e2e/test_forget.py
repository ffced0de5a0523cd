"""`clawback forget` against a real daemon and on its store when it is stopped, and `retain_days`:
nothing of a forgotten conversation remains in the database files."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from tests.conftest import DaemonProcess, query, wait_for


def raw_bytes(db: Path) -> bytes:
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


def talk(d: DaemonProcess, session: str, secret: str, note: str = "Please be brief.") -> None:
    """A main call carrying `secret`, then a correction whose request becomes a general note."""
    with httpx.Client(base_url=d.url, timeout=120) as c:
        c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 4, "messages": [
            {"role": "user", "content": f"remember {secret}"}]},
            headers={"x-session-id": session, "x-turn-type": "main"}).raise_for_status()
        ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": session,
                                           "text": f"You forgot {secret}. {note}"}).json()
        assert ack["type"] == "ack", ack


def forget_cli(d: DaemonProcess, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "clawback.cli", "forget", *args, "--data-dir", str(d.data_dir),
                          "--port", str(d.port), "--no-auth"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_forget_through_the_daemon_then_on_the_stopped_store(tiny_model_dir: Path, tmp_path: Path):
    """The note learnt from the forgotten session's correction was injected into the other
    session's call: the forget takes it out of that call too."""
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, "--no-auth", env={"CLAWBACK_TRAIN__ENABLED": "false"}).start()
    db = d.data_dir / "clawback.db"
    try:
        talk(d, "private", "PRIVATE-MARKER-1", "Please sign as PRIVATE-NOTE-MARKER.")
        talk(d, "other", "OTHER-MARKER-2")
        wait_for(lambda: len(query(db, "SELECT * FROM samples")) == 2, what="samples stored")
        (served,) = query(db, "SELECT request_json, prompt_text FROM calls WHERE session_id = 'other'")
        assert "PRIVATE-NOTE-MARKER" in served["request_json"] and "PRIVATE-NOTE-MARKER" in served["prompt_text"]
        report = json.loads(forget_cli(d, "--session", "private", "--json"))
        assert report["sessions"] == 1 and report["deleted"]["calls"] == 1 and report["affected_versions"] == []
        assert report["scrubbed"] == {"calls": 1, "samples_dropped": 1}
        (served,) = query(db, "SELECT request_json, prompt_text FROM calls WHERE session_id = 'other'")
        assert json.loads(served["request_json"])["messages"] == [{"role": "user", "content": "remember OTHER-MARKER-2"}]
        assert "remember OTHER-MARKER-2" in served["prompt_text"]
        raw = raw_bytes(db)
        assert b"PRIVATE-MARKER-1" not in raw and b"PRIVATE-NOTE-MARKER" not in raw and b"OTHER-MARKER-2" in raw
        talk(d, "private", "AFTER-MARKER-3")  # the daemon carries on with the session as a new one
    finally:
        d.stop()
    said = forget_cli(d, "--all")  # the daemon is down: on the store itself; in words
    assert said.startswith("forgot 2 sessions: ") and "2 calls" in said, said
    assert not any(m in raw_bytes(db) for m in (b"OTHER-MARKER-2", b"AFTER-MARKER-3"))
    assert [r[0] for r in query(db, "SELECT json_extract(payload, '$.scope') FROM events WHERE kind = 'forgotten' "
                                    "ORDER BY id")] == ["session", "all"]
    assert db.stat().st_mode & 0o077 == 0, "the database is private"


def test_retain_days_forgets_old_sessions_by_itself(tiny_model_dir: Path, tmp_path: Path):
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, "--no-auth", env={
        "CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_RETAIN_DAYS": str(2 / 86400), "CLAWBACK_SESSION_SWEEP_INTERVAL_S": "1"})
    d.start()
    try:
        talk(d, "brief", "BRIEF-MARKER-4")
        db = d.data_dir / "clawback.db"
        wait_for(lambda: query(db, "SELECT * FROM events WHERE kind = 'forgotten'"), timeout=60, what="retention ran")
        assert not query(db, "SELECT * FROM calls")
        # The files are rewritten after the tombstone commits (and wait for readers such as this
        # test's own polling to let go of the WAL), so the text disappears shortly after the event.
        wait_for(lambda: b"BRIEF-MARKER-4" not in raw_bytes(db), timeout=60, what="files scrubbed")
    finally:
        d.stop()
