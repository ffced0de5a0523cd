"""/v1/memory (the preference notes) and /v1/forget."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import FastAPI, Request
from pydantic import ValidationError

from clawback.records import Version

from ..forget import forget
from .errors import ApiError, read_json, validation_error
from .protocol import ForgetBody, NoteId, NoteScope
from .state import AppState


def add_memory_routes(app: FastAPI, state: AppState) -> None:
    """The person's preference notes (daemon/memory.py): list, edit one, change its scope, forget
    one or all."""

    async def notes() -> dict:
        """Every note; `scope`: "general" (every main call gets it) or "session" (only the calls of
        `session_id`'s conversation); `active`: injected while the live version serves (when memory
        is on), false for one that version retired (`retired_by`, daemon/retirement.py)."""
        live = state.adapters.live()
        return {"enabled": state.settings.memory, "max_notes": state.settings.memory_max_notes,
                "live": Version.name_of(live),
                "data": [{k: v for k, v in asdict(n).items() if k != "topic"}
                         for n in await asyncio.to_thread(state.store.memory_notes, live)]}

    @app.get("/v1/memory")
    async def list_notes() -> dict:
        return await notes()

    @app.put("/v1/memory/{note_id}")
    async def edit_note(request: Request, note_id: NoteId) -> dict:
        raw = await read_json(request, 64 * 1024)
        text = raw.get("text") if isinstance(raw, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, 'body must be {"text": "<the note>"} with a non-empty text', param="text")
        if not await state.store.edit_note(note_id, text):
            raise ApiError(404, f"no memory note {note_id}", param="note_id", code="not_found")
        return await notes()

    @app.patch("/v1/memory/{note_id}")
    async def scope_note(request: Request, note_id: NoteId) -> dict:
        try:
            body = NoteScope.model_validate(await read_json(request, 4096))
        except ValidationError as e:
            raise validation_error(e) from None
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


def add_forget_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/forget")
    async def forget_route(request: Request) -> dict:
        try:
            scope = ForgetBody.model_validate(await read_json(request, 4096)).scope()
        except ValidationError as e:
            raise validation_error(e) from None
        except ValueError as e:  # no scope or two, or a time that does not parse
            raise ApiError(400, str(e), code="invalid_value") from None
        return await forget(state.store, scope, state.capture)
