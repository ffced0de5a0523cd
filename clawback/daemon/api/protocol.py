"""The JSON bodies of the daemon's own routes (chat completions' is clawback.chat.ChatRequest)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..forget import parse_time
from ..store import ForgetScope

NoteId = Annotated[int, Path(ge=1, le=2**63 - 1)]  # SQLite's integer range: a larger id is a 400, not an overflow


class NoteText(BaseModel):
    text: str = Field(min_length=1, max_length=64 * 1024)  # the note's new wording


class NoteScope(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    scope: Literal["general", "session"]
    # the conversation a session note belongs to; by default the session the note was learnt from
    session_id: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _session_only_for_session(self) -> NoteScope:
        if self.scope == "general" and self.session_id is not None:
            raise ValueError("a general note has no session_id")
        return self


class VersionBody(BaseModel):
    version: int | str  # N, "vN", or "base" (rollback)


class RollbackBody(VersionBody):
    force: bool = False  # also a refused, candidate or rolled-back-from (`retired`) version


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
