"""/v1/adapters: list the versions, roll back, pin, promote, prune."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import asdict
from typing import TypeVar

from fastapi import FastAPI, Request

from clawback.records import Version

from .errors import ApiError, read_json
from .state import AppState

T = TypeVar("T")


def add_adapter_routes(app: FastAPI, state: AppState) -> None:
    from ..adapters import AdapterError

    async def body_version(request: Request) -> tuple[int | None, dict[str, object]]:
        raw = await read_json(request, 4096, empty={})
        try:
            if not isinstance(raw, dict):
                raise ValueError(raw)
            v = raw.get("version")
            if isinstance(v, bool):
                raise ValueError(v)
            return Version.of(v), raw
        except (ValueError, AttributeError):
            raise ApiError(400, "body must be {\"version\": N} (or \"base\")", param="version") from None

    async def guarded(coro: Awaitable[T]) -> T:
        try:
            return await coro
        except AdapterError as e:
            raise ApiError(400, str(e), param="version", code="invalid_version") from None

    @app.get("/v1/adapters")
    async def list_adapters() -> dict:
        rows = await asyncio.to_thread(state.store.adapters)
        return {"live": state.adapters.live(), "reviewing": state.gate and state.gate.reviewing,
                "data": [asdict(a) for a in rows]}

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
        return asdict(out)

    @app.post("/v1/adapters/prune")
    async def prune() -> dict:
        return {"pruned": await state.adapters.prune()}
