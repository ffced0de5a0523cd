"""Reading request bodies and WebSocket frames: size-limited, strict JSON, bounded nesting.

Everything a client sends goes through here before any model sees it, so that malformed input is
a 4xx (or a `malformed` frame) and never reaches the store or the engine: no body is read past its
limit, bytes that are not UTF-8 (an encoded lone surrogate among them), integers past Python's
digit limit, NaN/Infinity, lone UTF-16 surrogates written as escapes (which SQLite cannot store as
UTF-8) and nesting deeper than MAX_DEPTH are refused.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import NoReturn

MAX_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyError(ValueError):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


async def read_limited(chunks: AsyncIterator[bytes], limit: int, declared: str | None,
                       chunk_timeout_s: float) -> bytes:
    """The body, refused (413) as soon as it is over `limit` bytes: never buffered past it; and
    refused (408) when the client stalls for `chunk_timeout_s` in the middle of it."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"request body is over the {limit}-byte limit", "request_too_large")
    body = bytearray()
    stream = aiter(chunks)
    while True:
        try:
            # asyncio.timeout, not wait_for: no task per chunk (a small body is one chunk, read in
            # a few microseconds; wait_for's task would cost more than the read).
            async with asyncio.timeout(chunk_timeout_s):
                chunk = await anext(stream)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise BodyError(408, f"no request body data for {chunk_timeout_s:g} s", "request_timeout") from None
        body += chunk
        if len(body) > limit:
            raise BodyError(413, f"request body is over the {limit}-byte limit", "request_too_large")
    return bytes(body)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(data: bytes | str) -> object:
    """Strict JSON in UTF-8, or BodyError(400, code 'invalid_json')."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    try:
        # Decoded here, strictly: json.loads would decode bytes with `surrogatepass` and so let an
        # encoded lone surrogate (ED A0 80) through into a string the store cannot write.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"not valid UTF-8 (a lone surrogate, or another encoding): {e}", "invalid_json") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BodyError(400, f"JSON nested deeper than {MAX_DEPTH} levels", "invalid_json") from None
    except ValueError as e:  # also integers over Python's 4300-digit limit
        raise BodyError(400, f"not valid JSON: {e}", "invalid_json") from None
    if _depth_over(value, MAX_DEPTH):
        raise BodyError(400, f"JSON nested deeper than {MAX_DEPTH} levels", "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BodyError(400, "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair)",
                            "invalid_json") from None
    return value


def _depth_over(value: object, limit: int) -> bool:
    level = [value]
    for _ in range(limit):
        level = [v for c in level if isinstance(c, (dict, list)) for v in (c.values() if isinstance(c, dict) else c)]
        if not level:
            return False
    return any(isinstance(c, (dict, list)) for c in level)
