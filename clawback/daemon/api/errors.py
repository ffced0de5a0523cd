"""The API's error replies (OpenAI's error shape) and the JSON body reader that raises them."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..bodies import BodyError, parse_json, read_limited

CLIENT_GONE = 499  # the status counted for a request whose client left before its reply (nginx's)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


async def read_json(request: Request, limit: int, empty: object = None) -> object:  # callers check its shape
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


def validation_error(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    msg = first["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")
