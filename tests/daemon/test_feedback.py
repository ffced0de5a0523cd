"""Feedback events against a real daemon (tiny model, judge off): acks after commit, exactly-once
application, orphans, session links and ends, malformed frames, WebSocket auth."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from clawback.daemon.samples import HINT_TEMPLATES
from tests.conftest import DaemonProcess, query, wait_for
from tests.daemon.test_protocol import check


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("fb-data"), tiny_model_dir, env={"CLAWBACK_JUDGE__BACKEND": "off"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess):
    with httpx.Client(base_url=daemon.url, headers={"authorization": f"Bearer {daemon.api_key}"}, timeout=60) as c:
        yield c


def converse(client: httpx.Client, session: str, turns: int) -> list[dict]:
    messages, bodies = [{"role": "user", "content": "hello"}], []
    for i in range(turns):
        body = client.post("/v1/chat/completions", json={"model": "clawback", "messages": messages, "max_tokens": 5},
                           headers={"x-session-id": session, "x-turn-type": "main", "x-turn-id": f"{session}-t{i}",
                                    "x-request-id": f"{session}-t{i}:model:1"}).json()
        bodies.append(body)
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"and then {i}?"}]
    return bodies


def event(kind: str, session: str, **kw) -> dict:
    return {"type": "feedback", "event_id": str(uuid.uuid4()), "kind": kind, "session_id": session,
            "source": "cli", "ts": time.time(), **kw}


def db_query(daemon: DaemonProcess, sql: str, *args) -> list[tuple]:
    return [tuple(r) for r in query(daemon.data_dir / "clawback.db", sql, *args)]


@contextlib.contextmanager
def ws(daemon: DaemonProcess, authed: bool = True):
    headers = {"Authorization": f"Bearer {daemon.api_key}"} if authed else None
    with connect(daemon.url.replace("http", "ws") + "/v1/feedback/ws", additional_headers=headers) as sock:
        if authed:
            assert json.loads(sock.recv(timeout=10))["type"] == "hello"
        yield sock


def recv_type(sock, wanted: str) -> dict:
    """The next frame of one type (status pushes such as sample_ready may come in between)."""
    while True:
        frame = json.loads(sock.recv(timeout=20))
        if frame["type"] == wanted:
            return frame


def test_thumbs_target_last_and_duplicates_apply_once(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "fb-1", 2)
    ev = event("thumbs_down", "fb-1", target="last")
    first = client.post("/v1/feedback", json=ev)
    again = client.post("/v1/feedback", json=ev)
    assert first.status_code == again.status_code == 200
    assert first.json() == {"type": "ack", "event_id": ev["event_id"], "status": "applied", "call_id": bodies[-1]["id"]}
    assert again.json()["status"] == "duplicate"
    assert db_query(daemon, "SELECT count(*) FROM feedback_events WHERE event_id = ?", ev["event_id"]) == [(1,)]
    assert db_query(daemon, "SELECT count(*) FROM events WHERE kind = 'feedback.applied' AND subject_id = ?",
                 ev["event_id"]) == [(1,)]
    sample = wait_for(lambda: db_query(daemon, "SELECT state, reward, reward_source FROM samples WHERE call_id = ? "
                                            "AND state != 'pending_judge'", bodies[-1]["id"]))
    assert sample == [("ready", -1.0, "explicit")]


def test_targets_by_turn_and_request_id(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "fb-2", 3)
    by_turn = client.post("/v1/feedback", json=event("thumbs_up", "fb-2", target="fb-2-t0")).json()
    by_request = client.post("/v1/feedback", json=event("thumbs_up", "fb-2", target="fb-2-t1:model:1")).json()
    assert by_turn["call_id"] == bodies[0]["id"] and by_request["call_id"] == bodies[1]["id"]


def test_correction_becomes_the_hint_and_teacher_logprobs_cover_the_response(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "fb-3", 1)
    ack = client.post("/v1/feedback", json=event("correction", "fb-3", text="Answer in one short sentence.")).json()
    assert ack["status"] == "applied"
    row = wait_for(lambda: db_query(daemon, "SELECT state, hint, hint_source, correction, length(teacher_logprobs), "
                                         "teacher_messages FROM samples WHERE call_id = ? AND state = 'ready'", bodies[0]["id"]))
    state, hint, source, correction, lp_bytes, teacher_messages = row[0]
    n_tokens = bodies[0]["usage"]["completion_tokens"]
    assert (hint, source, correction) == ("Answer in one short sentence.", "correction_raw", "Answer in one short sentence.")
    assert lp_bytes == 4 * n_tokens, "one float32 teacher logprob per stored response token"
    # The default: the OpenClaw-RL hint wording, appended to the person's message.
    assert json.loads(teacher_messages)[-1]["content"].endswith(
        "\n\n" + HINT_TEMPLATES["hint"].format(hint="Answer in one short sentence."))


def test_unknown_session_is_an_orphan_until_its_call_appears(client: httpx.Client, daemon: DaemonProcess):
    ev = event("thumbs_up", "fb-4", target="fb-4-t0")
    r = client.post("/v1/feedback", json=ev)
    assert r.status_code == 202
    assert r.json() | {"message": ""} == {"type": "error", "code": "orphan", "event_id": ev["event_id"],
                                          "reason": "unknown_session", "stored": True, "message": ""}
    assert client.post("/v1/feedback", json=ev).json()["status"] == "duplicate"
    bodies = converse(client, "fb-4", 1)  # the call it named arrives: the orphan is applied
    row = wait_for(lambda: db_query(daemon, "SELECT state, call_id FROM feedback_events WHERE event_id = ? "
                                         "AND state = 'applied'", ev["event_id"]))
    assert row == [("applied", bodies[0]["id"])]
    assert wait_for(lambda: db_query(daemon, "SELECT reward FROM samples WHERE call_id = ? AND state = 'ready'",
                                  bodies[0]["id"])) == [(1.0,)]
    unknown_turn = client.post("/v1/feedback", json=event("thumbs_up", "fb-4", target="no-such-turn"))
    assert unknown_turn.status_code == 202 and unknown_turn.json()["reason"] == "unknown_target"


def test_session_link_carries_pairing_and_session_end_closes(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "fb-5a", 1)
    link = client.post("/v1/feedback", json=event("session_link", "fb-5b", **{"from": "fb-5a", "to": "fb-5b"}))
    assert link.json()["status"] == "applied"
    # The conversation goes on under the new id: its next message pairs with the old session's reply.
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": bodies[0]["choices"][0]["message"]["content"]},
                {"role": "user", "content": "continued after compaction"}]
    second = client.post("/v1/chat/completions", json={"model": "clawback", "messages": messages, "max_tokens": 4},
                         headers={"x-session-id": "fb-5b", "x-turn-type": "main"}).json()
    paired = wait_for(lambda: db_query(daemon, "SELECT messages_json FROM next_states WHERE call_id = ?", bodies[0]["id"]))
    assert json.loads(paired[0][0]) == [{"role": "user", "content": "continued after compaction"}]
    # 'last' on the new id reaches the newest reply, and a session_end closes its waiting call.
    assert client.post("/v1/feedback", json=event("thumbs_up", "fb-5b")).json()["call_id"] == second["id"]
    assert client.post("/v1/feedback", json=event("session_end", "fb-5b")).json()["status"] == "applied"
    assert wait_for(lambda: db_query(daemon, "SELECT state FROM calls WHERE call_id = ? AND state != 'awaiting_next_state'",
                                  second["id"])) == [("closed_without_next_state",)]


@pytest.mark.parametrize("bad", [
    {"kind": "thumbs_up", "session_id": "s"},  # no event_id
    {"event_id": "not-a-uuid", "kind": "thumbs_up", "session_id": "s"},
    {"event_id": str(uuid.uuid4()), "kind": "love", "session_id": "s"},
    {"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "s"},  # no text
    {"event_id": str(uuid.uuid4()), "kind": "session_link", "from": "a"},
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_up"},  # no session
    {"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "s", "surprise": 1},
])
def test_malformed_http_events_are_400_and_store_nothing(client: httpx.Client, daemon: DaemonProcess, bad: dict):
    before = db_query(daemon, "SELECT count(*) FROM feedback_events")
    r = client.post("/v1/feedback", json=bad)
    assert r.status_code == 400 and r.json()["code"] == "malformed" and r.json()["message"]
    assert db_query(daemon, "SELECT count(*) FROM feedback_events") == before


def test_feedback_needs_the_key(daemon: DaemonProcess):
    r = httpx.post(f"{daemon.url}/v1/feedback", json=event("thumbs_up", "x"))
    assert r.status_code == 401


def test_websocket_acks_pushes_and_survives_malformed_frames(client: httpx.Client, daemon: DaemonProcess):
    converse(client, "fb-6", 1)
    with ws(daemon) as sock:
        sock.send("{not json")
        assert json.loads(sock.recv(timeout=10))["code"] == "malformed"
        sock.send(json.dumps({"type": "dance"}))
        assert json.loads(sock.recv(timeout=10))["code"] == "malformed"
        sock.send(json.dumps({"type": "ping"}))
        assert json.loads(sock.recv(timeout=10))["type"] == "pong"
        ev = event("thumbs_up", "fb-6")
        sock.send(json.dumps(ev))
        frames = [json.loads(sock.recv(timeout=20)) for _ in range(2)]  # the ack, then sample_ready
        kinds = {f["type"]: f for f in frames}
        assert kinds["ack"]["event_id"] == ev["event_id"] and kinds["ack"]["status"] == "applied"
        assert kinds["sample_ready"]["reward"] == 1.0 and kinds["sample_ready"]["session_id"] == "fb-6"


HOSTILE_FRAMES = [
    b'{"type": "ping"}',  # binary, even with valid JSON in it
    "[" * 30_000 + "]" * 30_000,
    '{"type": "feedback", "ts": ' + "9" * 5000 + "}",
    '{"type": "feedback", "ts": NaN}',
    '{"type": "feedback", "text": "\\ud800"}',
    "x" * (70 * 1024),
]


def test_websocket_answers_any_frame_with_malformed_and_stays_open(daemon: DaemonProcess):
    """Binary frames, deep JSON and huge integers closed the socket with 1006 and a traceback."""
    with ws(daemon) as sock:
        for frame in HOSTILE_FRAMES:
            sock.send(frame)
            reply = json.loads(sock.recv(timeout=10))
            assert reply["type"] == "error" and reply["code"] == "malformed", (frame[:40], reply)
        sock.send(json.dumps({"type": "ping"}))
        assert json.loads(sock.recv(timeout=10))["type"] == "pong"
    with ws(daemon, authed=False) as sock:  # before authenticating: refused, not a traceback
        sock.send(b"\x00\x01")
        assert json.loads(sock.recv(timeout=10))["code"] == "unauthorized"
    assert "Traceback" not in daemon.log.read_text()


@pytest.mark.parametrize("body", [b"[" * 30_000 + b"]" * 30_000, b'{"ts": ' + b"9" * 5000 + b"}",
                                  b'{"text": "\\udc00"}'], ids=["deep", "huge int", "surrogate"])
def test_hostile_http_events_are_400(client: httpx.Client, body: bytes):
    r = client.post("/v1/feedback", content=body)
    assert r.status_code == 400 and r.json()["code"] == "malformed", r.text


def test_websocket_auth_frame_and_refusal(daemon: DaemonProcess):
    with ws(daemon, authed=False) as sock:
        sock.send(json.dumps({"type": "auth", "api_key": daemon.api_key}))
        assert json.loads(sock.recv(timeout=10))["type"] == "auth_ok"
        assert json.loads(sock.recv(timeout=10))["type"] == "hello"
    with ws(daemon, authed=False) as sock:
        sock.send(json.dumps({"type": "auth", "api_key": "wrong"}))
        assert json.loads(sock.recv(timeout=10))["code"] == "unauthorized"
        with pytest.raises(ConnectionClosed):
            sock.recv(timeout=10)


def test_disconnect_before_ack_then_resend_applies_exactly_once(client: httpx.Client, daemon: DaemonProcess):
    converse(client, "fb-7", 1)
    ev = event("thumbs_down", "fb-7")
    with ws(daemon) as sock:
        sock.send(json.dumps(ev))  # and gone before reading any ack
    with ws(daemon) as sock:  # the client did not see an ack, so it sends the event again
        sock.send(json.dumps(ev))
        ack = recv_type(sock, "ack")
    assert ack["type"] == "ack" and ack["event_id"] == ev["event_id"] and ack["status"] in ("applied", "duplicate")
    assert db_query(daemon, "SELECT count(*) FROM feedback_events WHERE event_id = ?", ev["event_id"]) == [(1,)]
    assert db_query(daemon, "SELECT count(*) FROM events WHERE kind = 'feedback.applied' AND subject_id = ?",
                 ev["event_id"]) == [(1,)]


# ---------------------------------------------------------------- outcomes

PYTEST_FAILED = ((Path(__file__).parent / "tool_results" / "pytest_fail.txt").read_text()
                 + "\n\n(Command exited with code 1)")  # as OpenClaw's exec tool returns it


@contextlib.contextmanager
def dashboard(daemon: DaemonProcess):
    """A client logged in to the dashboard (its pages without a browser)."""
    with httpx.Client(base_url=daemon.url, timeout=60) as ui:
        assert ui.post("/ui/login", data={"key": daemon.api_key}).status_code == 303
        yield ui


def sample_of(daemon: DaemonProcess, call_id: str) -> tuple:
    return wait_for(lambda: db_query(
        daemon, "SELECT state, reward, reward_source, outcome, hint_source, hint, length(teacher_logprobs) > 0 "
                "FROM samples WHERE call_id = ? AND state != 'pending_judge'", call_id))[0]


def test_a_failing_tool_result_rewards_the_call_that_ran_it(client: httpx.Client, daemon: DaemonProcess):
    """The call that asked for the tool gets the outcome rule's reward, and the failing part of the
    output is its hint; no judge runs (it is off here)."""
    first, = converse(client, "oc-1", 1)
    reply = first["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": reply, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "exec", "arguments": '{"command": "pytest -q"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": PYTEST_FAILED}]
    r = client.post("/v1/chat/completions", json={"model": "clawback", "messages": messages, "max_tokens": 4},
                    headers={"x-session-id": "oc-1", "x-turn-type": "main"})
    assert r.status_code == 200, r.text
    state, reward, source, outcome, hint_source, hint, teacher = sample_of(daemon, first["id"])
    assert (state, reward, source, outcome, hint_source, teacher) == ("ready", -1.0, "outcome_rule", "test_summary",
                                                                      "outcome", 1)
    assert hint.endswith("FAILED test_calc.py::test_add - assert 0 == 4\n1 failed, 1 passed in 6.69s")
    with dashboard(daemon) as ui:
        assert "reward -1 from outcome rule test_summary" in ui.get("/ui/session/oc-1").text


def outcome(session: str, reward: float, **kw) -> dict:
    return event("outcome", session, reward=reward, **{"source": "ci", **kw})


def test_outcome_event_is_credited_once_and_reaches_the_samples(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "oc-2", 2)
    ev = outcome("oc-2", -1.0, credit="every", text="2 of 5 tests failed: test_parse, test_dump")
    first, again = client.post("/v1/feedback", json=ev), client.post("/v1/feedback", json=ev)
    assert first.status_code == again.status_code == 200
    assert first.json() == {"type": "ack", "event_id": ev["event_id"], "status": "applied", "call_id": bodies[-1]["id"]}
    assert again.json()["status"] == "duplicate"
    assert db_query(daemon, "SELECT count(*) FROM outcome_rewards WHERE event_id = ?", ev["event_id"]) == [(2,)]
    for body in bodies:
        assert sample_of(daemon, body["id"]) == ("ready", -1.0, "outcome_event", "ci", "outcome",
                                                 "2 of 5 tests failed: test_parse, test_dump", 1)
    # The dashboard's conversation and feedback views say where each reward came from.
    with dashboard(daemon) as ui:
        page = ui.get("/ui/session/oc-2").text
        assert page.count("reward -1 from outcome event from ci") == 2, page
        assert "reward -1 from outcome event from ci" in ui.get("/ui/part/feedback").text
    # A person's 👍 still decides the reward; the environment's words stay the hint.
    client.post("/v1/feedback", json=event("thumbs_up", "oc-2", target="oc-2-t1"))
    wait_for(lambda: db_query(daemon, "SELECT 1 FROM samples WHERE call_id = ? AND reward_source = 'explicit' "
                                      "AND state = 'ready'", bodies[-1]["id"]))
    assert sample_of(daemon, bodies[-1]["id"])[1:5] == (1.0, "explicit", None, "outcome")


def test_outcome_default_credit_is_the_last_call(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "oc-3", 2)
    ev = outcome("oc-3", 0.5)
    assert client.post("/v1/feedback", json=ev).json()["call_id"] == bodies[-1]["id"]
    assert db_query(daemon, "SELECT call_id, reward FROM outcome_rewards WHERE event_id = ?",
                    ev["event_id"]) == [(bodies[-1]["id"], 0.5)]
    assert json.loads(db_query(daemon, "SELECT payload FROM feedback_events WHERE event_id = ?",
                               ev["event_id"])[0][0])["credit"] == "last"


@pytest.mark.parametrize("bad", [
    {"reward": None},
    {"reward": 1.5},
    {"reward": "1"},
    {"reward": True},
    {"credit": "all"},
    {"turns": ["oc-4-t0"]},
    {"turns": ["oc-4-t0", "oc-4-t1"], "target": "oc-4-t1"},
    {"kind": "thumbs_up"},  # reward on another kind
    {"group": "", "credit": "step"},
], ids=["no reward", "over 1", "string", "bool", "unknown credit", "one turn", "turns and target",
        "reward on thumbs", "empty group"])
def test_bad_outcome_events_are_400_and_change_nothing(client: httpx.Client, daemon: DaemonProcess, bad: dict):
    converse(client, "oc-4", 2)
    ev = {k: v for k, v in {**outcome("oc-4", -1.0), **bad}.items() if v is not None}
    before = db_query(daemon, "SELECT (SELECT count(*) FROM feedback_events), (SELECT count(*) FROM outcome_rewards)")
    r = client.post("/v1/feedback", json=ev)
    assert r.status_code == 400 and r.json()["code"] == "malformed" and r.json()["message"], r.text
    assert db_query(daemon, "SELECT (SELECT count(*) FROM feedback_events), (SELECT count(*) FROM outcome_rewards)") \
        == before


def test_outcome_over_the_websocket(client: httpx.Client, daemon: DaemonProcess):
    bodies = converse(client, "oc-5", 1)
    ev = outcome("oc-5", 1.0, target="oc-5-t0", source="eval")
    with ws(daemon) as sock:
        sock.send(json.dumps(ev))
        ack = recv_type(sock, "ack")
        ready = recv_type(sock, "sample_ready")
    assert (ack["status"], ack["call_id"]) == ("applied", bodies[0]["id"])
    check(ev), check(ack), check(ready)  # the frames docs/protocol.md specifies
    assert (ready["call_id"], ready["reward"], ready["reward_source"], ready["outcome"]) == \
        (bodies[0]["id"], 1.0, "outcome_event", "eval")
