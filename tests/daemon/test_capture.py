"""Capture: call metadata, and pairing each main call with its next state, checked in a real store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from starlette.datastructures import Headers

from clawback.chat import ChatRequest, Message
from clawback.daemon.capture import CallMeta, Capture, MetaError, next_state_messages, parse_meta
from clawback.daemon.memory import inject
from clawback.daemon.store import Store
from clawback.records import Call

TIMEOUT = 60.0


# ---------------------------------------------------------------- helpers


def chat(*messages: dict[str, Any], **fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "clawback", "messages": list(messages), **fields})


def system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str | None = None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        m["tool_calls"] = tool_calls
    return m


def tool(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def raw_tool_text(*calls: dict[str, Any]) -> str:
    """What the model generated for these calls: the record keeps the raw text, as the API does."""
    return "\n".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}\n</tool_call>'
        for c in calls
    )


class FakeClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def served(req: ChatRequest, notes: list[str] | None) -> dict[str, Any]:
    """The stored request: what the client sent, with `notes` injected as daemon/api/serving.py does."""
    body = req.openai_body()
    return {**body, "messages": inject(body["messages"], notes), "memory_notes": notes} if notes else body


class Harness:
    """A Capture over a real Store, driven the way the API drives it: begin, then finish."""

    def __init__(self, store: Store, clock: FakeClock, cache_size: int = 100) -> None:
        self.store, self.clock = store, clock
        self.calls: list[str] = []
        self.capture = Capture(store, idle_timeout_s=TIMEOUT, cache_size=cache_size, clock=clock)

    def new_capture(self, cache_size: int = 100) -> None:
        """A daemon restart: a fresh Capture on the same store."""
        self.store.flush()
        self.capture = Capture(self.store, idle_timeout_s=TIMEOUT, cache_size=cache_size, clock=self.clock)

    def begin(self, session: str | None, messages: list[dict[str, Any]], *, turn_type: str | None = "main",
              done: bool = False, headers: dict[str, str] | None = None) -> tuple[CallMeta, ChatRequest, str]:
        h = dict(headers or {})
        if session is not None:
            h["x-session-id"] = session
        if turn_type is not None:
            h["x-turn-type"] = turn_type
        if done:
            h["x-session-done"] = "1"
        req = chat(*messages)
        meta = parse_meta(h, req)
        call_id = f"call-{len(self.calls) + 1}"
        self.calls.append(call_id)
        asyncio.run(self.capture.begin(meta, req, call_id))
        return meta, req, call_id

    def finish(self, started: tuple[CallMeta, ChatRequest, str], reply: str | None = None,
               tool_calls: list[dict[str, Any]] | None = None, notes: list[str] | None = None) -> str:
        """`notes`: preference notes injected as the daemon does; the request is stored as served."""
        meta, req, call_id = started
        response_text = raw_tool_text(*tool_calls) if tool_calls else (reply or "")
        if tool_calls and reply:
            response_text = f"{reply}\n{response_text}"
        now = self.clock()
        rec = Call(
            call_id=call_id, session_id=meta.session_id, turn_id=meta.turn_id, request_id=meta.request_id,
            turn_type=meta.turn_type, state="served", created_at=now, finished_at=now, model="tiny",
            adapter_version=None, request=served(req, notes), prompt_text="<prompt>",
            prompt_ids=[1, 2, 3],
            response_ids=[4, 5], behaviour_logprobs=[-0.5, -0.25], response_text=response_text,
            tool_calls=tool_calls, finish_reason="tool_calls" if tool_calls else "stop",
        )
        self.capture.finish(meta, rec, req)
        return call_id

    def call(self, session: str | None, messages: list[dict[str, Any]], reply: str | None = None,
             tool_calls: list[dict[str, Any]] | None = None, **kw: Any) -> str:
        return self.finish(self.begin(session, messages, **kw), reply, tool_calls)

    # ---- reading the store back

    def q(self, sql: str, *args: Any) -> list[Any]:
        self.store.flush()
        return self.store.read(lambda c: [tuple(r) for r in c.execute(sql, args).fetchall()])

    def states(self) -> dict[str, str]:
        return dict(self.q("SELECT call_id, state FROM calls"))

    def next_states(self) -> dict[str, dict[str, Any]]:
        rows = self.q("SELECT call_id, next_call_id, messages_json, roles, reply_matched FROM next_states")
        return {r[0]: {"next": r[1], "messages": json.loads(r[2]), "roles": r[3], "matched": r[4]} for r in rows}

    def events(self, kind: str, subject: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT subject_id, payload FROM events WHERE kind = ?"
        rows = self.q(sql + " AND subject_id = ? ORDER BY id", kind, subject) if subject else self.q(sql + " ORDER BY id", kind)
        return [{"subject": s, **json.loads(p)} for s, p in rows]

    def close_reason(self, call_id: str) -> str | None:
        ev = self.events("call.closed_without_next_state", call_id)
        assert len(ev) <= 1
        return ev[0]["reason"] if ev else None

    def session(self, session_id: str) -> tuple[str, str | None]:
        return self.q("SELECT state, closed_reason FROM sessions WHERE session_id = ?", session_id)[0]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "clawback.db")
    yield s
    s.close()


@pytest.fixture
def h(store: Store, clock: FakeClock) -> Harness:
    harness = Harness(store, clock)
    yield harness
    assert store.dropped == {}, "no store write may be dropped or fail"


# ---------------------------------------------------------------- parse_meta


def test_meta_defaults_untagged_side_call() -> None:
    req = chat(user("hi"))
    a, b = parse_meta({}, req), parse_meta({}, req)
    assert a.turn_type == "side" and a.tagged is False and a.session_done is False and a.turn_id is None
    assert a.session_id.startswith("anon-") and a.request_id.startswith("req-")
    assert a.session_id != b.session_id and a.request_id != b.request_id  # never merged into one session


def test_meta_from_body_fields() -> None:
    req = chat(user("hi"), session_id="s-body", turn_type="main", turn_id="t7", request_id="r9", session_done=True)
    meta = parse_meta({}, req)
    assert meta == CallMeta(session_id="s-body", turn_type="main", turn_id="t7", request_id="r9",
                            session_done=True, tagged=True)


def test_meta_headers_win_over_body() -> None:
    req = chat(user("hi"), session_id="s-body", turn_type="side", turn_id="t-body", request_id="r-body",
               session_done=True)
    headers = {"x-session-id": "s-head", "x-turn-type": "main", "x-turn-id": "t-head", "x-request-id": "r-head",
               "x-session-done": "0"}
    meta = parse_meta(headers, req)
    assert meta == CallMeta(session_id="s-head", turn_type="main", turn_id="t-head", request_id="r-head",
                            session_done=False, tagged=True)


def test_meta_from_starlette_headers() -> None:
    headers = Headers({"X-Session-Id": "s1", "X-Turn-Type": "Main", "X-Session-Done": "TRUE"})
    meta = parse_meta(headers, chat(user("hi")))
    assert (meta.session_id, meta.turn_type, meta.session_done, meta.tagged) == ("s1", "main", True, True)


def test_meta_values_are_trimmed_and_case_folded() -> None:
    meta = parse_meta({"x-turn-type": "  SIDE ", "x-session-id": " s1 "}, chat(user("hi")))
    assert (meta.turn_type, meta.session_id, meta.tagged) == ("side", "s1", True)
    blank = parse_meta({"x-session-id": "   "}, chat(user("hi")))
    assert blank.session_id.startswith("anon-")


def test_meta_no_plugin_mode_session_affinity_headers() -> None:
    """OpenClaw's compat.sendSessionAffinityHeaders: a named call is main; our headers still win."""
    affinity = {"session_id": "oc-1", "x-session-affinity": "oc-1", "x-client-request-id": "oc-1"}
    meta = parse_meta(affinity, chat(user("hi")))
    assert (meta.session_id, meta.turn_type, meta.tagged) == ("oc-1", "main", False)
    assert parse_meta({"x-session-affinity": "oc-2"}, chat(user("hi"))).session_id == "oc-2"
    ours = parse_meta({**affinity, "x-session-id": "s1"}, chat(user("hi")))
    assert (ours.session_id, ours.turn_type) == ("s1", "side")  # our protocol: untagged = side
    side = parse_meta({**affinity, "x-turn-type": "side"}, chat(user("hi")))
    assert side.turn_type == "side" and side.session_id.startswith("anon-")


def test_meta_blank_header_falls_back_to_body() -> None:
    # A proxy that sends an empty header must not turn a tagged main call into an anonymous side call.
    req = chat(user("hi"), session_id="s-body", turn_type="main", session_done=True)
    meta = parse_meta({"x-session-id": "", "x-turn-type": "  ", "x-session-done": ""}, req)
    assert (meta.session_id, meta.turn_type, meta.tagged, meta.session_done) == ("s-body", "main", True, True)


@pytest.mark.parametrize("where", ["header", "body"])
@pytest.mark.parametrize("value", ["primary", "MAIN-TURN", "judge", "0"])
def test_meta_invalid_turn_type_raises(where: str, value: str) -> None:
    args = ({"x-turn-type": value}, chat(user("hi"))) if where == "header" else ({}, chat(user("hi"), turn_type=value))
    with pytest.raises(MetaError, match="turn type"):
        parse_meta(*args)
    assert issubclass(MetaError, ValueError)


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("True", True), ("yes", True), ("YES", True), ("on", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
])
def test_meta_session_done_header_values(value: str, expected: bool) -> None:
    assert parse_meta({"x-session-done": value}, chat(user("hi"))).session_done is expected


@pytest.mark.parametrize("value", ["2", "done", "maybe"])
def test_meta_session_done_header_that_is_neither_is_refused(value: str) -> None:
    with pytest.raises(MetaError) as e:
        parse_meta({"x-session-done": value}, chat(user("hi")))
    assert e.value.param == "session_done"


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (None, False)])
def test_meta_session_done_body_values(value: Any, expected: bool) -> None:
    assert parse_meta({}, chat(user("hi"), session_done=value)).session_done is expected


@pytest.mark.parametrize("value", ["yes", "off", 1, "true"])
def test_meta_session_done_body_is_a_json_boolean(value: Any) -> None:
    with pytest.raises(ValidationError):
        chat(user("hi"), session_done=value)


@pytest.mark.parametrize("header", ["x-request-id", "x-session-id", "x-turn-id"])
def test_meta_ids_from_headers_are_bounded_like_the_body_fields(header: str) -> None:
    assert parse_meta({header: "r" * 256}, chat(user("hi")))
    with pytest.raises(MetaError):
        parse_meta({header: "r" * 257}, chat(user("hi")))


def test_next_state_messages_is_the_tail_after_the_last_assistant_message() -> None:
    msgs = [Message.model_validate(m) for m in (
        system("sys"), user("u1"), assistant("a1"), tool("x", "r1"), system("injected"), user("u2"))]
    assert [m.role for m in next_state_messages(msgs)] == ["tool", "user"]
    assert next_state_messages(msgs[:3]) == []
    assert [m.text() for m in next_state_messages(msgs[:2])] == ["u1"]


# ---------------------------------------------------------------- pairing


def test_plain_three_turn_conversation(h: Harness) -> None:
    sys_ = system("be brief")
    c1 = h.call("s", [sys_, user("u1")], "r1")
    c2 = h.call("s", [sys_, user("u1"), assistant("r1"), user("u2")], "r2")
    c3 = h.call("s", [sys_, user("u1"), assistant("r1"), user("u2"), assistant("r2"), user("u3")], "r3")
    assert h.states() == {c1: "paired", c2: "paired", c3: "awaiting_next_state"}
    ns = h.next_states()
    assert ns[c1] == {"next": c2, "messages": [user("u2")], "roles": "user", "matched": 1}
    assert ns[c2] == {"next": c3, "messages": [user("u3")], "roles": "user", "matched": 1}
    assert [e["subject"] for e in h.events("call.paired")] == [c1, c2]
    assert h.events("call.paired", c1)[0]["next_call_id"] == c2
    assert h.session("s") == ("open", None)
    assert h.capture.counters == {"next_states": 2}
    assert h.capture.open_sessions() == 1


def test_edited_reply_is_paired_but_not_matched(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "the answer is 41")
    h.call("s", [user("u1"), assistant("the answer is 42"), user("u2")], "ok")
    assert h.next_states()[c1]["matched"] == 0
    assert h.states()[c1] == "paired"


def test_reply_match_ignores_surrounding_whitespace_and_content_parts(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "  r1\n")
    echoed = {"role": "assistant", "content": [{"type": "text", "text": "r1"}]}
    h.call("s", [user("u1"), echoed, user("u2")], "r2")
    assert h.next_states()[c1]["matched"] == 1


def test_tool_loop(h: Harness) -> None:
    weather = tool_call("call_a", "get_weather", {"city": "Paris"})
    c1 = h.call("s", [user("weather in Paris?")], tool_calls=[weather])
    history = [user("weather in Paris?"), assistant(None, [weather]), tool("call_a", "sunny, 21C")]
    c2 = h.call("s", history, "It is sunny.")
    c3 = h.call("s", history + [assistant("It is sunny."), user("thanks")], "welcome")
    ns = h.next_states()
    assert ns[c1] == {"next": c2, "messages": [tool("call_a", "sunny, 21C")], "roles": "tool", "matched": 1}
    assert ns[c2]["messages"] == [user("thanks")] and ns[c2]["matched"] == 1
    assert h.states() == {c1: "paired", c2: "paired", c3: "awaiting_next_state"}


def test_tool_call_with_text_before_it_is_matched(h: Harness) -> None:
    weather = tool_call("call_a", "get_weather", {"city": "Oslo"})
    c1 = h.call("s", [user("weather?")], "Let me check.", tool_calls=[weather])
    h.call("s", [user("weather?"), assistant("Let me check.", [weather]), tool("call_a", "rain")], "Rain.")
    assert h.next_states()[c1]["matched"] == 1


def test_tool_call_echoed_with_another_function_is_not_matched(h: Harness) -> None:
    c1 = h.call("s", [user("q")], tool_calls=[tool_call("call_a", "search", {"q": "x"})])
    other = tool_call("call_a", "browse", {"url": "x"})
    h.call("s", [user("q"), assistant(None, [other]), tool("call_a", "page")], "done")
    assert h.next_states()[c1]["matched"] == 0


def test_parallel_tool_results_are_one_next_state(h: Harness) -> None:
    calls = [tool_call("call_a", "get_weather", {"city": "Paris"}), tool_call("call_b", "get_time", {"tz": "CET"})]
    c1 = h.call("s", [user("weather and time?")], tool_calls=calls)
    results = [tool("call_a", "sunny"), tool("call_b", "14:00")]
    c2 = h.call("s", [user("weather and time?"), assistant(None, calls), *results], "Sunny, 14:00.")
    ns = h.next_states()
    assert ns[c1] == {"next": c2, "messages": results, "roles": "tool,tool", "matched": 1}
    assert h.events("call.paired", c1)[0]["roles"] == "tool,tool"


def test_system_messages_after_the_reply_are_not_part_of_the_next_state(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    h.call("s", [user("u1"), assistant("r1"), system("memory: likes tea"), user("u2")], "r2")
    assert h.next_states()[c1]["messages"] == [user("u2")]


def test_session_done_closes_last_call_and_session(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    c2 = h.call("s", [user("u1"), assistant("r1"), user("bye")], "bye!", done=True)
    assert h.states() == {c1: "paired", c2: "closed_without_next_state"}
    assert h.close_reason(c2) == "session_done"
    assert h.session("s") == ("closed", "session_done")
    assert len(h.events("session.closed")) == 1
    assert h.capture.open_sessions() == 0

    # The same session id used again: reopened, and nothing pairs with the closed call.
    c3 = h.call("s", [user("new topic")], "sure")
    assert h.session("s") == ("open", None)
    assert len(h.events("session.reopened")) == 1
    assert c2 not in h.next_states()
    assert h.states()[c3] == "awaiting_next_state"
    c4 = h.call("s", [user("new topic"), assistant("sure"), user("go on")], "ok")
    assert h.next_states()[c3]["next"] == c4


def test_session_done_in_body(h: Harness) -> None:
    req = chat(user("u1"), session_id="sb", turn_type="main", session_done=True)
    meta = parse_meta({}, req)
    asyncio.run(h.capture.begin(meta, req, "body-done"))
    h.finish((meta, req, "body-done"), "bye")
    assert h.states() == {"body-done": "closed_without_next_state"}
    assert h.close_reason("body-done") == "session_done"
    assert h.session("sb") == ("closed", "session_done")


def test_idle_timeout_sweep(h: Harness, clock: FakeClock) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    c_other = h.call("t", [user("v1")], "w1")
    clock.advance(TIMEOUT / 2)
    h.call("t", [user("v1"), assistant("w1"), user("v2")], "w2")  # keeps session t alive
    assert h.capture.sweep() == 0
    assert h.states()[c1] == "awaiting_next_state"

    clock.advance(TIMEOUT / 2 + 1)
    assert h.capture.sweep() == 1  # only s is idle past the timeout
    assert h.states()[c1] == "closed_without_next_state"
    assert h.close_reason(c1) == "idle_timeout"
    assert h.session("s") == ("closed", "idle_timeout")
    assert h.session("t") == ("open", None)
    assert h.states()[c_other] == "paired"
    assert h.capture.open_sessions() == 1
    assert h.capture.sweep() == 0

    # The user comes back much later: a fresh start, the timed-out call stays closed.
    clock.advance(10 * TIMEOUT)
    c3 = h.call("s", [user("u1"), assistant("r1"), user("u2")], "r2")
    assert c1 not in h.next_states()
    assert h.states()[c3] == "awaiting_next_state"
    assert h.session("s") == ("open", None)


def test_sweep_forgets_closed_sessions_without_closing_them_again(h: Harness, clock: FakeClock) -> None:
    h.call("s", [user("u1")], "r1", done=True)
    clock.advance(TIMEOUT + 1)
    assert h.capture.sweep() == 0
    assert len(h.events("session.closed")) == 1


def test_side_calls_between_main_calls(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    side_tagged = h.call("s", [system("summarize"), user("u1 r1")], "summary", turn_type="side")
    side_untagged = h.call("s", [user("title for: u1")], "Title", turn_type=None)  # no turn type given
    anonymous = h.call(None, [user("u1")], "r1", turn_type=None)  # no metadata at all
    c2 = h.call("s", [user("u1"), assistant("r1"), user("u2")], "r2")
    side_late = h.call("s", [user("classify u2")], "chitchat", turn_type="side")
    c3 = h.call("s", [user("u1"), assistant("r1"), user("u2"), assistant("r2"), user("u3")], "r3")

    states = h.states()
    assert states[side_tagged] == states[side_untagged] == states[side_late] == states[anonymous] == "served"
    assert states[c1] == states[c2] == "paired" and states[c3] == "awaiting_next_state"
    ns = h.next_states()
    assert set(ns) == {c1, c2}
    assert ns[c1]["next"] == c2 and ns[c2]["next"] == c3
    assert ns[c1]["matched"] == ns[c2]["matched"] == 1
    assert [e["subject"] for e in h.events("call.served")] == [side_tagged, side_untagged, anonymous, side_late]
    assert h.capture.counters["untagged_calls"] == 2
    sessions = dict(h.q("SELECT call_id, session_id FROM calls"))
    assert sessions[side_untagged] == "s"
    assert sessions[anonymous].startswith("anon-")  # a session of its own


def test_side_call_with_session_done_does_not_close_the_session(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    h.call("s", [user("side")], "x", turn_type="side", done=True)
    c2 = h.call("s", [user("u1"), assistant("r1"), user("u2")], "r2")
    assert h.next_states()[c1]["next"] == c2
    assert h.session("s") == ("open", None)


def test_retry_of_identical_request(h: Harness) -> None:
    first = [user("u1")]
    c1 = h.call("s", first, "r1")
    c2 = h.call("s", first, "r1 again")  # regenerate: nobody answered c1
    c3 = h.call("s", [user("u1"), assistant("r1 again"), user("u2")], "r3")
    assert h.states() == {c1: "closed_without_next_state", c2: "paired", c3: "awaiting_next_state"}
    assert h.close_reason(c1) == "retried"
    assert h.next_states()[c2] == {"next": c3, "messages": [user("u2")], "roles": "user", "matched": 1}
    assert h.capture.counters["calls_closed_retried"] == 1


def test_a_retry_after_a_restart_is_a_retry_when_the_call_was_served_with_notes(h: Harness) -> None:
    """The stored request holds the injected notes; the client resends what it sent."""
    first = [user("u1")]
    c1 = h.finish(h.begin("s", first), "r1", notes=["Be brief."])
    h.new_capture()
    c2 = h.call("s", first, "r1 again")
    assert h.close_reason(c1) == "retried" and h.states()[c2] == "awaiting_next_state"


def test_request_ending_with_an_assistant_message_closes_previous(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    c2 = h.call("s", [user("u1"), assistant("r1")], "continued")  # "continue" with no new message
    assert h.close_reason(c1) == "no_new_messages"
    assert h.states()[c2] == "awaiting_next_state"
    assert h.capture.counters["calls_closed_no_new_messages"] == 1


def test_call_superseded_by_a_newer_main_call(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1")
    run2 = h.begin("s", [user("u1"), assistant("r1"), user("u2")])
    # The user did not wait: a newer main call starts while the previous one still runs.
    run3 = h.begin("s", [user("u1"), assistant("r1"), user("u2 edited")])
    c2 = h.finish(run2, "r2")
    c3 = h.finish(run3, "r3")
    c4 = h.call("s", [user("u1"), assistant("r1"), user("u2 edited"), assistant("r3"), user("u4")], "r4")
    assert h.states() == {c1: "paired", c2: "closed_without_next_state", c3: "paired", c4: "awaiting_next_state"}
    ns = h.next_states()
    assert ns[c1]["next"] == c2
    assert h.close_reason(c2) == "superseded"
    assert ns[c3]["next"] == c4 and ns[c3]["matched"] == 1
    assert h.capture.counters["calls_closed_superseded"] == 1


def test_retry_started_before_the_original_finished(h: Harness) -> None:
    run1 = h.begin("s", [user("u1")])
    run2 = h.begin("s", [user("u1")])  # client timeout and retry
    c1 = h.finish(run1, "slow r1")
    c2 = h.finish(run2, "r1")
    c3 = h.call("s", [user("u1"), assistant("r1"), user("u2")], "r3")
    assert h.close_reason(c1) == "superseded"
    assert h.next_states()[c2]["next"] == c3
    assert h.states()[c3] == "awaiting_next_state"


def test_restart_continues_pairing_from_the_store(h: Harness) -> None:
    weather = tool_call("call_a", "get_weather", {"city": "Rome"})
    c1 = h.call("a", [user("u1")], "r1")
    c2 = h.call("a", [user("u1"), assistant("r1"), user("u2")], "r2")
    t1 = h.call("b", [user("weather?")], tool_calls=[weather])
    d1 = h.call("c", [user("hello")], "hi")
    h.new_capture()

    c3 = h.call("a", [user("u1"), assistant("r1"), user("u2"), assistant("r2"), user("u3")], "r3")
    t2 = h.call("b", [user("weather?"), assistant(None, [weather]), tool("call_a", "hot")], "Hot.")
    d2 = h.call("c", [user("hello")], "hi there")  # the same request again after the restart
    ns = h.next_states()
    assert ns[c1]["next"] == c2
    assert ns[c2] == {"next": c3, "messages": [user("u3")], "roles": "user", "matched": 1}
    assert ns[t1] == {"next": t2, "messages": [tool("call_a", "hot")], "roles": "tool", "matched": 1}
    assert h.close_reason(d1) == "retried"
    assert h.states()[d2] == "awaiting_next_state"


def test_restart_with_a_closed_session_reopens_it(h: Harness) -> None:
    c1 = h.call("s", [user("u1")], "r1", done=True)
    h.new_capture()
    c2 = h.call("s", [user("u1"), assistant("r1"), user("u2")], "r2")
    assert h.session("s") == ("open", None)
    assert len(h.events("session.reopened")) == 1
    assert h.states() == {c1: "closed_without_next_state", c2: "awaiting_next_state"}
    assert h.next_states() == {}


def test_sweep_store_closes_sessions_left_open_by_a_previous_run(h: Harness, clock: FakeClock) -> None:
    a1 = h.call("a", [user("u1")], "r1")
    b1 = h.call("b", [user("v1")], "w1")
    side = h.call("c", [user("side only")], "x", turn_type="side")
    clock.advance(TIMEOUT + 1)
    f1 = h.call("fresh", [user("f1")], "g1")  # active recently: must stay open
    h.new_capture()
    # In the new run, session b comes back before the sweep: it is in memory, not stale.
    b2 = h.call("b", [user("v1"), assistant("w1"), user("v2")], "w2")

    assert asyncio.run(h.capture.sweep_store()) == 2  # a and c
    states = h.states()
    assert states[a1] == "closed_without_next_state" and h.close_reason(a1) == "idle_timeout"
    assert states[side] == "served"
    assert h.session("a") == ("closed", "idle_timeout") and h.session("c") == ("closed", "idle_timeout")
    assert h.session("b") == ("open", None) and h.session("fresh") == ("open", None)
    assert h.next_states()[b1]["next"] == b2 and states[b2] == "awaiting_next_state"
    assert states[f1] == "awaiting_next_state"
    assert asyncio.run(h.capture.sweep_store()) == 0


def test_lru_evicts_but_pairing_reloads_from_the_store(store: Store, clock: FakeClock) -> None:
    h = Harness(store, clock, cache_size=2)
    history: dict[str, list[dict[str, Any]]] = {sid: [] for sid in "abc"}
    calls: dict[str, list[str]] = {sid: [] for sid in "abc"}
    for turn in range(3):
        for sid in "abc":
            store.flush()  # the evicted session's last call is in the store before it is read back
            history[sid].append(user(f"{sid}-u{turn}"))
            reply = f"{sid}-r{turn}"
            calls[sid].append(h.call(sid, list(history[sid]), reply))
            history[sid].append(assistant(reply))
            assert h.capture.open_sessions() <= 2
    ns = h.next_states()
    for sid in "abc":
        c = calls[sid]
        assert ns[c[0]] == {"next": c[1], "messages": [user(f"{sid}-u1")], "roles": "user", "matched": 1}
        assert ns[c[1]] == {"next": c[2], "messages": [user(f"{sid}-u2")], "roles": "user", "matched": 1}
    assert set(h.states().values()) == {"paired", "awaiting_next_state"}
    assert store.dropped == {}


def test_lru_eviction_while_calls_run(store: Store, clock: FakeClock) -> None:
    h = Harness(store, clock, cache_size=2)
    runs = {sid: h.begin(sid, [user(f"{sid}-u0")]) for sid in "abc"}  # a is evicted while it runs
    first = {sid: h.finish(run, f"{sid}-r0") for sid, run in runs.items()}
    assert h.capture.open_sessions() <= 2
    second = {}
    for sid in "abc":
        store.flush()
        second[sid] = h.call(sid, [user(f"{sid}-u0"), assistant(f"{sid}-r0"), user(f"{sid}-u1")], "r1")
    ns = h.next_states()
    for sid in "abc":
        assert ns[first[sid]]["next"] == second[sid], sid
        assert ns[first[sid]]["matched"] == 1
    assert store.dropped == {}


def test_call_ids_and_sessions_are_independent(h: Harness) -> None:
    a1 = h.call("a", [user("x")], "y")
    b1 = h.call("b", [user("x")], "y")  # the same messages in another session is not a retry
    a2 = h.call("a", [user("x"), assistant("y"), user("a2")], "z")
    b2 = h.call("b", [user("x"), assistant("y"), user("b2")], "z")
    ns = h.next_states()
    assert ns[a1]["next"] == a2 and ns[a1]["messages"] == [user("a2")]
    assert ns[b1]["next"] == b2 and ns[b1]["messages"] == [user("b2")]
