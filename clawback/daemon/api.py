"""HTTP routes: OpenAI-compatible chat completions with real streaming, models, health, metrics.

The serving path renders the request once, streams tokens from the engine as they are sampled,
and hands the finished call to capture, which queues it for the store; nothing here waits on the
disk, the judge or the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from clawback.chat import ChatRenderer, ChatRequest, IncrementalDetokenizer, TextGate, parse_tool_calls
from clawback.engine import Engine, EngineError, Sampling, Token
from clawback.records import Call, Version

from .bodies import BodyError, parse_json, read_limited
from .capture import Capture, CallMeta, MetaError, parse_meta, random_id
from .config import Settings
from .dashboard import PREFIX as UI_PREFIX, add_dashboard_routes
from ..engines import grammar
from .feedback import FeedbackEvent, Hub, add_feedback_routes
from .forget import forget, parse_time
from .memory import inject
from .store import ForgetScope, Store, StoreBusy

if TYPE_CHECKING:
    from .adapters import AdapterManager
    from .gate import CandidateGate
    from .guard import LiveGuard
    from .samples import SamplePipeline
    from .training import TrainingLoop

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def resolve_api_key(settings: Settings) -> str | None:
    """The bearer key: from settings, else <data_dir>/api_key, created on first start."""
    if settings.no_auth:
        return None
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    path = settings.api_key_path
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process may have just created it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("cb-" + secrets.token_urlsafe(32) + "\n")
            log.warning("created an API key in %s (the key itself is never logged)", path)
    return path.read_text().strip()


# ---------------------------------------------------------------- metrics


class _LiveMetrics:
    """Values read from live state at scrape time (queue depth, drops, sessions, capture counters)."""

    def __init__(self, state: "AppState") -> None:
        self.state = state

    def collect(self):  # noqa: D401 - prometheus collector protocol
        s = self.state
        yield GaugeMetricFamily("clawback_store_queue_depth", "Writes waiting for the store writer", s.store.queue_depth())
        dropped = CounterMetricFamily("clawback_store_dropped", "Store writes dropped (queue full or write error)", labels=["op"])
        for op, n in s.store.dropped.items():
            dropped.add_metric([op], n)
        yield dropped
        yield CounterMetricFamily("clawback_store_written", "Store writes committed", s.store.written)
        yield GaugeMetricFamily("clawback_generations_running", "Generations in the engine", s.running)
        yield GaugeMetricFamily("clawback_sessions_open", "Open sessions held in memory", s.capture.open_sessions())
        capture = CounterMetricFamily("clawback_capture_events", "Capture outcomes", labels=["kind"])
        for kind, n in s.capture.counters.items():
            capture.add_metric([kind], n)
        yield capture
        yield CounterMetricFamily("clawback_status_pushes_dropped", "Status pushes not sent to a stuck feedback client",
                                  s.hub.dropped)
        yield GaugeMetricFamily("clawback_feedback_connections", "Open feedback WebSockets", s.hub.connections())
        yield GaugeMetricFamily("clawback_adapter_version", "Live adapter version (0 = base model)",
                                s.adapters.live() or 0)
        if s.adapters.last_swap_s is not None:
            yield GaugeMetricFamily("clawback_swap_seconds", "Duration of the last hot-swap", s.adapters.last_swap_s)
        if s.trainer is not None:
            yield CounterMetricFamily("clawback_train_steps", "Committed training steps", s.trainer.steps)
            yield CounterMetricFamily("clawback_train_failures", "Failed training steps", s.trainer.failures)
            train = GaugeMetricFamily("clawback_train", "Metrics of the last training step", labels=["metric"])
            for name, value in (s.trainer.last_metrics or {}).items():
                if isinstance(value, (int, float)):
                    train.add_metric([name], float(value))
            yield train
        if s.gate is not None:
            reviews = CounterMetricFamily("clawback_gate_reviews", "Candidate versions the gate decided on", labels=["outcome"])
            reviews.add_metric(["promoted"], s.gate.promoted)
            reviews.add_metric(["refused"], s.gate.refused)
            yield reviews
            yield GaugeMetricFamily("clawback_gate_reviewing", "Candidate version under review (0 = none)", s.gate.reviewing or 0)
            if s.gate.last_review_s is not None:
                yield GaugeMetricFamily("clawback_gate_seconds", "Duration of the last gate review", s.gate.last_review_s)
        if s.guard is not None:
            yield CounterMetricFamily("clawback_guard_rollbacks", "Versions rolled back by the live guard", s.guard.rollbacks)


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    renderer: ChatRenderer
    store: Store
    capture: Capture
    api_key: str | None
    hub: Hub
    pipeline: SamplePipeline  # started by the lifespan
    adapters: AdapterManager
    trainer: TrainingLoop | None  # started by the lifespan when training is on
    judge_name: str
    gate: CandidateGate | None = None  # candidates are checked before they go live
    guard: LiveGuard | None = None  # rolls back a version that made things worse
    started_at: float = field(default_factory=time.time)
    running: int = 0  # chat requests in flight
    serving_gauge: Any = None  # clawback.trainer.priority.ServingGauge: `running`, for the trainer to yield to
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.opd_top_k = self.settings.train_config().opd_top_k  # main calls keep this many top logprobs
        r = self.registry
        self.requests = Counter("clawback_requests", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("clawback_request_seconds", "Chat completion latency", ["stream"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = Histogram("clawback_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.tokens = Counter("clawback_tokens", "Tokens processed", ["kind"], registry=r)
        self.calls = Counter("clawback_calls", "Served chat calls", ["turn_type"], registry=r)
        r.register(_LiveMetrics(self))

    def count_running(self, delta: int) -> None:
        self.running += delta
        if self.serving_gauge is not None:
            self.serving_gauge.set(self.running)


# ---------------------------------------------------------------- ASGI middleware: auth, body limit, counting


ROUTES = ("/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/v1/status", "/v1/feedback",
          "/v1/adapters", "/v1/forget", "/v1/dashboard/link")


CHAT_PATH = "/v1/chat/completions"


class Gate:
    """Bearer auth (all but /healthz and the dashboard, which has its own login), request counting.
    Pure ASGI so streaming stays untouched.

    Chat completions, the route every served call takes, go from here straight to their handler:
    FastAPI's middleware, routing and endpoint machinery cost more than the rest of the handler's
    own work on a small request. Its FastAPI route stays for the OpenAPI description (and answers
    405 to other methods)."""

    def __init__(self, app: Any, state: AppState) -> None:
        self.app, self.state = app, state
        key = state.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def chat(self, scope: Scope, receive: Receive, send: Send, status_box: list[int]) -> None:
        """POST /v1/chat/completions, with the errors FastAPI's handlers would give. Its status is
        counted from the response, so that streamed chunks go to `send` without a wrapper."""
        scope["app"] = self.app  # what Request.app reads
        try:
            response = await _chat(self.state, Request(scope, receive))
        except ApiError as e:
            response = e.response()
        except Exception:
            log.exception("internal error")
            response = ApiError(500, "internal error", "server_error").response()
        status_box[0] = response.status_code
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status_box = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            dashboard = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
            if self.expected is not None and path != "/healthz" and not dashboard:
                given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if not hmac.compare_digest(given, self.expected):
                    msg = "missing bearer token" if not given else "invalid API key"
                    err = ApiError(401, msg, "authentication_error", code="invalid_api_key")
                    return await err.response()(scope, receive, counting_send)
            if path == CHAT_PATH and scope["method"] == "POST":
                await self.chat(scope, receive, send, status_box)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            route = path if path in ROUTES else "other"
            self.state.requests.labels(route, str(status_box[0])).inc()


# ---------------------------------------------------------------- app


def create_app(state: AppState, lifespan: Any = None) -> Any:
    app = FastAPI(title="clawback", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.clawback = state

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        return ApiError(400, f"{param}: {first['msg']}", param=param, code="invalid_value").response()

    @app.exception_handler(404)
    async def _not_found(request: Request, _: Exception) -> JSONResponse:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    @app.exception_handler(405)
    async def _bad_method(request: Request, _: Exception) -> JSONResponse:
        return ApiError(405, f"method {request.method} not allowed on {request.url.path}").response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        log.exception("internal error")
        return ApiError(500, "internal error", "server_error").response()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict:
        info = state.engine.info
        return {
            "object": "list",
            "data": [{
                "id": state.settings.served_model_name,
                "object": "model",
                "created": int(state.started_at),
                "owned_by": "clawback",
                "root": info.name,
                "context_length": info.context_length,
                "max_model_len": info.context_length,
                "adapter_version": state.engine.active_version(),
            }],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status() -> dict:
        counts = await asyncio.to_thread(state.store.counts)
        last_step = await asyncio.to_thread(state.store.last_train_step)
        notes = await asyncio.to_thread(state.store.memory_notes, state.adapters.live())
        return {
            "version": _version(),
            "model": state.engine.info.name,
            "served_model_name": state.settings.served_model_name,
            "context_length": state.engine.info.context_length,
            "adapter_version": state.engine.active_version(),
            "uptime_s": round(time.time() - state.started_at, 1),
            "generations_running": state.running,
            "sessions_open": state.capture.open_sessions(),
            "capture": dict(state.capture.counters),
            "warnings": [w for w in (state.capture.untrained_warning(),) if w],
            "main_calls": {"last_at": state.capture.last_main_at, "last_tagged_at": state.capture.last_tagged_main_at},
            "signals": {"method": state.pipeline.cfg.method, "teacher": state.pipeline.cfg.teacher,
                        "judge": state.judge_name, "feedback_connections": state.hub.connections()},
            "training": {
                "enabled": state.trainer is not None,
                "batch_size": state.settings.train_config().batch_size,
                "samples_ready": counts["samples"].get("ready", 0),
                # Samples with a teacher: top-K OPD, or token-level and why (store.opd_counts).
                "opd": counts["opd"],
                "training_now": bool(state.trainer and state.trainer.busy),
                "trainer_node": state.trainer and state.trainer.trainer_node,  # Ray node id of the last step
                "last_step": last_step,
            },
            # The preference notes main calls get in their system prompt (the extension's /clawback).
            "memory": {"enabled": state.settings.memory, "notes": [
                {k: n[k] for k in ("note_id", "text", "active", "retired_by")} for n in notes]},
            "gate": await _gate_status(state),
            "store": {
                "path": str(state.store.db_path),
                "schema_version": state.store.schema_version,
                "queue_depth": state.store.queue_depth(),
                "written": state.store.written,
                "dropped": dict(state.store.dropped),
                **counts,
            },
        }

    @app.post(CHAT_PATH)  # served by Gate.chat; here for the OpenAPI description
    async def chat_completions(request: Request) -> Response:
        return await _chat(state, request)

    add_feedback_routes(app, state)
    _add_adapter_routes(app, state)
    _add_memory_routes(app, state)
    _add_forget_route(app, state)
    add_dashboard_routes(app, state)
    _describe_bodies(app, {("/v1/chat/completions", "post"): ChatRequest, ("/v1/feedback", "post"): FeedbackEvent,
                           ("/v1/adapters/rollback", "post"): RollbackBody, ("/v1/adapters/pin", "post"): VersionBody,
                           ("/v1/forget", "post"): ForgetBody, ("/v1/adapters/promote", "post"): VersionBody,
                           ("/v1/memory/{note_id}", "put"): NoteText, ("/v1/memory/{note_id}", "patch"): NoteScope})

    return Gate(app, state)


NoteId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # SQLite's integer range: a larger id is a 400, not an overflow


def _add_memory_routes(app: FastAPI, state: AppState) -> None:
    """The person's preference notes (daemon/memory.py): list, edit one, change its scope, forget
    one or all."""

    async def notes() -> dict:
        """Every note; `scope`: "general" (every main call gets it) or "session" (only the calls of
        `session_id`'s conversation); `active`: injected while the live version serves (when memory
        is on), false for one that version retired (`retired_by`, daemon/retirement.py)."""
        live = state.adapters.live()
        return {"enabled": state.settings.memory, "max_notes": state.settings.memory_max_notes,
                "live": Version.name_of(live),
                "data": [{k: v for k, v in n.items() if k != "topic"}
                         for n in await asyncio.to_thread(state.store.memory_notes, live)]}

    @app.get("/v1/memory")
    async def list_notes() -> dict:
        return await notes()

    @app.put("/v1/memory/{note_id}")
    async def edit_note(request: Request, note_id: NoteId) -> dict:
        raw = await _read_json(request, 64 * 1024)
        text = raw.get("text") if isinstance(raw, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, 'body must be {"text": "<the note>"} with a non-empty text', param="text")
        if not await state.store.edit_note(note_id, text):
            raise ApiError(404, f"no memory note {note_id}", param="note_id", code="not_found")
        return await notes()

    @app.patch("/v1/memory/{note_id}")
    async def scope_note(request: Request, note_id: NoteId) -> dict:
        try:
            body = NoteScope.model_validate(await _read_json(request, 4096))
        except ValidationError as e:
            raise _validation_error(e) from None
        error = await state.store.scope_note(note_id, body.scope, body.session_id)
        if error is not None and error.startswith("no memory note"):
            raise ApiError(404, error, param="note_id", code="not_found")
        if error is not None:
            raise ApiError(400, error, param="session_id", code="invalid_value")
        return await notes()

    @app.delete("/v1/memory/{note_id}")
    async def forget_note(note_id: NoteId) -> dict:
        if not await state.store.forget_notes(note_id):
            raise ApiError(404, f"no memory note {note_id}", param="note_id", code="not_found")
        return await notes()

    @app.delete("/v1/memory")
    async def forget_all() -> dict:
        await state.store.forget_notes()
        return await notes()


class NoteText(BaseModel):
    text: str = Field(min_length=1, max_length=64 * 1024)  # the note's new wording


class NoteScope(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    scope: Literal["general", "session"]
    # the conversation a session note belongs to; by default the session the note was learnt from
    session_id: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _session_only_for_session(self) -> "NoteScope":
        if self.scope == "general" and self.session_id is not None:
            raise ValueError("a general note has no session_id")
        return self


class VersionBody(BaseModel):
    version: int | str  # N, "vN", or "base" (rollback)


class RollbackBody(VersionBody):
    force: bool = False  # also a refused, candidate or rolled-back-from (`retired`) version


def _describe_bodies(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]]) -> None:
    """/openapi.json with each route's JSON body: the routes read raw bodies (size limits, strict
    JSON), so FastAPI cannot see them; the request models are the contract."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = doc.setdefault("components", {}).setdefault("schemas", {})
            for (path, method), model in bodies.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                doc["paths"][path][method]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": schema}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


class ForgetBody(BaseModel):
    """Exactly one of: a session (with the sessions linked to it), every session last seen before
    a time (unix seconds or ISO 8601), or everything."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)  # "all": true, not "yes" or 1
    session_id: str | None = Field(None, min_length=1, max_length=256)
    before: float | str | None = None
    everything: bool = Field(False, alias="all")

    def scope(self) -> ForgetScope:
        before = None if self.before is None else parse_time(self.before)
        return ForgetScope(session_id=self.session_id, before=before, everything=self.everything)


def _add_forget_route(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/forget")
    async def forget_route(request: Request) -> dict:
        try:
            scope = ForgetBody.model_validate(await _read_json(request, 4096)).scope()
        except ValidationError as e:
            raise _validation_error(e) from None
        except ValueError as e:  # no scope or two, or a time that does not parse
            raise ApiError(400, str(e), code="invalid_value") from None
        return await forget(state.store, scope, state.capture)


def _add_adapter_routes(app: FastAPI, state: AppState) -> None:
    from .adapters import AdapterError

    async def body_version(request: Request) -> tuple[int | None, dict[str, Any]]:
        raw = await _read_json(request, 4096, empty={})
        try:
            v = raw.get("version")
            if isinstance(v, bool):
                raise ValueError(v)
            return Version.of(v), raw
        except (ValueError, AttributeError):
            raise ApiError(400, "body must be {\"version\": N} (or \"base\")", param="version") from None

    async def guarded(coro: Any) -> Any:
        try:
            return await coro
        except AdapterError as e:
            raise ApiError(400, str(e), param="version", code="invalid_version") from None

    @app.get("/v1/adapters")
    async def list_adapters() -> dict:
        rows = await asyncio.to_thread(state.store.adapters)
        return {"live": state.adapters.live(), "reviewing": state.gate and state.gate.reviewing, "data": rows}

    @app.post("/v1/adapters/rollback")
    async def rollback(request: Request) -> dict:
        version, raw = await body_version(request)
        force = raw.get("force", False)
        if not isinstance(force, bool):
            raise ApiError(400, "force must be true or false", param="force", code="invalid_value")
        swap_s = await guarded(state.adapters.rollback(version, force))
        return {"live": state.adapters.live(), "swap_s": swap_s}

    @app.post("/v1/adapters/pin")
    async def pin(request: Request) -> dict:
        version, _ = await body_version(request)
        if version is None:
            raise ApiError(400, "the base model is always kept; pin a version", param="version")
        unpin = request.query_params.get("unpin") in ("1", "true")
        await guarded(state.adapters.pin(version, not unpin))
        return {"version": version, "pinned": not unpin}

    @app.post("/v1/adapters/promote")
    async def promote(request: Request) -> dict:
        version, _ = await body_version(request)
        if version is None:
            raise ApiError(400, "promote a version; the base model is served by rollback", param="version")
        out = await guarded(state.adapters.promote(version))
        if state.trainer is not None:  # its notes were never checked against it if the gate refused it
            state.trainer.check_notes(version)
        return out

    @app.post("/v1/adapters/prune")
    async def prune() -> dict:
        return {"pruned": await state.adapters.prune()}


async def _gate_status(state: AppState) -> dict[str, Any]:
    """The gate's counters and the newest version's fate ("v7 not promoted: <reason>")."""
    rows = await asyncio.to_thread(state.store.adapters)
    newest = rows[-1] if rows else None
    gate, guard = state.gate, state.guard
    return {
        "enabled": gate is not None,
        "reviewing": gate and gate.reviewing,
        "promoted": gate.promoted if gate else 0,
        "refused": gate.refused if gate else 0,
        "last_review_s": gate and gate.last_review_s,
        "newest": newest and {"version": newest["version"], "state": newest["state"], "reason": newest["reason"]},
        "guard": {"enabled": guard is not None, "rollbacks": guard.rollbacks if guard else 0,
                  "last": guard and guard.last},
    }


def _version() -> str:
    from clawback import __version__

    return __version__


async def _read_json(request: Request, limit: int, empty: Any = None) -> Any:
    """The body as JSON (`empty` when there is none and that is allowed)."""
    timeout_s = request.app.state.clawback.settings.client_timeout_s
    try:
        body = await read_limited(request.stream(), limit, request.headers.get("content-length"), timeout_s)
        return empty if not body and empty is not None else parse_json(body)
    except BodyError as e:
        raise ApiError(e.status, f"request body: {e.message}", code=e.code) from None
    except ClientDisconnect:
        raise ApiError(CLIENT_GONE, "the client closed the connection before its request body ended",
                       code="client_gone") from None


IMAGE_PARTS = ("image_url", "input_image", "image")


def _refuse_images(raw: dict[str, Any]) -> None:
    """Image content parts get a plain answer rather than a schema path."""
    messages = raw.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                raise ApiError(400, "this model does not accept images", param=f"messages.{i}.content.{j}",
                               code="images_not_supported")


def _validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    msg = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


# A prompt this small renders in well under a millisecond, less than the hop to a worker thread
# costs; bigger ones (agent prompts with long system prompts and tool lists) render off the loop.
INLINE_RENDER_BYTES = 16 * 1024


@dataclass
class _Prepared:
    req: ChatRequest  # as received (session pairing compares what the client sent)
    served: ChatRequest  # as rendered for the model: with the preference notes, when any
    meta: CallMeta
    prompt_text: str
    prompt_ids: list[int]
    sampling: Sampling
    adapter: str | None
    call_id: str
    arrived: float
    rendered: float


async def _prepare(state: AppState, request: Request) -> _Prepared:
    arrived = time.time()
    raw = await _read_json(request, state.settings.max_body_bytes)
    if not isinstance(raw, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    _refuse_images(raw)
    try:
        req = ChatRequest.model_validate(raw)
    except ValidationError as e:
        raise _validation_error(e) from None
    if req.model_extra:
        name = next(iter(req.model_extra))
        raise ApiError(400, f"unknown field {name!r}: this server does not know what it asks for, so it refuses it "
                            "rather than ignore it", param=name, code="unknown_parameter")
    if (name := req.not_implemented()) is not None:
        raise ApiError(400, f"{name} is not supported: only its default (no effect) is accepted", param=name,
                       code="unsupported_parameter")
    if (req.n or 1) > 1:
        raise ApiError(400, "n > 1 is not supported: each reply is its own call; send n requests",
                       param="n", code="unsupported_parameter")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    constraint = req.constraint()
    if constraint is not None:
        error = await asyncio.to_thread(grammar.check, constraint)
        if error:
            param = "tools" if constraint.prefix else "response_format"
            raise ApiError(400, f"cannot enforce this schema: {error.strip()}", param=param, code="invalid_schema")
    if req.model not in (state.settings.served_model_name, state.engine.info.name):
        raise ApiError(404, f"model {req.model!r} does not exist; this daemon serves "
                            f"{state.settings.served_model_name!r}", param="model", code="model_not_found")
    try:
        meta = parse_meta(request.headers, req)
    except MetaError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
    adapter = state.engine.active_version()
    served, prompt_text, prompt_ids = await _render(state, request, req, meta, adapter)
    if state.engine.active_version() != adapter:  # a version went live meanwhile: serve it, with its notes
        adapter = state.engine.active_version()
        served, prompt_text, prompt_ids = await _render(state, request, req, meta, adapter)
    ctx = state.engine.info.context_length
    if len(prompt_ids) >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your messages "
                            f"resulted in {len(prompt_ids)} tokens. Please reduce the length of the messages.",
                       param="messages", code="context_length_exceeded")
    wanted = req.max_completion_tokens or req.max_tokens or state.settings.default_max_tokens
    sampling = Sampling(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=min(wanted, ctx - len(prompt_ids)),  # the room left in the context
        seed=req.seed,
        stop_token_ids=state.engine.info.eos_token_ids,
        # Main calls keep the policy's top-K per token too, for top-K OPD's teacher to score.
        top_logprobs=max(req.top_logprobs or 0, state.opd_top_k if meta.turn_type == "main" else 0),
        constraint=constraint,
    )
    return _Prepared(req, served, meta, prompt_text, prompt_ids, sampling, adapter,
                     f"chatcmpl-{random_id()}", arrived, time.time())


async def _render(state: AppState, request: Request, req: ChatRequest, meta: CallMeta,
                  adapter: str | None) -> tuple[ChatRequest, str, list[int]]:
    """The request as served to `adapter` (main calls get the person's preference notes that are
    active for it, the general ones and their conversation's, in the message `memory_placement`
    names; the request is stored as served) and its prompt."""
    served = req if req.memory_notes is None else req.model_copy(update={"memory_notes": None})
    if meta.turn_type == "main" and state.settings.memory:
        notes = await state.store.note_texts(Version.of(adapter), meta.session_id)
        if notes:
            body = served.model_dump(exclude_none=True)
            served = ChatRequest.model_validate({**body, "memory_notes": notes, "messages": inject(
                body["messages"], notes, state.settings.memory_placement)})
    try:
        length = request.headers.get("content-length", "")  # absent when chunked: render off the loop
        if length.isdigit() and len(length) <= 6 and int(length) < INLINE_RENDER_BYTES:
            prompt_text, prompt_ids = state.renderer.render(served)
        else:
            prompt_text, prompt_ids = await asyncio.to_thread(state.renderer.render, served)
    except Exception as e:  # the chat template rejected this conversation (role order etc.)
        raise ApiError(400, f"the model's chat template cannot render these messages: {e}",
                       param="messages", code="invalid_messages") from None
    return served, prompt_text, prompt_ids


def _top_matrix(tokens: list[Token], field: str) -> list[list[Any]] | None:
    """T x K `top_ids` or `top_logprobs`; None unless every position has the same K > 0."""
    rows = [list(getattr(t, field)) for t in tokens]
    widths = {len(r) for r in rows}
    return rows if len(widths) == 1 and 0 not in widths else None


def _sampling_logprobs(tokens: list[Token]) -> list[float] | None:
    """Each token's logprob under the distribution it was drawn from; None if any is unknown (greedy)."""
    values = [t.sampling_logprob for t in tokens]
    return None if not values or None in values else [float(v) for v in values if v is not None]


class _Run:
    """One generation: tokens in, text deltas out, and the record for the store at the end."""

    def __init__(self, state: AppState, p: _Prepared) -> None:
        self.state, self.p = state, p
        self.detok = IncrementalDetokenizer(state.renderer.tokenizer)
        self.gate = TextGate(p.req.stop_list(), p.req.tools_enabled())
        self.tokens: list[Token] = []
        self.first_token_at: float | None = None
        self.finish_reason = "cancelled"
        self.tool_calls: list[dict[str, Any]] = []
        self.content: str | None = None
        self.finished = False

    async def deltas(self) -> AsyncIterator[str]:
        eos = set(self.p.sampling.stop_token_ids)
        stream = self.state.engine.generate(self.p.prompt_ids, self.p.sampling, self.p.adapter)
        try:
            async for tok in stream:
                if self.first_token_at is None:
                    self.first_token_at = time.time()
                self.tokens.append(tok)
                if tok.id in eos:
                    break
                out = self.gate.feed(self.detok.push(tok.id))
                if out:
                    yield out
                if self.gate.stopped:
                    break
        finally:
            await stream.aclose()  # stops the engine early on a stop string or a client disconnect
        hit_eos = bool(self.tokens) and self.tokens[-1].id in eos
        tail = self.gate.finish()
        if tail:
            yield tail
        self.finish_reason = "stop" if (hit_eos or self.gate.stopped) else "length"
        if self.gate.tool_text:
            self.content, self.tool_calls = parse_tool_calls(self.gate.text, self.p.req.tool_names())
            if self.tool_calls:
                self.finish_reason = "tool_calls"
            else:  # held back as a possible call and not one: the client gets it as content
                yield self.gate.tool_text
        else:
            self.content = self.gate.content

    def logprobs_content(self) -> dict[str, Any] | None:
        """OpenAI `logprobs.content` for every sampled token (the end token included)."""
        if not self.p.req.logprobs:
            return None
        decode = self.state.renderer.tokenizer.decode

        def entry(token_id: int, lp: float) -> dict[str, Any]:
            text = decode([token_id])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        n = self.p.req.top_logprobs or 0  # the engine may hold more: main calls keep top-K for OPD
        return {"content": [{**entry(t.id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in zip(t.top_ids[:n], t.top_logprobs[:n])]}
                            for t in self.tokens]}

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def usage(self) -> dict[str, int]:
        n_prompt, n_out = len(self.p.prompt_ids), len(self.ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def record(self) -> Call:
        p, now = self.p, time.time()
        ttft = (self.first_token_at or now) - p.arrived
        return Call(
            call_id=p.call_id, session_id=p.meta.session_id, turn_id=p.meta.turn_id,
            request_id=p.meta.request_id, turn_type=p.meta.turn_type, state="served",
            created_at=p.arrived, finished_at=now, model=self.state.engine.info.name,
            adapter_version=Version.of(p.adapter), request=p.served.openai_body(), prompt_text=p.prompt_text,
            prompt_ids=p.prompt_ids, response_ids=self.ids, behaviour_logprobs=[t.logprob for t in self.tokens],
            sampling_logprobs=_sampling_logprobs(self.tokens), top_ids=_top_matrix(self.tokens, "top_ids"),
            top_logprobs=_top_matrix(self.tokens, "top_logprobs"),
            response_text=self.gate.text, tool_calls=self.tool_calls or None,
            finish_reason=self.finish_reason,
            timings={"render_s": p.rendered - p.arrived, "ttft_s": ttft, "total_s": now - p.arrived,
                     "completion_tokens": len(self.ids)},
        )

    def finish(self) -> None:
        """Hands the call to capture; runs once (more calls are no-ops), also when the client went
        away mid-stream."""
        if self.finished:
            return
        self.finished = True
        s = self.state
        s.count_running(-1)
        rec = self.record()
        s.capture.finish(self.p.meta, rec, self.p.req)
        s.calls.labels(self.p.meta.turn_type).inc()
        s.tokens.labels("prompt").inc(len(self.p.prompt_ids))
        s.tokens.labels("completion").inc(len(self.ids))
        s.ttft.observe(rec.timings["ttft_s"])
        s.latency.labels(str(self.p.req.stream).lower()).observe(rec.timings["total_s"])

    async def before_reply(self) -> None:
        """Runs before the client gets the end of its reply. A main call is handed to capture and
        committed first, so that a reply the client has is never lost to a crash. A side call is
        never trained: it is handed over after the reply (`finish` then), which keeps its
        bookkeeping and the store writer's wake-up off the reply's path."""
        if self.p.meta.turn_type == "main":
            self.finish()
            with contextlib.suppress(StoreBusy):  # the call was dropped and counted, not lost unseen
                await self.state.store.committed()


class _ReplyThen(JSONResponse):
    """A JSON reply, then `then()`: work the client need not wait for (also when sending failed)."""

    def __init__(self, content: Any, headers: dict[str, str], then: Callable[[], None]) -> None:
        super().__init__(content, headers=headers)
        self.then = then

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.then()


class _EventStream(Response):
    """Server-sent events, each sent as soon as it is made. Starlette's StreamingResponse does the
    same through an anyio task group and a wrapper per chunk; here one task watches for the client
    going away, which cancels the stream and so stops the generation."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers(headers)  # no body: no content-length, so uvicorn sends it chunked

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await _unless_client_gone(stream(), receive)  # cancelled, the engine stops and the call is stored


CLIENT_GONE = 499  # the status counted for a request whose client left before its reply (nginx's)


async def _generate(run: _Run) -> None:
    async for _ in run.deltas():
        pass
    await run.before_reply()


async def _client_gone(receive: Receive) -> None:
    """Returns when the client closes its connection (uvicorn reports that on `receive`; `send`
    does not fail). Only after the request body was read: until then `receive` returns it."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_gone(work: Any, receive: Receive) -> bool:
    """Run `work` until it is done (True) or the client goes away (False: `work` is cancelled,
    its cleanup done)."""
    working, watching = asyncio.ensure_future(work), asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        working.cancel()  # a no-op once it is done
    await asyncio.wait((working,))
    if working.cancelled():
        return False
    if (error := working.exception()) is not None:
        raise error
    return True


def _headers(p: _Prepared) -> dict[str, str]:
    return {"x-request-id": p.meta.request_id, "x-clawback-call-id": p.call_id,
            "x-clawback-adapter": p.adapter or "base"}


async def _chat(state: AppState, request: Request) -> Response:
    p = await _prepare(state, request)
    await state.capture.begin(p.meta, p.req, p.call_id)
    state.count_running(+1)
    run = _Run(state, p)
    if p.req.stream:
        return _EventStream(_sse(state, run), headers={**_headers(p), "cache-control": "no-cache"})
    try:
        if not await _unless_client_gone(_generate(run), request.receive):
            # Stopped where the client left; what was generated is stored, as a cancelled call.
            run.finish()
            return Response(status_code=CLIENT_GONE)
    except EngineError as e:
        run.finish()
        raise ApiError(500, f"generation failed: {e}", "server_error") from None
    except BaseException:
        run.finish()
        raise
    message: dict[str, Any] = {"role": "assistant", "content": run.content}
    if run.tool_calls:
        message["tool_calls"] = run.tool_calls
    body = {
        "id": p.call_id, "object": "chat.completion", "created": int(p.arrived),
        "model": p.req.model, "system_fingerprint": p.adapter or "base",
        "choices": [{"index": 0, "message": message, "logprobs": run.logprobs_content(), "finish_reason": run.finish_reason}],
        "usage": run.usage(),
    }
    return _ReplyThen(body, _headers(p), then=run.finish)


async def _sse(state: AppState, run: _Run) -> AsyncIterator[bytes]:
    p = run.p
    base = {"id": p.call_id, "object": "chat.completion.chunk", "created": int(p.arrived),
            "model": p.req.model, "system_fingerprint": p.adapter or "base"}
    include_usage = bool(p.req.stream_options and p.req.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    # A text chunk is the same bytes around the JSON string of its text: built once per request,
    # so a token costs one json.dumps of a short string instead of a whole chunk's.
    head, tail = chunk({"content": "\0"}).rsplit(b'"\\u0000"', 1)

    # The role chunk goes out with the first text, and the closing chunks in one write: the engine
    # starts before it is sent, and the client wakes once for each instead of once per chunk.
    opening = chunk({"role": "assistant", "content": ""})
    try:
        try:
            async for text in run.deltas():
                yield opening + head + json.dumps(text, ensure_ascii=False).encode() + tail
                opening = b""
        except EngineError as e:
            err = {"error": {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": None}}
            yield opening + b"data: " + json.dumps(err).encode() + b"\n\n"
            return
        closing = [opening, *(chunk({"tool_calls": [{"index": i, **call}]}) for i, call in enumerate(run.tool_calls))]
        await run.before_reply()
        closing.append(chunk({}, run.finish_reason, run.logprobs_content()))  # all of them, once the tokens are final
        if include_usage:
            closing.append(b"data: " + json.dumps({**base, "choices": [], "usage": run.usage()}).encode() + b"\n\n")
        yield b"".join(closing) + b"data: [DONE]\n\n"
    finally:
        run.finish()
