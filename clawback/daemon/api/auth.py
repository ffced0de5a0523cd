"""Bearer auth and request counting, in front of every route."""

from __future__ import annotations

import hmac
import logging

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..dashboard import PREFIX as UI_PREFIX
from .errors import ApiError
from .serving import serve_chat
from .state import AppState

log = logging.getLogger(__name__)


ROUTES = ("/v1/chat/completions", "/v1/models", "/healthz", "/metrics", "/v1/status", "/v1/feedback",
          "/v1/adapters", "/v1/forget", "/v1/dashboard/link")


CHAT_PATH = "/v1/chat/completions"


class BearerAuth:
    """Bearer auth (all but /healthz and the dashboard, which has its own login), request counting.
    Pure ASGI so streaming stays untouched.

    Chat completions, the route every served call takes, go from here straight to their handler:
    FastAPI's middleware, routing and endpoint machinery cost more than the rest of the handler's
    own work on a small request. Its FastAPI route stays for the OpenAPI description (and answers
    405 to other methods)."""

    def __init__(self, app: ASGIApp, state: AppState) -> None:
        self.app, self.state = app, state
        key = state.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def chat(self, scope: Scope, receive: Receive, send: Send, status_box: list[int]) -> None:
        """POST /v1/chat/completions, with the errors FastAPI's handlers would give. Its status is
        counted from the response, so that streamed chunks go to `send` without a wrapper."""
        scope["app"] = self.app  # what Request.app reads
        try:
            response = await serve_chat(self.state, Request(scope, receive))
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
