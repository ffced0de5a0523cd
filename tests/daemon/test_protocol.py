"""docs/protocol.md is the contract the extension implements: every JSON Schema in it must accept
the frames a real daemon sends, and the feedback schema must agree with the daemon's validator."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import httpx
import jsonschema
import pytest
from websockets.sync.client import connect

from clawback.daemon.feedback import FeedbackEvent
from tests.conftest import DaemonProcess

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def schemas() -> dict[str, dict]:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.DOTALL)
    found = {}
    for block in blocks:
        obj = json.loads(block)
        if isinstance(obj, dict) and "$id" in obj:
            found[obj["$id"]] = obj
    return found


SCHEMAS = schemas()


def check(frame: dict) -> dict:
    jsonschema.validate(frame, SCHEMAS[frame["type"]])
    return frame


def test_every_message_type_has_a_schema():
    assert set(SCHEMAS) == {"feedback", "auth", "ping", "ack", "error", "hello", "auth_ok", "pong",
                            "sample_ready", "trained", "adapter_live", "adapter_refused", "adapter_rolled_back"}


GOOD = [
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "s"},
    {"type": "feedback", "event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "s", "target": "run-1",
     "text": "shorter", "source": "telegram", "ts": 1.5},
    {"event_id": str(uuid.uuid4()), "kind": "session_link", "from": "a", "to": "b"},
    {"event_id": str(uuid.uuid4()), "kind": "session_end", "session_id": "s"},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": -1, "source": "ci",
     "text": "2 failed"},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": 0.25, "credit": "step",
     "group": "task-3", "turns": ["run-1", "run-4"]},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": 1.0, "target": "run-2",
     "credit": "every"},
]
BAD = [
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_up"},
    {"event_id": str(uuid.uuid4()), "kind": "comment", "session_id": "s"},
    {"event_id": str(uuid.uuid4()), "kind": "comment", "session_id": "s", "text": ""},
    {"event_id": str(uuid.uuid4()), "kind": "session_link", "from": "a"},
    {"event_id": str(uuid.uuid4()), "kind": "meh", "session_id": "s"},
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "s", "extra": 1},
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "s", "source": "x" * 65},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s"},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": -1.01},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": "1"},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": 1, "credit": "first"},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": 1, "turns": ["a", "b", "c"]},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s", "reward": 1, "turns": ["a", "b"],
     "target": "a"},
    {"event_id": str(uuid.uuid4()), "kind": "outcome", "reward": 1},
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_down", "session_id": "s", "reward": -1},
    {"event_id": str(uuid.uuid4()), "kind": "comment", "session_id": "s", "text": "x", "group": "g"},
]


@pytest.mark.parametrize("ev", GOOD)
def test_schema_and_daemon_accept_the_same_events(ev):
    jsonschema.validate(ev, SCHEMAS["feedback"])
    FeedbackEvent.model_validate(ev)


@pytest.mark.parametrize("ev", BAD)
def test_schema_and_daemon_reject_the_same_events(ev):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ev, SCHEMAS["feedback"])
    with pytest.raises(ValueError):
        FeedbackEvent.model_validate(ev)


def test_real_daemon_frames_match_their_schemas(tiny_model_dir: Path, tmp_path: Path):
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, env={"CLAWBACK_JUDGE__BACKEND": "off"}).start()
    try:
        auth = {"authorization": f"Bearer {d.api_key}"}
        httpx.post(f"{d.url}/v1/chat/completions", timeout=60, headers={**auth, "x-session-id": "p", "x-turn-type": "main"},
                   json={"model": "clawback", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        time.sleep(0.3)
        with connect(d.url.replace("http", "ws") + "/v1/feedback/ws") as sock:
            sock.send(json.dumps(check({"type": "auth", "api_key": d.api_key})))
            seen = [check(json.loads(sock.recv(timeout=10))) for _ in range(2)]
            assert [f["type"] for f in seen] == ["auth_ok", "hello"]
            ev = check({"type": "feedback", "event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "p"})
            frames = []
            for payload in (ev, ev, {**ev, "event_id": str(uuid.uuid4()), "session_id": "nobody"}, "{oops",
                            check({"type": "ping"})):
                sock.send(payload if isinstance(payload, str) else json.dumps(payload))
            while len([f for f in frames if f["type"] != "sample_ready"]) < 5 or \
                    not any(f["type"] == "sample_ready" for f in frames):
                frames.append(check(json.loads(sock.recv(timeout=30))))
        kinds = [(f["type"], f.get("status") or f.get("code")) for f in frames if f["type"] != "sample_ready"]
        assert kinds == [("ack", "applied"), ("ack", "duplicate"), ("error", "orphan"), ("error", "malformed"),
                         ("pong", None)]
    finally:
        d.stop()
