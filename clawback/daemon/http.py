"""The HTTP server around the app: uvicorn, with what it lacks for a daemon that stays up.

- A connection that has not sent a complete request head within `client_timeout_s` of opening
  (or of its last response) is closed: uvicorn alone waits forever on a slow or stalled head, so a
  few hundred such sockets would hold the daemon's connections open. Request bodies have their
  own per-chunk read timeout (`bodies.read_limited`).
- Query strings never reach the logs (a key sent as `?api_key=` would otherwise be logged with
  every WebSocket uvicorn accepts).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Protocol

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

_QUERY = re.compile(r"\?\S*")


class _Cycle(Protocol):
    response_complete: bool


class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol (httptools or h11, whichever it picks), with a deadline on request heads."""

    head_timeout_s = 10.0
    # What both of uvicorn's HTTP protocols have (AutoHTTPProtocol is typed as a plain Protocol):
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: _Cycle | None  # the request being served, None before the first head

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # pyright: ignore[reportAttributeAccessIssue]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
        self._head_timer: asyncio.TimerHandle = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _head_timeout(self) -> None:
        waiting_for_head = self.cycle is None or self.cycle.response_complete
        upgraded = self.transport.get_protocol() is not self  # now a WebSocket: not ours to close
        if waiting_for_head and not upgraded and not self.transport.is_closing():
            self.transport.close()


class _NoQueryStrings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            record.args = tuple(_QUERY.sub("?…", a) if isinstance(a, str) else a for a in args)
        record.msg = _QUERY.sub("?…", record.msg) if isinstance(record.msg, str) and "?" in record.msg else record.msg
        return True


def serve(app: Callable[..., object], host: str, port: int, log_level: str, head_timeout_s: float) -> None:
    protocol = type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, http=protocol)
    for name in ("uvicorn.error", "uvicorn.access"):  # after Config: it (re)configures these loggers
        logging.getLogger(name).addFilter(_NoQueryStrings())
    uvicorn.Server(config).run()
