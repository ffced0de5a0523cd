"""The records that flow between the steps: request → store → judge → sample → trainer → adapter.

Frozen dataclasses, so a step cannot change what the step before it handed on, and Ray can ship
them to the trainer as they are. Token ids and logprobs are plain lists here; the store keeps
them as blobs (`clawback.daemon.store`).

An adapter version is a `Version`, an `int` (None = the base model), everywhere inside; `"v{N}"`
(`Version.name`, read back by `Version.parse`) is its name only where it leaves: the engine's
adapter names, the HTTP API and status pushes, and the TEXT columns that have always stored that name (`calls.adapter_version`, `samples.teacher_adapter`,
`samples.consumed_version`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeAlias, overload

from .replies import ToolCall

JsonObject: TypeAlias = dict[str, Any]
"""A JSON object whose shape is not clawback's to declare: an OpenAI request body, a message, a
tool's schema or call as the client sent them, or a file read back before it is checked. Data whose
shape clawback decides is a record (a frozen dataclass) or a TypedDict instead."""


class Version(int):
    """An adapter version: the int N inside, `"vN"` its name where it leaves (see the module's doc).

    An `int`, so it is stored, compared, sent through Ray and written as JSON as one. Where a version
    may be the base model, the value is `Version | None` (None = base)."""

    @classmethod
    def parse(cls, value: str | int) -> Version:
        """`3`, `"3"` or `"v3"` → 3; ValueError for anything else."""
        try:
            return cls(int(str(value).removeprefix("v")))
        except ValueError:
            raise ValueError(f"not an adapter version: {value!r}") from None

    @classmethod
    def of(cls, value: str | int | None) -> Version | None:
        """As `parse`, and None (or `"base"`) for the base model."""
        return None if value is None or value == "base" else cls.parse(value)

    @classmethod
    def match(cls, name: str) -> Version | None:
        """The version a `"vN"` name (a version's dir) names; None when it names none."""
        return cls(int(name[1:])) if name[:1] == "v" and name[1:].isdigit() else None

    @property
    def name(self) -> str:
        """`"v3"`: the name engines, the API and the store's TEXT columns use."""
        return f"v{int(self)}"

    @overload
    @staticmethod
    def name_of(version: int) -> str: ...
    @overload
    @staticmethod
    def name_of(version: None) -> None: ...
    @overload
    @staticmethod
    def name_of(version: int | None) -> str | None: ...
    @staticmethod
    def name_of(version: int | None) -> str | None:
        """`name`, with None for the base model."""
        return None if version is None else Version(version).name


@dataclass(frozen=True)
class Call:
    """One served call, exactly as sampled."""

    call_id: str
    session_id: str
    turn_id: str | None
    request_id: str
    turn_type: str  # main | side
    state: str  # served | awaiting_next_state
    created_at: float
    finished_at: float
    model: str
    adapter_version: int | None
    request: JsonObject  # the OpenAI request body as received
    prompt_text: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]  # temperature-1 logprobs of response_ids
    response_text: str
    tool_calls: list[ToolCall] | None
    finish_reason: str
    timings: dict[str, float] = field(default_factory=dict)
    # Logprob of each token under the distribution it was drawn from (temperature, top-p): the
    # importance-weight reference. None: greedy, or the engine cannot report it.
    sampling_logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None  # T x K: the policy's K most likely tokens per position
    top_logprobs: list[list[float]] | None = None  # T x K, temperature 1


@dataclass(frozen=True)
class Feedback:
    kind: str  # thumbs_up | thumbs_down | correction | comment
    text: str | None
    received_at: float


@dataclass(frozen=True)
class FeedbackRecord:
    """A feedback event as validated (daemon/feedback.py, docs/protocol.md): what the store applies."""

    event_id: str
    kind: str  # thumbs_up | thumbs_down | correction | comment | session_end | session_link | outcome
    session_id: str
    target: str | None = None  # turn id | request id | "last"
    text: str | None = None
    source: str = "unknown"
    ts: float | None = None
    from_: str | None = None  # session_link: the old session id ("from" on the wire)
    to: str | None = None
    reward: float | None = None  # outcome events: the reward, its credit, group and turns
    credit: str | None = None
    group: str | None = None
    turns: tuple[str, str] | None = None

    @classmethod
    def of(cls, wire: Mapping[str, Any]) -> FeedbackRecord:
        """From the event's JSON fields (Any: JSON values, checked by the validation before)."""
        given = {"from_" if k == "from" else k: v for k, v in wire.items()}
        if given.get("turns") is not None:
            given["turns"] = tuple(given["turns"])
        return cls(**given)

    def wire(self) -> dict[str, object]:
        """The event's JSON as received, without the fields it left out."""
        out = {"from" if f.name == "from_" else f.name: getattr(self, f.name) for f in fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class Outcome:
    """A reward that the result of a call's actions states, without a judge: read by an outcome
    rule from its tool results, or credited to it by an outcome event (docs/protocol.md)."""

    reward: float
    origin: str  # the rule's name, or the outcome event's source
    text: str | None = None  # what went wrong, for a failure: the hint for the OPD teacher


@dataclass(frozen=True)
class SampleInputs:
    """Everything the judge and the teacher need for one call's sample, read from the store."""

    call_id: str
    revision: int  # bumped by every new signal; a result for an older revision is not written
    state: str
    session_id: str
    adapter_version: int | None
    request: JsonObject
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    response_text: str
    next_state: list[JsonObject] | None
    feedback: tuple[Feedback, ...]
    tool_calls: list[JsonObject] | None = None
    finish_reason: str = "stop"
    top_ids: list[list[int]] | None = None  # recorded at serve time, for the teacher to score (top-K OPD)
    outcome: Outcome | None = None  # the newest outcome event's credit to this call


@dataclass(frozen=True)
class VoteRecord:
    """One judge vote, kept whatever became of the sample."""

    kind: Literal["prm", "hint"]
    backend: str
    prompt_version: str
    score: int | None  # None = a failed vote
    hint: str | None
    raw: str | None
    error: str | None


@dataclass(frozen=True)
class JudgedSample:
    """The sample pipeline's verdict on one sample: `ready` for training or `dropped(reason)`.

    Its fields other than `call_id`, `revision` and `votes` are the `samples` columns it sets."""

    call_id: str
    revision: int
    state: Literal["ready", "dropped"]
    reason: str | None = None
    method: str | None = None
    reward: float | None = None
    reward_source: str | None = None  # explicit | outcome_event | outcome_rule | judge | none
    outcome: str | None = None  # the outcome rule's name, or the outcome event's source
    judge_score: int | None = None
    hint: str | None = None
    hint_source: str | None = None  # correction | next_state | correction_raw | outcome | notes (no hint: the notes are it)
    correction: str | None = None
    teacher: str | None = None  # self | base
    teacher_adapter: int | None = None
    teacher_messages: list[JsonObject] | None = None
    teacher_prompt_ids: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    teacher_top_logprobs: list[list[float]] | None = None  # T x K: the teacher's logprobs of calls.top_ids
    # Why a sample with a teacher trains token-level OPD rather than top-K (None: top-K, or no teacher).
    token_level_reason: str | None = None
    # Positive evidence: the teacher's own reply under the hint, and the policy's logprobs of it
    # in the original context (the sample's prompt, no hint).
    evidence_ids: list[int] | None = None
    evidence_logprobs: list[float] | None = None
    evidence_teacher_logprobs: list[float] | None = None  # the teacher's, of its own reply under the hint
    # The context the evidence trains in where it is not the sample's (a disliked reply's
    # evidence, consolidated: the request without the notes); evidence_logprobs are scored there.
    evidence_prompt_ids: list[int] | None = None
    # Note consolidation: a reply served with preference notes trains under the request without
    # them (the rendered prompt) against the serving version's logprobs there, sampled token and
    # top-K, so the weights learn what the notes asked for. None = it trains as it was served.
    student_prompt_ids: list[int] | None = None
    student_logprobs: list[float] | None = None
    student_top_logprobs: list[list[float]] | None = None
    # A repetition loop: the response tokens [loop_from, loop_to) are its first repeat. The sample
    # trains the reply up to loop_to, penalising that repeat only (TrainConfig.loop_penalty).
    loop_from: int | None = None
    loop_to: int | None = None
    votes: tuple[VoteRecord, ...] = ()


@dataclass(frozen=True)
class ReadySample:
    """A sample the trainer can use; the shape `trainer.step.train_step` reads."""

    call_id: str
    reward: float
    adapter_version: int | None  # the version that served it (staleness)
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    teacher_logprobs: list[float] | None
    sampling_logprobs: list[float] | None = None  # the importance-weight reference (see Call)
    # Top-K OPD, T x K each: the policy's K most likely ids at serve time, their behaviour
    # (temperature-1) logprobs, and the teacher's logprobs of the same ids. All three or none.
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    evidence_ids: list[int] | None = None  # see JudgedSample
    evidence_logprobs: list[float] | None = None
    evidence_teacher_logprobs: list[float] | None = None
    evidence_prompt_ids: list[int] | None = None
    reward_source: str | None = None  # see JudgedSample
    correction: str | None = None  # the person's correction, if any
    # The prompt as it was served, where `prompt_ids` is another one (note consolidation): the
    # call's identity, e.g. for the gate's held-out share.
    served_prompt_ids: list[int] | None = None
    loop_from: int | None = None  # a loop sample (see JudgedSample): the response is cut at loop_to

    @property
    def distill(self) -> bool:
        """It trains in another context than its teacher's beyond the hint (TrainConfig.distill_weight)."""
        return self.served_prompt_ids is not None


@dataclass(frozen=True)
class TrainResult:
    """What the trainer worker returns for one step: the new version's files travel as bytes."""

    version: int
    parent: int | None
    node: str | None  # the Ray node it trained on (None outside Ray)
    metrics: dict[str, float]
    files: dict[str, bytes]


@dataclass(frozen=True)
class StepRecord:
    """One training step as the store records it (`train_steps`, and `adapters` when a version exists)."""

    version: int
    parent: int | None
    started_at: float
    method: str
    call_ids: tuple[str, ...]
    outcome: Literal["committed", "failed"]
    candidate: bool = False  # committed, and waiting for the gate before it may go live
    path: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
