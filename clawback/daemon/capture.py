"""From a served call to a stored call, and from the next main call to a *next state*.

The contract (one state machine per call, each transition an event in the store):
    served (side calls stay here)
    main: awaiting_next_state -> paired | closed_without_next_state

When the next main call of a session arrives, every message it brings after the last assistant
message (the user's reply, or every tool result of a parallel tool call) is the next state of the
session's previous main call. A session ends on `session_done` or after an idle timeout; its
waiting call is then closed without a next state. In memory we keep a bounded LRU of sessions;
the store is the source of truth and is read back (off the event loop) on a cache miss.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from clawback.chat import ChatRequest, Message
from clawback.records import Call
from clawback.replies import parse_tool_calls

from .memory import strip
from .store import Store

log = logging.getLogger(__name__)

TRUTHY = {"1", "true", "yes", "on"}  # X-Session-Done (a header is text; the body field is a JSON boolean)
FALSY = {"0", "false", "no", "off"}
MAX_ID_CHARS = 256  # session, turn and request ids, from a header or the body
UNTAGGED_WARN_CALLS = 3  # untagged calls without a main call in between before warning
UNTAGGED_WARN_AFTER_S = 600.0  # ... when no main call came for this long (or ever); also the log interval


class MetaError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CallMeta:
    session_id: str
    turn_type: str  # main | side
    turn_id: str | None
    request_id: str
    session_done: bool
    tagged: bool  # the client said which turn type this is


def random_id() -> str:
    """128 random bits in hex, as unique as `uuid4().hex`. Without its getrandom syscall, which lets
    the engine and store threads take the GIL in the middle of serving a request."""
    return f"{random.getrandbits(128):032x}"


def parse_meta(headers: Mapping[str, str], req: ChatRequest) -> CallMeta:
    """Headers first (OpenClaw-RL names), then body fields, then defaults."""

    def pick(header: str, body_value: object) -> str | None:
        value = (headers.get(header) or "").strip() or None  # a blank header counts as not sent
        if value is None and body_value is not None:
            value = str(body_value).lower() if isinstance(body_value, bool) else str(body_value)
        value = value.strip() if value is not None else None
        return value or None

    turn_type = pick("x-turn-type", req.turn_type)
    if turn_type is not None:
        turn_type = turn_type.lower()
        if turn_type not in ("main", "side"):
            raise MetaError(f"turn type must be 'main' or 'side', got {turn_type[:32]!r}", "turn_type")
    done = pick("x-session-done", req.session_done)
    if done is not None and done.lower() not in TRUTHY | FALSY:
        raise MetaError(f"session done must be true or false, got {done[:32]!r}", "session_done")
    session_id = pick("x-session-id", req.session_id)
    affinity = None
    if session_id is None and turn_type is None:
        # No-plugin mode: OpenClaw's `compat.sendSessionAffinityHeaders` names the session on the
        # agent's own turns and on nothing else (compaction, titles), so a named call is main.
        affinity = pick("x-session-affinity", None) or pick("session_id", None)
    turn_id = pick("x-turn-id", req.turn_id)
    request_id = pick("x-request-id", req.request_id) or pick("x-client-request-id", None) or f"req-{random_id()}"
    if not request_id.isprintable() or not request_id.isascii():  # it goes back in the x-request-id header
        raise MetaError(f"request id must be printable ASCII, got {request_id[:64]!r}", "request_id")
    for param, value in (("request_id", request_id), ("session_id", session_id or affinity), ("turn_id", turn_id)):
        if value is not None and len(value) > MAX_ID_CHARS:  # headers as the body fields: bounded
            raise MetaError(f"{param} is over {MAX_ID_CHARS} characters", param)
    return CallMeta(
        session_id=session_id or affinity or f"anon-{random_id()}",
        turn_type=turn_type or ("main" if affinity else "side"),  # untagged calls are served and logged, never trained
        turn_id=turn_id,
        request_id=request_id,
        session_done=(done or "").lower() in TRUTHY,
        tagged=turn_type is not None,
    )


def messages_digest(messages: list[Message]) -> str:
    raw = json.dumps([m.model_dump(exclude_none=True) for m in messages], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


def next_state_messages(messages: list[Message]) -> list[Message]:
    """The messages after the last assistant message (system injections excluded)."""
    tail: list[Message] = []
    for m in reversed(messages):
        if m.role == "assistant":
            break
        if m.role not in ("system", "developer"):
            tail.append(m)
    return list(reversed(tail))


# Any: tool calls as the client sent them, as `ToolCall`s or read back from a stored call's JSON.
def _reply_signature(content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None) -> tuple[str, tuple[str, ...]]:
    names = tuple(c["function"]["name"] for c in tool_calls or [])
    return (content or "").strip(), names


def _served_signature(response_text: str | None, tool_calls: Sequence[Mapping[str, Any]] | None) -> tuple[str, tuple[str, ...]]:
    """Our reply as the client got it: the stored text is raw, and with tool calls the client's
    content is only what lies outside the <tool_call> blocks."""
    names = {c["function"]["name"] for c in tool_calls or []}
    content = parse_tool_calls(response_text or "", names)[0] if tool_calls else response_text
    return _reply_signature(content, tool_calls)


@dataclass
class _Session:
    session_id: str
    last_seen: float
    awaiting: str | None = None  # call id of the main call waiting for its next state
    awaiting_reply: tuple[str, tuple[str, ...]] | None = None
    awaiting_digest: str | None = None  # messages of that call's request, to spot retries
    latest_main: str | None = None  # the newest main call that started (running or done)
    closed: bool = False


class Capture:
    def __init__(self, store: Store, idle_timeout_s: float, cache_size: int, clock=time.time) -> None:
        self.store = store
        self.idle_timeout_s = idle_timeout_s
        self.cache_size = cache_size
        self.clock = clock
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self.counters: dict[str, int] = {}
        self.last_main_at: float | None = None
        self.last_tagged_main_at: float | None = None  # a main call tagged by the plugin (X-Turn-Type)
        self.side_untagged_since_main = 0  # untagged side calls served since the last main call
        self._warned_at: float | None = None
        self.last_untagged_at: float | None = None  # the dashboard warns when only these arrive

    def untrained_warning(self) -> str | None:
        """Untagged calls keep coming and no main call does: the most common reason nothing trains."""
        now = self.clock()
        quiet = self.last_main_at is None or now - self.last_main_at > UNTAGGED_WARN_AFTER_S
        if self.side_untagged_since_main < UNTAGGED_WARN_CALLS or not quiet:
            return None
        since = "since the daemon started" if self.last_main_at is None else \
            f"in the last {int(now - self.last_main_at) // 60} min"
        return (f"{self.side_untagged_since_main} untagged calls served and no main call {since}: nothing "
                "is being trained. Install the clawback OpenClaw plugin (`clawback openclaw install`) or set "
                "`compat.sendSessionAffinityHeaders: true` on the provider (no-plugin mode, see README).")

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    async def _session(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            s = await asyncio.to_thread(self._load, session_id)
            self._remember(s)
        self._sessions.move_to_end(session_id)
        return s

    def _remember(self, s: _Session) -> None:
        self._sessions[s.session_id] = s
        while len(self._sessions) > self.cache_size:
            self._sessions.popitem(last=False)  # the store still has it

    def _load(self, session_id: str) -> _Session:
        s = _Session(session_id, last_seen=self.clock())
        row = self.store.session_row(session_id)
        s.closed = row is not None and row["state"] == "closed"
        call = self.store.last_awaiting_call(session_id)
        if call is not None:
            s.awaiting = s.latest_main = call["call_id"]
            s.awaiting_reply = _served_signature(call["response_text"], json.loads(call["tool_calls_json"] or "null"))
            # Stored as served: without the injected notes it is what the client sent (and resends).
            request = json.loads(call["request_json"])
            sent = strip(request["messages"], request.get("memory_notes"))
            s.awaiting_digest = messages_digest([Message.model_validate(m) for m in sent])
        return s

    async def begin(self, meta: CallMeta, req: ChatRequest, call_id: str) -> None:
        """A main call arrived: its new trailing messages are the previous main call's next state."""
        now = self.clock()
        if not meta.tagged:
            self._count("untagged_calls")
            self.last_untagged_at = self.clock()
        if meta.turn_type != "main":
            if not meta.tagged:
                self.side_untagged_since_main += 1
                warning = self.untrained_warning()
                if warning and (self._warned_at is None or now - self._warned_at > UNTAGGED_WARN_AFTER_S):
                    self._warned_at = now
                    log.warning("%s", warning)
            return
        self.last_main_at, self.side_untagged_since_main = now, 0
        if meta.tagged:
            self.last_tagged_main_at = now
        s = await self._session(meta.session_id)
        s.last_seen = now
        if s.closed:
            s.closed = False
            self.store.reopen_session(meta.session_id, now)
        s.latest_main = call_id
        if s.awaiting is None:
            return
        previous, s.awaiting = s.awaiting, None
        digest = messages_digest(req.messages)
        if digest == s.awaiting_digest:
            # The same request again: the client retried or regenerated, so nobody answered ours.
            self.store.close_call(previous, "retried")
            self._count("calls_closed_retried")
            return
        tail = next_state_messages(req.messages)
        if not tail:
            self.store.close_call(previous, "no_new_messages")
            self._count("calls_closed_no_new_messages")
            return
        last_assistant = next((m for m in reversed(req.messages) if m.role == "assistant"), None)
        matched = last_assistant is not None and s.awaiting_reply == _reply_signature(
            last_assistant.text() or None,
            [{"function": {"name": c.function.name}} for c in last_assistant.tool_calls or []],
        )
        messages = [m.model_dump(exclude_none=True) for m in tail]
        self.store.add_next_state(previous, call_id, messages, matched, now)
        self._count("next_states")

    def finish(self, meta: CallMeta, record: Call, req: ChatRequest) -> None:
        """The call was served: store it and, for a main call, wait for its next state.

        Synchronous on purpose: it also runs in the cleanup of a stream whose client went away.
        """
        if meta.turn_type != "main":
            self.store.add_call(replace(record, state="served"))
            return
        self.store.add_call(replace(record, state="awaiting_next_state"))
        s = self._sessions.get(meta.session_id)
        if s is None:  # evicted while the call ran (cache full): its pairing state starts afresh,
            # with this call as the session's newest main call (not as superseded by nothing)
            s = _Session(meta.session_id, last_seen=self.clock(), latest_main=record.call_id)
            self._remember(s)
        s.last_seen = self.clock()
        if s.latest_main != record.call_id:
            # A newer main call of this session started while this one ran; it already took the
            # pairing slot, so this reply can never be followed by its own next state.
            self.store.close_call(record.call_id, "superseded")
            self._count("calls_closed_superseded")
        elif meta.session_done:
            self.store.close_session(meta.session_id, "session_done", s.last_seen)
            s.closed, s.awaiting = True, None
        else:
            s.awaiting = record.call_id
            s.awaiting_reply = _served_signature(record.response_text, record.tool_calls)
            s.awaiting_digest = messages_digest(req.messages)

    def end_session(self, session_id: str) -> None:
        """The client ended the session (feedback `session_end`); the store op closes its calls."""
        s = self._sessions.get(session_id)
        if s is not None:
            s.closed, s.awaiting = True, None

    def link(self, from_id: str, to_id: str) -> None:
        """The conversation continues under a new session id: carry the waiting call over."""
        old = self._sessions.pop(from_id, None)
        if old is None or old.awaiting is None:
            return
        new = self._sessions.get(to_id)
        if new is None:
            new = _Session(to_id, last_seen=self.clock())
            self._remember(new)
        if new.awaiting is None:
            new.awaiting, new.awaiting_reply, new.awaiting_digest = old.awaiting, old.awaiting_reply, old.awaiting_digest
            new.latest_main = new.latest_main or old.latest_main

    def forget(self, session_ids: list[str] | None) -> None:
        """Drop what is held in memory about these sessions (None = all), after the store forgot them."""
        if session_ids is None:
            self._sessions.clear()
        for sid in session_ids or ():
            self._sessions.pop(sid, None)

    def sweep(self) -> int:
        """Close sessions idle for longer than the timeout; returns how many were closed."""
        now = self.clock()
        cutoff = now - self.idle_timeout_s
        closed = 0
        for sid, s in list(self._sessions.items()):
            if s.last_seen < cutoff:
                if not s.closed:
                    self.store.close_session(sid, "idle_timeout", now)
                    closed += 1
                del self._sessions[sid]
        return closed

    async def sweep_store(self) -> int:
        """Close idle sessions that are not in memory (e.g. left open by a previous run)."""
        cutoff = self.clock() - self.idle_timeout_s
        stale = await asyncio.to_thread(self.store.stale_open_sessions, cutoff)
        stale = [sid for sid in stale if sid not in self._sessions]
        for sid in stale:
            self.store.close_session(sid, "idle_timeout", self.clock())
        return len(stale)

    def open_sessions(self) -> int:
        return sum(1 for s in self._sessions.values() if not s.closed)
