"""The wire as the extension sees it: the frames of /v1/feedback/ws and the /v1/status fields it reads.

`FeedbackEvent` (feedback.py) is what the daemon validates events with; the models here describe
the frames the daemon builds as plain dicts, and the part of the /v1/status reply the extension
reads. `wire_schema()` makes one JSON Schema of them all: scripts/wire_schema.py writes it to
extension/schema/wire.schema.json, from which the extension generates its TypeScript types, and
tests/test_wire_schema.py checks real frames against it. docs/protocol.md explains each frame.
"""

from __future__ import annotations

from typing import Literal, cast

from pydantic import BaseModel, ConfigDict, Field, RootModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, models_json_schema
from pydantic_core import core_schema

from .feedback import FeedbackEvent


class Frame(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- client -> daemon (besides FeedbackEvent)


class Auth(Frame):
    """The first frame of a client that cannot set an Authorization header on the socket."""
    type: Literal["auth"]
    api_key: str


class Ping(Frame):
    type: Literal["ping"]


class ClientFrame(RootModel[FeedbackEvent | Auth | Ping]):
    """What a client sends on /v1/feedback/ws (and a feedback event alone to POST /v1/feedback)."""


# ---------------------------------------------------------------- daemon -> client


class Hello(Frame):
    type: Literal["hello"]
    protocol: Literal[1]
    adapter_version: str | None = Field(description="null = base model")


class AuthOk(Frame):
    type: Literal["auth_ok"]


class Pong(Frame):
    type: Literal["pong"]
    ts: float


class Ack(Frame):
    """The event is committed: applied now, or already applied before (a resend)."""
    type: Literal["ack"]
    event_id: str
    status: Literal["applied", "duplicate"]
    call_id: str | None = Field(None, description="the call the event was applied to")


class ErrorFrame(Frame):
    """The event was not applied: an orphan (stored, do not resend) or not stored at all."""
    type: Literal["error"]
    code: Literal["malformed", "orphan", "unauthorized", "busy", "store_error"]
    message: str
    event_id: str | None = None
    reason: Literal["unknown_session", "unknown_target"] | None = Field(None, description="orphans only")
    stored: Literal[True] | None = Field(None, description="orphans only: the event is stored; do not resend")


class SampleReady(Frame):
    """A training sample with a non-zero signal was built for a call."""
    type: Literal["sample_ready"]
    call_id: str
    session_id: str
    reward: float = Field(ge=-1, le=1)
    reward_source: Literal["explicit", "outcome_event", "outcome_rule", "judge", "none"]
    outcome: str | None = Field(None, description="outcome_rule: the rule's name; outcome_event: the event's source")
    hint: bool = Field(description="the sample carries a hint (and teacher logprobs)")


class Trained(Frame):
    """A training step committed a new version."""
    type: Literal["trained"]
    version: str
    samples: int = Field(ge=1)
    mean_reward: float


class AdapterLive(Frame):
    """A hot-swap: this version serves now (null = the base model)."""
    type: Literal["adapter_live"]
    version: str | None


class AdapterRefused(Frame):
    """The candidate gate kept a new version from going live."""
    type: Literal["adapter_refused"]
    version: str
    reason: str


class AdapterRolledBack(Frame):
    """The live guard took a version down for replies that got worse; `to` serves now."""
    type: Literal["adapter_rolled_back"]
    version: str
    to: str | None = Field(description="null = base model")
    reason: str


DaemonFrameUnion = (Hello | AuthOk | Pong | Ack | ErrorFrame | SampleReady | Trained | AdapterLive | AdapterRefused
                    | AdapterRolledBack)


class DaemonFrame(RootModel[DaemonFrameUnion]):
    """What the daemon sends on /v1/feedback/ws: replies to the client's frames, and status pushes."""
    root: DaemonFrameUnion = Field(discriminator="type")


# ---------------------------------------------------------------- GET /v1/status (the fields the extension reads)


class StatusPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # the daemon reports more than the extension reads


class TrainStep(StatusPart):
    step: int
    version: int | None
    outcome: str = Field(description="committed | failed")
    samples: int


class StatusTraining(StatusPart):
    samples_ready: int
    batch_size: int
    last_step: TrainStep | None


class MemoryNote(BaseModel):
    note_id: int
    text: str
    active: bool = Field(description="injected while the live version serves")
    retired_by: int | None = Field(description="the version that made it redundant")


class StatusMemory(BaseModel):
    enabled: bool
    notes: list[MemoryNote]


class NewestVersion(BaseModel):
    version: int
    state: str
    reason: str | None


class StatusGate(StatusPart):
    reviewing: int | None = Field(description="the version under review")
    newest: NewestVersion | None = Field(description="the newest version's fate")


class DaemonStatus(StatusPart):
    """The reply to GET /v1/status."""
    adapter_version: str | None
    training: StatusTraining
    memory: StatusMemory
    gate: StatusGate


class _WireJsonSchema(GenerateJsonSchema):
    """Pydantic's schema, but an optional field (`x: T | None = None`) is one that may be absent:
    the daemon leaves it out rather than sending null, and the validator wants a T when it is there.
    Fields get no title: a title makes a named type of its own in the generated TypeScript."""

    def field_title_should_be_set(self, schema: object) -> bool:
        return False

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        inner = schema["schema"]
        if schema.get("default", ...) is None and inner["type"] == "nullable":
            return self.generate_inner(cast(core_schema.NullableSchema, inner)["schema"])
        return super().default_schema(schema)


def wire_schema() -> JsonSchemaValue:
    """One JSON Schema for the wire: client frames, daemon frames and the status reply, each in $defs."""
    roots: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (ClientFrame, "validation"), (DaemonFrame, "serialization"), (DaemonStatus, "serialization")]
    _, schema = models_json_schema(roots, ref_template="#/$defs/{model}", schema_generator=_WireJsonSchema)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Wire",
        "description": "clawback's wire (docs/protocol.md), emitted from the daemon's models by scripts/wire_schema.py.",
        "anyOf": [{"$ref": f"#/$defs/{model.__name__}"} for model, _ in roots],
        **schema,
    }
