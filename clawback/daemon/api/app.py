"""The FastAPI app: error handlers, the routes of each module, the OpenAPI description."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.types import Lifespan

from clawback.chat import ChatRequest
from clawback.records import JsonObject

from ..dashboard import add_dashboard_routes
from ..feedback import FeedbackEvent, add_feedback_routes
from .adapter_routes import add_adapter_routes
from .auth import CHAT_PATH, BearerAuth
from .errors import ApiError
from .memory_routes import add_forget_routes, add_memory_routes
from .protocol import ForgetBody, NoteScope, NoteText, RollbackBody, VersionBody
from .serving import serve_chat
from .state import AppState
from .status_routes import add_status_routes, server_version

log = logging.getLogger(__name__)


def create_app(state: AppState, lifespan: Lifespan[FastAPI] | None = None) -> BearerAuth:
    app = FastAPI(title="clawback", version=server_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
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

    add_status_routes(app, state)

    @app.post(CHAT_PATH)  # served by BearerAuth.chat; here for the OpenAPI description
    async def chat_completions(request: Request) -> Response:
        return await serve_chat(state, request)

    add_feedback_routes(app, state)
    add_adapter_routes(app, state)
    add_memory_routes(app, state)
    add_forget_routes(app, state)
    add_dashboard_routes(app, state)
    describe_bodies(app, {("/v1/chat/completions", "post"): ChatRequest, ("/v1/feedback", "post"): FeedbackEvent,
                           ("/v1/adapters/rollback", "post"): RollbackBody, ("/v1/adapters/pin", "post"): VersionBody,
                           ("/v1/forget", "post"): ForgetBody, ("/v1/adapters/promote", "post"): VersionBody,
                           ("/v1/memory/{note_id}", "put"): NoteText, ("/v1/memory/{note_id}", "patch"): NoteScope})

    return BearerAuth(app, state)


def describe_bodies(app: FastAPI, bodies: dict[tuple[str, str], type[BaseModel]]) -> None:
    """/openapi.json with each route's JSON body: the routes read raw bodies (size limits, strict
    JSON), so FastAPI cannot see them; the request models are the contract."""

    def build() -> JsonObject:  # the OpenAPI document, as FastAPI writes it
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
