"""extension/schema/wire.schema.json is what scripts/wire_schema.py emits from the daemon's models now,
and the frames and replies the daemon really sends validate against it (the extension's wire.ts is
generated from that file, and extension/src/wire.test.ts checks it is up to date)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import pytest
from websockets.sync.client import connect

from clawback.daemon.capture import Capture
from clawback.daemon.feedback import _handle_frame, apply_event
from clawback.daemon.store import Store
from scripts.wire_schema import SCHEMA_PATH, render
from tests.conftest import DaemonProcess
from tests.daemon.test_protocol import SCHEMAS as DOC_SCHEMAS
from tests.daemon.test_store import record

SCHEMA = json.loads(SCHEMA_PATH.read_text())


def check(instance: Any, definition: str) -> Any:
    jsonschema.validate(instance, {**SCHEMA, "anyOf": [{"$ref": f"#/$defs/{definition}"}]})
    return instance


def test_the_committed_schema_is_what_the_models_emit():
    assert SCHEMA_PATH.read_text() == render(), "run: .venv/bin/python scripts/wire_schema.py && " \
                                                "(cd extension && npm run wire-types)"


# docs/protocol.md's schema of each frame -> the model's definition in the wire schema
DOC_NAMES = {"feedback": "FeedbackEvent", "auth": "Auth", "ping": "Ping", "ack": "Ack", "error": "ErrorFrame",
             "hello": "Hello", "auth_ok": "AuthOk", "pong": "Pong", "sample_ready": "SampleReady",
             "trained": "Trained", "adapter_live": "AdapterLive", "adapter_refused": "AdapterRefused",
             "adapter_rolled_back": "AdapterRolledBack"}


def test_every_frame_of_the_wire_is_on_the_protocol_page():
    frames = [ref["$ref"].split("/")[-1] for union in ("ClientFrame", "DaemonFrame")
              for ref in SCHEMA["$defs"][union].get("anyOf", SCHEMA["$defs"][union].get("oneOf"))]
    assert set(DOC_NAMES) == set(DOC_SCHEMAS) and sorted(DOC_NAMES.values()) == sorted(frames)


@pytest.mark.parametrize("doc_id", sorted(DOC_NAMES))
def test_the_protocol_page_and_the_models_name_the_same_fields(doc_id: str):
    doc, model = DOC_SCHEMAS[doc_id], SCHEMA["$defs"][DOC_NAMES[doc_id]]
    assert set(doc["properties"]) == set(model["properties"])
    assert set(doc["required"]) == set(model.get("required", []))


@pytest.fixture
def state(tmp_path: Path):
    """What apply_event reads of the daemon's state: a real store and capture, no model."""
    store = Store(tmp_path / "clawback.db")
    outcomes = SimpleNamespace(credit="last")
    yield SimpleNamespace(store=store, capture=Capture(store, 600, 100),
                          settings=SimpleNamespace(signals=SimpleNamespace(outcomes=outcomes)))
    store.close()


def test_feedback_replies_validate(state: SimpleNamespace):
    assert state.store.add_call(record("c1", "s1"))

    def reply(frame: dict[str, Any]) -> dict[str, Any]:
        return asyncio.run(_handle_frame(state, {"text": json.dumps(frame)}))

    event = check({"type": "feedback", "event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "s1",
                   "source": "telegram", "ts": time.time()}, "ClientFrame")
    orphan = {**event, "event_id": str(uuid.uuid4()), "session_id": "nobody"}
    replies = [reply(event), reply(event), reply(orphan), reply(check({"type": "ping"}, "ClientFrame")),
               reply(check({"type": "auth", "api_key": "k"}, "ClientFrame")), reply({"type": "nope"}),
               asyncio.run(_handle_frame(state, {"text": "{oops"})), asyncio.run(_handle_frame(state, {"bytes": b"x"}))]
    for frame in replies:
        check(frame, "DaemonFrame")
    assert [(f["type"], f.get("status") or f.get("code")) for f in replies] == [
        ("ack", "applied"), ("ack", "duplicate"), ("error", "orphan"), ("pong", None), ("auth_ok", None),
        ("error", "malformed"), ("error", "malformed"), ("error", "malformed")]
    assert replies[0]["call_id"] == "c1" and replies[2]["stored"] is True


def test_an_outcome_event_is_a_client_frame_and_gets_a_reply_that_validates(state: SimpleNamespace):
    event = check({"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": "s9", "reward": -1.0,
                   "turns": ["a", "b"], "credit": "step", "group": "g"}, "ClientFrame")
    check(asyncio.run(apply_event(state, event))[1], "DaemonFrame")


def test_a_renamed_field_fails_validation():
    with pytest.raises(jsonschema.ValidationError):
        check({"type": "ack", "eventId": "e", "status": "applied"}, "DaemonFrame")
    with pytest.raises(jsonschema.ValidationError):
        check({"type": "adapter_rolled_back", "version": "v3", "to_version": "v2", "reason": "worse"}, "DaemonFrame")


def test_status_and_socket_frames_of_a_real_daemon_validate(tiny_model_dir: Path, tmp_path: Path):
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, env={"CLAWBACK_JUDGE__BACKEND": "off"}).start()
    try:
        auth = {"authorization": f"Bearer {d.api_key}"}
        status = httpx.get(f"{d.url}/v1/status", headers=auth, timeout=30).json()
        check(status, "DaemonStatus")
        with connect(d.url.replace("http", "ws") + "/v1/feedback/ws", additional_headers=auth) as sock:
            hello = check(json.loads(sock.recv(timeout=10)), "DaemonFrame")
        assert hello["type"] == "hello"
    finally:
        d.stop()
