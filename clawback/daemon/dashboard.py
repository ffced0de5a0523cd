"""The dashboard at /ui: what the agent learned, from what, and how to undo it.

Server-rendered Jinja2 pages with htmx (vendored under static/ui/vendor, no CDN), one section per
template part; the page listens to /ui/events (server-sent events) and re-fetches its sections
whenever the store commits something, so it updates without a reload.

Security: the page is behind the API key. Logging in (with the key, or with a one-time link from
`clawback dashboard`) gives an HttpOnly, SameSite=Strict session cookie scoped to /ui. Every POST
must carry the session's CSRF token in a header (htmx sends it) and come from this origin
(`Sec-Fetch-Site`, or `Origin` from browsers without Fetch Metadata). A Content-Security-Policy
allows nothing from another origin. Actions call the same code as the HTTP API and the CLI
(`AdapterManager`, `forget()`).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI, Form, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clawback.records import Version

from .dashboard_views import PAGE_SIZE, chart, finite, message_text, pager, simulate_summary, untagged_only
from .display import ago, reward_origin, sample_reason, sample_state
from .forget import forget
from .store import ForgetScope, Store
from .store.queries import SessionCall
from .store.reads import AdapterRow

if TYPE_CHECKING:
    from .api.state import AppState

PREFIX = "/ui"
COOKIE = "clawback_ui"
SESSION_TTL_S = 12 * 3600
LINK_TTL_S = 120
EVENTS_POLL_S = 1.0
STREAM_LIFETIME_S = 5.0
RECONNECT_MS = 1000
# A series' colour says what it is, the same in every chart: good green, bad red.

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    # A one-time link never leaks through a Referer; no-referrer would make Chromium send Origin: null.
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]


@dataclass
class Logins:
    """Dashboard sessions (cookie token -> CSRF token, expiry) and one-time login links, in memory:
    a restart of the daemon logs everyone out."""

    sessions: dict[str, tuple[str, float]] = field(default_factory=dict)
    links: dict[str, float] = field(default_factory=dict)

    def issue(self) -> str:
        now = time.time()
        self.sessions = {t: v for t, v in self.sessions.items() if v[1] > now}
        token = secrets.token_urlsafe(32)
        self.sessions[token] = (secrets.token_urlsafe(32), now + SESSION_TTL_S)
        return token

    def csrf(self, token: str | None) -> str | None:
        """The session's CSRF token, or None when the cookie names no live session."""
        entry = self.sessions.get(token or "")
        return entry[0] if entry and entry[1] > time.time() else None

    def link(self) -> str:
        now = time.time()
        self.links = {t: exp for t, exp in self.links.items() if exp > now}
        token = secrets.token_urlsafe(32)
        self.links[token] = now + LINK_TTL_S
        return token

    def use_link(self, token: str) -> bool:
        expires = self.links.pop(token, 0.0)  # once only
        return expires > time.time()


class _SecurityHeaders:
    """Pure ASGI (streaming responses stay untouched): the same headers on every /ui response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers if scope["type"] == "http" else send)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def add_dashboard_routes(app: FastAPI, state: AppState) -> None:
    """Mount the dashboard at /ui, and the bearer-authenticated route that mints one-time links."""
    logins = Logins()

    @app.post("/v1/dashboard/link")
    async def dashboard_link() -> dict:
        return {"path": f"{PREFIX}/login?token={logins.link()}", "expires_in_s": LINK_TTL_S}

    app.mount(PREFIX, _SecurityHeaders(_dashboard_app(state, logins)))


def _dashboard_app(state: AppState, logins: Logins) -> FastAPI:
    ui = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    pkg = resources.files("clawback.daemon")
    templates = Jinja2Templates(directory=str(pkg.joinpath("templates")))
    templates.env.filters["ago"] = ago
    templates.env.filters["sample_state"] = sample_state
    templates.env.filters["sample_reason"] = sample_reason
    templates.env.globals["reward_origin"] = reward_origin
    templates.env.filters["pct"] = lambda x: "–" if x is None else f"{100 * x:.0f}%"
    templates.env.filters["num"] = lambda x, d=3: "–" if x is None else f"{x:.{d}g}"
    ui.mount("/static", StaticFiles(directory=str(pkg.joinpath("static", "ui"))), name="static")
    data = DashboardData(state)
    # Where the login page says the key is: the file of this daemon's data dir, unless a key was set.
    key_file = None if state.settings.api_key is not None else str(state.settings.api_key_path)

    @ui.exception_handler(_Refused)
    async def _refused(_: Request, e: _Refused) -> Response:
        return JSONResponse({"error": {"message": str(e), "type": "authentication_error"}}, status_code=e.status)

    def session(request: Request) -> str:
        """The caller's CSRF token; refuses a request without a live session cookie."""
        csrf = logins.csrf(request.cookies.get(COOKIE))
        if csrf is None:
            raise _Refused(401, "log in at /ui/login")
        return csrf

    def checked_post(request: Request) -> None:
        """A state-changing request: live session, same origin, and the session's CSRF token."""
        csrf = session(request)
        _same_origin(request)
        given = request.headers.get("x-csrf-token", "")
        if not hmac.compare_digest(given.encode(), csrf.encode()):
            raise _Refused(403, "missing or wrong CSRF token")

    def page(request: Request, name: str, status_code: int = 200, **ctx: object) -> HTMLResponse:
        return templates.TemplateResponse(request, name, {"prefix": PREFIX, **ctx}, status_code=status_code)

    def logged_in() -> Response:
        response = RedirectResponse(f"{PREFIX}/", status_code=303)
        response.set_cookie(COOKIE, logins.issue(), max_age=SESSION_TTL_S, path=PREFIX, httponly=True,
                            samesite="strict")
        return response

    @ui.get("/login")
    async def login_page(request: Request, token: str | None = None) -> Response:
        if state.api_key is None or (token is not None and logins.use_link(token)):
            return logged_in()
        error = "This link was used already or has expired." if token is not None else None
        return page(request, "ui/login.html", error=error, key_file=key_file)

    @ui.post("/login")
    async def login(request: Request, key: str = Form("")) -> Response:
        _same_origin(request)
        if state.api_key is None or hmac.compare_digest(key.strip().encode(), state.api_key.encode()):
            return logged_in()
        return page(request, "ui/login.html", 401, error="That is not this daemon's API key.", key_file=key_file)

    @ui.post("/logout")
    async def logout(request: Request) -> Response:
        checked_post(request)
        logins.sessions.pop(request.cookies.get(COOKIE, ""), None)
        response = Response(status_code=204, headers={"hx-redirect": f"{PREFIX}/login"})
        response.delete_cookie(COOKIE, path=PREFIX)
        return response

    @ui.get("/")
    async def index(request: Request) -> Response:
        csrf = logins.csrf(request.cookies.get(COOKIE))
        if csrf is None:
            return RedirectResponse(f"{PREFIX}/login", status_code=303)
        parts = {name: await data.part(name) for name in PARTS}
        return page(request, "ui/index.html", csrf=csrf, parts=parts)

    @ui.get("/part/{name}")
    async def part(request: Request, name: str, page_no: int = Query(1, alias="page", ge=1)) -> Response:
        session(request)
        if name not in PARTS:
            return Response(status_code=404)
        return page(request, f"ui/part_{name}.html", p=await data.part(name, page_no))

    @ui.get("/session/{session_id}")
    async def conversation(request: Request, session_id: str) -> Response:
        session(request)
        calls = _session_calls(await asyncio.to_thread(data.store.session_calls, session_id))
        return page(request, "ui/session.html", session_id=session_id, calls=calls)

    @ui.post("/adapters/{action}")
    async def adapter_action(request: Request, action: str, version: str = Form(""), force: str = Form("")) -> Response:
        """The same operations as `POST /v1/adapters/...` and `clawback adapters ...`."""
        from .adapters import AdapterError, promoted_summary

        checked_post(request)
        error = notice = None
        try:
            if action == "promote":
                notice = promoted_summary(asdict(await state.adapters.promote(int(version))))
            elif action == "rollback":
                await state.adapters.rollback(None if version == "base" else int(version), force == "true")
            elif action in ("pin", "unpin"):
                await state.adapters.pin(int(version), action == "pin")
            elif action == "prune":
                await state.adapters.prune()
            else:
                return Response(status_code=404)
        except (AdapterError, ValueError) as e:
            error = str(e) if isinstance(e, AdapterError) else f"not a version: {version!r}"
        return page(request, "ui/part_versions.html", p=await data.part("versions"), error=error, notice=notice)

    @ui.post("/memory/{action}")
    async def memory_action(request: Request, action: str, note_id: int = Form(ge=1, le=2**63 - 1),
                            text: str = Form("")) -> Response:
        """The same store calls as `PUT`/`DELETE /v1/memory/{id}` and `clawback memory edit|forget`."""
        checked_post(request)
        if action == "edit":
            done = bool(text.strip()) and await state.store.edit_note(note_id, text)
            error = None if done else ("a note needs text" if not text.strip() else f"no memory note {note_id}")
        elif action == "forget":
            error = None if await state.store.forget_notes(note_id) else f"no memory note {note_id}"
        else:
            return Response(status_code=404)
        return page(request, "ui/part_memory.html", p=await data.part("memory"), error=error)

    @ui.post("/forget")
    async def forget_session(request: Request, session_id: str = Form("")) -> Response:
        """The same `forget()` as `POST /v1/forget` and `clawback forget --session`."""
        checked_post(request)
        if not session_id:
            return page(request, "ui/forgotten.html", 400, error="name the session to forget")
        report = await forget(state.store, ForgetScope(session_id=session_id), state.capture)
        return page(request, "ui/forgotten.html", session_id=session_id, report=report, live=state.adapters.live())

    @ui.get("/events")
    async def events(request: Request) -> Response:
        session(request)
        return StreamingResponse(_changes(state, request), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    return ui


def _same_origin(request: Request) -> None:
    """Refuse a request another site or origin made the browser send (Fetch Metadata, then Origin)."""
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    if site is not None:
        ok = site in ("same-origin", "none")  # none: typed or opened by the person, not by a page
    else:
        ok = origin is None or origin == f"{request.url.scheme}://{request.headers.get('host', '')}"
    if not ok:
        raise _Refused(403, "cross-origin request refused")


async def _changes(state: AppState, request: Request) -> AsyncIterator[bytes]:
    """`changed` whenever the store commits a write, the live version changes, a write is dropped or
    a feedback socket (the extension) comes or goes.

    The store's write counter moves on every committed call, feedback event, sample, training step
    and swap, so one cheap comparison per second covers every section. Each event's id is that
    state; a stream ends after STREAM_LIFETIME_S (an open stream would hold the daemon's shutdown),
    and the browser reconnects with the last id it saw, so a change in between is not missed."""

    def now() -> str:
        return (f"{state.store.written}.{state.engine.active_version()}.{sum(state.store.dropped.values())}."
                f"{state.hub.connections()}")

    seen = request.headers.get("last-event-id", "")
    last = seen if re.fullmatch(r"[\w.]{1,200}", seen) else now()
    yield f"retry: {RECONNECT_MS}\nid: {last}\n\n".encode()
    ends = time.monotonic() + STREAM_LIFETIME_S
    while time.monotonic() < ends and not await request.is_disconnected():
        if (current := now()) != last:
            yield f"id: {current}\nevent: changed\ndata: {{}}\n\n".encode()
            last = current
        await asyncio.sleep(EVENTS_POLL_S)


# ---------------------------------------------------------------- what each section shows

PARTS = ("health", "learning", "feedback", "versions", "memory", "conversations")
STEP_METRICS = ("loss", "kl", "entropy", "grad_norm", "clip_frac")
GATE_METRICS = ("replay_margin", "retention")


def _gate_numbers(adapter: AdapterRow) -> dict[str, float | None]:
    """The gate's replay margin and retention score of a version, from its `gate` report."""
    report = adapter.gate
    margin = (report.get("replay") or {}).get("margin")
    return {"replay_margin": finite(margin.get("candidate")) if isinstance(margin, dict) else None,
            "retention": finite((report.get("retention") or {}).get("candidate"))}


class DashboardData:
    """Read-only queries behind each section (the store's own read connections, off the loop)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.store = state.store

    async def part(self, name: str, page: int = 1) -> dict[str, object]:
        if name == "health":
            return await self.health()
        if name == "memory":
            live = self.state.adapters.live()
            return {"notes": await asyncio.to_thread(self.store.memory_notes, live), "enabled": self.state.settings.memory,
                    "live": live}
        if name == "learning":
            out = await asyncio.to_thread(_learning, self.store)
            out["simulate"] = simulate_summary(self.state.settings.data_dir)
        else:
            query = {"feedback": _feedback, "versions": _versions, "conversations": _sessions}[name]
            out = await asyncio.to_thread(query, self.store, (page - 1) * PAGE_SIZE)
            total = out.pop("total")
            assert isinstance(total, int)  # each page query counts its rows
            out["pager"] = pager(name, page, total)
        out["live"] = self.state.adapters.live()
        return out

    async def health(self) -> dict[str, object]:
        s = self.state
        counts = await asyncio.to_thread(s.store.counts)
        last_main = await asyncio.to_thread(s.store.newest_main_call_at)
        main = {k.split("/", 1)[1]: n for k, n in counts.calls.items() if k.startswith("main/")}
        n_main = sum(main.values())
        return {
            "model": s.engine.info.name,
            "engine": s.settings.engine,
            "live": s.adapters.live(),
            "extension_connections": s.hub.connections(),
            "main_calls": n_main,
            "paired": main.get("paired", 0),
            "awaiting": main.get("awaiting_next_state", 0),  # the newest call of each session waits
            "untagged_calls": s.capture.counters.get("untagged_calls", 0),
            "last_main_at": last_main,
            "untagged_only": untagged_only(s.capture.last_untagged_at, last_main, time.time()),
            "samples": counts.samples,
            "dropped_samples": counts.dropped_samples,
            "opd": counts.opd,
            "ready": counts.samples.get("ready", 0),
            "batch_size": s.settings.train_config().batch_size,
            "training": s.trainer is not None,
            "training_now": bool(s.trainer and s.trainer.busy),
            "judge": s.judge_name,
            "judging": counts.samples.get("pending_judge", 0),
            "dropped": dict(s.store.dropped),
            "queue_depth": s.store.queue_depth(),
        }





def _learning(store: Store) -> dict[str, object]:
    rates = []
    for f in sorted(store.feedback_per_version(), key=lambda f: f.version or 0):
        counts = {"up": f.thumbs_up, "down": f.thumbs_down, "corrections": f.corrections}
        rates.append({"version": Version.name_of(f.version) or "base", "order": f.version or 0, "calls": f.calls,
                      **{k: x / f.calls for k, x in counts.items()}, **{f"n_{k}": x for k, x in counts.items()}})
    gate = {}
    for a in store.adapters():
        numbers = _gate_numbers(a)
        if any(v is not None for v in numbers.values()):
            gate[a.version] = numbers
    for r in rates:
        r.update(gate.get(r["order"], dict.fromkeys(GATE_METRICS)))
    steps = [{"step": t.step, "version": t.version, "outcome": t.outcome, "samples": t.samples, "error": t.error,
              "at": t.finished_at, **{k: finite(t.metrics.get(k)) for k in STEP_METRICS}} for t in store.train_steps()]
    charts = []
    # A chart needs two points to show a change; one point is in the tables below.
    if len(rates) > 1:
        charts.append(chart("Live feedback per version (share of main calls)", [r["order"] for r in rates],
                             [r["version"] for r in rates], {"good": [r["up"] for r in rates],
                                                            "bad": [r["down"] for r in rates],
                                                            "corrections": [r["corrections"] for r in rates]}))
    if len(gate) > 1:
        for k in GATE_METRICS:
            charts.append(chart(f"gate {k.replace('_', ' ')} per version", list(gate), [Version(v).name for v in gate],
                                 {k: [g[k] for g in gate.values()]}, small=True))
    done = [s for s in steps if s["outcome"] == "committed"]
    for k in STEP_METRICS:  # one small chart per metric: their scales differ by orders of magnitude
        if len(done) > 1 and any(s[k] is not None for s in done):
            charts.append(chart(f"{k} per training step", [s["step"] for s in done], None,
                                 {k: [s[k] for s in done]}, small=True))
    return {"rates": rates, "gate": gate, "steps": steps[-20:][::-1], "charts": charts}














def _feedback(store: Store, offset: int = 0) -> dict[str, object]:
    return {"events": store.feedback_page(offset, PAGE_SIZE), "total": store.feedback_count()}


def _versions(store: Store, offset: int = 0) -> dict[str, object]:
    rows = []
    # The live version is always shown, on every page: the page's actions are relative to it.
    for a in store.adapter_page(offset, PAGE_SIZE):
        row = {k: v for k, v in asdict(a).items() if k != "metrics"}
        rows.append({**row, "loss": finite(a.metrics.get("loss")), "reward": finite(a.metrics.get("reward_mean")),
                     **_gate_numbers(a)})
    return {"adapters": rows, "has_gate": any(r[k] is not None for r in rows for k in GATE_METRICS),
            "total": store.adapter_count()}


def _sessions(store: Store, offset: int = 0) -> dict[str, object]:
    """Named sessions, newest first, a page at a time; calls without a session id are counted
    together (each would otherwise be a session row of its own)."""
    anon = store.anonymous_calls()
    return {"sessions": store.session_page(offset, PAGE_SIZE), "total": store.session_count(),
            "anonymous": anon if anon.calls else None}


def _session_calls(calls: list[SessionCall]) -> list[dict[str, object]]:
    out = []
    for call in calls:
        messages = call.request.get("messages", [])
        last_user = next((m for m in reversed(messages) if m.get("role") == "user"), None)
        out.append({"call_id": call.call_id, "created_at": call.created_at, "adapter_version": call.adapter_version,
                    "state": call.state, "response_text": call.response_text, "sample_state": call.sample_state,
                    "sample_reason": call.sample_reason, "reward": call.reward, "reward_source": call.reward_source,
                    "outcome": call.outcome, "request": message_text(last_user.get("content")) if last_user else "",
                    "next_state": [f"{m.get('role')}: {message_text(m.get('content'))}" for m in call.next_state],
                    "feedback": call.feedback})
    return out
