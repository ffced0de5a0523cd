"""Feedback events (👍/👎, corrections, comments, outcomes, session end and links) over WebSocket and HTTP.

An event is acknowledged only after it is committed to the store; its `event_id` makes resending
safe (applied once, acked every time). An event whose session or target call is not known is
stored as an orphan (error ack with `stored: true`, do not resend) and applied when its call
appears. The same socket carries status pushed by the daemon (`sample_ready`, `trained`,
`adapter_live`). The wire format is specified in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clawback import records

from .bodies import BodyError, parse_json, read_limited
from .store import StoreBusy

if TYPE_CHECKING:
    from .api.state import AppState

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MAX_TEXT = 16_000
AUTH_TIMEOUT_S = 10.0
MAX_EVENT_BYTES = 64 * 1024

Kind = Literal["thumbs_up", "thumbs_down", "correction", "comment", "session_end", "session_link", "outcome"]
Credit = Literal["last", "every", "step"]
OUTCOME_FIELDS = ("reward", "credit", "group", "turns")


class FeedbackEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)

    type: Literal["feedback"] = "feedback"
    event_id: str = Field(json_schema_extra={"format": "uuid"})
    kind: Kind
    session_id: str | None = Field(None, min_length=1, max_length=256)
    target: str | None = Field(None, min_length=1, max_length=256)  # turn id | request id | "last" (the default but for outcome)
    text: str | None = Field(None, max_length=MAX_TEXT)
    source: str = Field("unknown", min_length=1, max_length=64)  # channel: telegram, discord, webchat, cli...
    ts: float | None = None  # client time, unix seconds
    from_: str | None = Field(None, alias="from", min_length=1, max_length=256)
    to: str | None = Field(None, min_length=1, max_length=256)
    # outcome events: the reward, how it is credited across the calls it rates, the group of
    # trajectories normalised together (credit "step"), and a range of turns (first, last)
    reward: float | None = Field(None, ge=-1.0, le=1.0)
    credit: Credit | None = None
    group: str | None = Field(None, min_length=1, max_length=256)
    turns: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(None, min_length=2, max_length=2)

    @field_validator("event_id")
    @classmethod
    def _uuid(cls, v: str) -> str:
        try:
            return str(uuid.UUID(v))
        except ValueError:
            raise ValueError("event_id must be a UUID") from None

    @model_validator(mode="after")
    def _shape(self) -> FeedbackEvent:
        if self.kind == "session_link":
            if not (self.from_ and self.to):
                raise ValueError("session_link needs 'from' and 'to'")
            if self.from_ == self.to:
                raise ValueError("session_link 'from' and 'to' must differ")
            self.session_id = self.session_id or self.to
        elif not self.session_id:
            raise ValueError(f"{self.kind} needs session_id")
        if self.kind in ("correction", "comment") and not (self.text and self.text.strip()):
            raise ValueError(f"{self.kind} needs non-empty text")
        if self.kind == "outcome":
            if self.reward is None:
                raise ValueError("outcome needs reward, a number from -1 to 1")
            if self.target is not None and self.turns is not None:
                raise ValueError("outcome takes target or turns, not both")
        else:
            given = [f for f in OUTCOME_FIELDS if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only outcome events take {'it' if len(given) == 1 else 'them'}")
        return self

    def record(self) -> records.FeedbackRecord:
        return records.FeedbackRecord.of(self.model_dump(by_alias=True, exclude_none=True, exclude={"type"}))


class Hub:
    """Fan-out of status messages to every connected feedback socket."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue] = set()
        self.dropped = 0

    def add(self, q: asyncio.Queue) -> None:
        self._queues.add(q)

    def remove(self, q: asyncio.Queue) -> None:
        self._queues.discard(q)

    def broadcast(self, message: Mapping[str, object]) -> None:
        for q in list(self._queues):
            try:
                q.put_nowait(message)
            except asyncio.QueueFull:  # a stuck client loses status pushes, never feedback acks
                self.dropped += 1

    def connections(self) -> int:
        return len(self._queues)


def _error(message: str, code: str, event_id: object = None, **extra: object) -> dict[str, object]:
    frame = {"type": "error", "code": code, "message": message, **extra}
    if isinstance(event_id, str):
        frame["event_id"] = event_id
    return frame


async def apply_event(state: AppState, raw: object) -> tuple[int, dict[str, object]]:
    """Validate, commit and apply one event. Returns (HTTP status, reply frame)."""
    if not isinstance(raw, dict):
        return 400, _error("a feedback event must be a JSON object", "malformed")
    try:
        event = FeedbackEvent.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        msg = first["msg"].removeprefix("Value error, ")
        return 400, _error(f"{where}: {msg}" if where else msg, "malformed", raw.get("event_id"))
    # In-memory session state follows the event at once (idempotent, so a resend is harmless).
    if event.kind == "session_end" and event.session_id:  # the validator makes sure of these ids
        state.capture.end_session(event.session_id)
    elif event.kind == "session_link" and event.from_ and event.to:
        state.capture.link(event.from_, event.to)
    if event.kind == "outcome" and event.credit is None:  # stored as credited: a later config change leaves it be
        event = event.model_copy(update={"credit": state.settings.signals.outcomes.credit})
    try:
        result = await state.store.apply_feedback(event.record(), time.time())
    except StoreBusy as e:
        return 503, _error(str(e), "busy", event.event_id)
    except Exception as e:  # the write failed: not acked, so the client keeps it and resends
        log.error("feedback event %s could not be stored: %s", event.event_id, e)
        return 500, _error("the event could not be stored; send it again", "store_error", event.event_id)
    if result["status"] == "orphan":
        reason = result["reason"] or "unknown"  # an orphan always has its reason
        return 202, _error(f"stored, but {reason.replace('_', ' ')}: it is applied when its call appears",
                           "orphan", event.event_id, reason=reason, stored=True)
    ack: dict[str, object] = {"type": "ack", "event_id": event.event_id, "status": result["status"]}
    if result["call_id"]:
        ack["call_id"] = result["call_id"]
    return 200, ack


def add_feedback_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/feedback")
    async def post_feedback(request: Request) -> JSONResponse:
        try:
            body = await read_limited(request.stream(), MAX_EVENT_BYTES, request.headers.get("content-length"),
                                      state.settings.client_timeout_s)
            raw = parse_json(body)
        except BodyError as e:
            return JSONResponse(_error(e.message, "malformed"), status_code=e.status)
        status, frame = await apply_event(state, raw)
        return JSONResponse(frame, status_code=status)

    @app.websocket("/v1/feedback/ws")
    async def feedback_ws(ws: WebSocket) -> None:
        await ws.accept()
        expected = state.api_key
        if expected is not None and not _key_ok(ws.headers.get("authorization"), expected) \
                and not await _auth_frame(ws, expected):
            return
        out: asyncio.Queue = asyncio.Queue(maxsize=1000)
        sender = asyncio.create_task(_send_loop(ws, out))
        state.hub.add(out)
        await out.put({"type": "hello", "protocol": PROTOCOL_VERSION,
                       "adapter_version": state.engine.active_version()})
        try:
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await out.put(await _handle_frame(state, message))
        except WebSocketDisconnect:
            pass
        finally:
            state.hub.remove(out)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(out.join(), 2)  # let the last acks out if the peer still reads
            sender.cancel()


def _key_ok(header: str | None, expected: str) -> bool:
    return header is not None and hmac.compare_digest(header.encode(), f"Bearer {expected}".encode())


async def _auth_frame(ws: WebSocket, expected: str) -> bool:
    """Clients that cannot set headers authenticate with a first frame {type: auth, api_key}."""
    try:
        message = await asyncio.wait_for(ws.receive(), AUTH_TIMEOUT_S)
        frame = parse_json(message["text"]) if message.get("text") is not None else None
        key = frame.get("api_key") if isinstance(frame, dict) and frame.get("type") == "auth" else None
    except (TimeoutError, BodyError, WebSocketDisconnect):
        key = None
    if key is not None and hmac.compare_digest(str(key).encode(), expected.encode()):
        await ws.send_json({"type": "auth_ok"})
        return True
    with contextlib.suppress(Exception):
        await ws.send_json(_error("authenticate first: {type: auth, api_key} or an Authorization header",
                                  "unauthorized"))
        await ws.close(code=4401)
    return False


async def _handle_frame(state: AppState, message: Mapping[str, Any]) -> dict[str, Any]:  # Any: Starlette's ASGI message
    """The reply to one frame; a frame of any kind or content gets one and leaves the socket open."""
    text = message.get("text")
    if text is None:
        return _error("binary frames are not part of the protocol: send JSON text frames", "malformed")
    if len(text) > MAX_EVENT_BYTES:
        return _error("feedback event over 64 KB", "malformed")
    try:
        frame = parse_json(text)
    except BodyError as e:
        return _error(e.message, "malformed")
    kind = frame.get("type") if isinstance(frame, dict) else None
    if kind == "ping":
        return {"type": "pong", "ts": time.time()}
    if kind == "auth":
        return {"type": "auth_ok"}
    if kind == "feedback":
        return (await apply_event(state, frame))[1]
    return _error(f"unknown frame type {kind!r}; expected feedback, ping or auth", "malformed",
                  frame.get("event_id") if isinstance(frame, dict) else None)


async def _send_loop(ws: WebSocket, out: asyncio.Queue) -> None:
    while True:
        message = await out.get()
        try:
            await ws.send_json(message)
        except Exception:
            return  # the peer is gone; the receive loop notices too
        finally:
            out.task_done()
