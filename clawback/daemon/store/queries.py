"""The reads behind the dashboard, the gate, the live guard, note retirement and the simulator,
each a typed method returning frozen records."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from clawback.records import Feedback, JsonObject, Version

from .reads import AdapterRow, Reads
from .schema import blob_ids, blob_logprobs, marks

# Feedback kinds the dashboard lists, and the ones that rate a reply.
LISTED_KINDS = ("thumbs_up", "thumbs_down", "correction", "comment", "outcome")
RATING_KINDS = ("thumbs_up", "thumbs_down", "correction")
# A call without a session id gets a session of its own, "anon-<id>"; the range selects them by index.
ANON = "session_id >= 'anon-' AND session_id < 'anon.'"


@dataclass(frozen=True)
class TrainStep:
    step: int
    version: int
    parent: int | None
    outcome: str
    samples: int
    error: str | None
    metrics: dict[str, float]  # the trainer's numbers as it reported them
    started_at: float
    finished_at: float


@dataclass(frozen=True)
class HealthPoint:
    """A healthy training step's loss and gradient norm: what the gate's running medians are of."""

    loss: float
    grad_norm: float


@dataclass(frozen=True)
class VersionFeedback:
    """Main calls a version served (None = base) and the ratings they got."""

    version: int | None
    calls: int
    thumbs_up: int
    thumbs_down: int
    corrections: int


@dataclass(frozen=True)
class FeedbackView:
    """A feedback event as the dashboard lists it, with what became of its call's sample."""

    event_id: str
    kind: str
    text: str | None
    source: str
    received_at: float
    state: str
    orphan_reason: str | None
    session_id: str
    response_text: str | None
    sample_state: str | None
    sample_reason: str | None
    hint: str | None
    correction: str | None
    reward: float | None
    reward_source: str | None
    outcome: str | None
    consumed_version: str | None
    consumed_step: int | None


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    state: str
    last_seen_at: float
    closed_reason: str | None
    main_calls: int | None  # None: no call
    calls: int
    feedback: int  # ratings of its calls


@dataclass(frozen=True)
class AnonymousCalls:
    """The calls without a session id, counted together."""

    calls: int
    last_at: float | None


@dataclass(frozen=True)
class SessionCall:
    """A main call of a conversation, with its next state, its sample and its feedback."""

    call_id: str
    created_at: float
    adapter_version: str | None
    state: str
    request: JsonObject  # the OpenAI request body
    response_text: str
    next_state: list[JsonObject]  # the messages that followed it
    sample_state: str | None
    sample_reason: str | None
    reward: float | None
    reward_source: str | None
    outcome: str | None
    feedback: tuple[Feedback, ...]


@dataclass(frozen=True)
class HeldOutCall:
    """A rated call the gate replays and never trains on."""

    call_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    reward: float | None  # the person's rating; None when the reward came from elsewhere
    # The hinted teacher's logprobs of the reply: the behaviour a correction asked for. None
    # without a hint, and where the notes were the hint (the teacher is then the serving version
    # in the served request, which a distance from would not be a step away from any correction).
    teacher_logprobs: list[float] | None


@dataclass(frozen=True)
class NotesCall:
    """A liked main call served with preference notes the person still has: what following them
    looked like."""

    call_id: str
    prompt_ids: list[int]  # as served, the notes in
    response_ids: list[int]
    request: JsonObject  # its messages and `memory_notes`, to render the prompt without them


@dataclass(frozen=True)
class CallPrompt:
    call_id: str
    prompt_ids: list[int]


@dataclass(frozen=True)
class ReplyFeedback:
    """Of a version's main replies in a window: how many, how many got a 👎 or a correction, and
    how many a tool or an outcome event said failed (a negative outcome reward)."""

    replies: int
    thumbs_down: int
    correction: int
    failed_outcome: int


@dataclass(frozen=True)
class NoteEvidence:
    """The call a preference note was learnt from: its request, its reply and the teacher's logprobs."""

    request: JsonObject
    response_ids: list[int]
    teacher_logprobs: list[float]


@dataclass(frozen=True)
class SampleCount:
    state: str
    reason: str  # "" when none
    samples: int


class Queries(Reads):
    # ---- training steps and versions ----

    def train_steps(self) -> list[TrainStep]:
        return self.read(lambda c: [TrainStep(
            step=r["step"], version=r["version"], parent=r["parent"], outcome=r["outcome"], samples=r["samples"],
            error=r["error"], metrics=json.loads(r["metrics"] or "{}"), started_at=r["started_at"],
            finished_at=r["finished_at"]) for r in c.execute("SELECT * FROM train_steps ORDER BY step")])

    def healthy_step_metrics(self, limit: int) -> list[HealthPoint]:
        """Loss and gradient norm of the newest `limit` committed steps whose version was not
        refused (those that reported both), oldest first."""
        rows = self.read(lambda c: c.execute(
            "SELECT t.metrics FROM train_steps t JOIN adapters a ON a.version = t.version "
            "WHERE t.outcome = 'committed' AND a.state != 'refused' ORDER BY t.step DESC LIMIT ?",
            (limit,)).fetchall())
        metrics = [json.loads(r[0]) for r in rows][::-1]
        return [HealthPoint(float(m["loss"]), float(m["grad_norm"])) for m in metrics if "loss" in m and "grad_norm" in m]

    def adapter_count(self) -> int:
        return self.read(lambda c: c.execute("SELECT count(*) FROM adapters").fetchone()[0])

    def adapter_page(self, offset: int, limit: int) -> list[AdapterRow]:
        """Versions newest first, `limit` from `offset`; the live one always."""
        return self.read(lambda c: [AdapterRow.of(r) for r in c.execute(
            "SELECT * FROM adapters WHERE version IN (SELECT version FROM adapters ORDER BY version DESC "
            "LIMIT ? OFFSET ?) OR state = 'live' ORDER BY version DESC", (limit, offset))])

    # ---- feedback and conversations ----

    def newest_main_call_at(self) -> float | None:
        # `+turn_type`: walk calls_created from the newest call, not every main call's row.
        return self.read(lambda c: c.execute("SELECT max(created_at) FROM calls WHERE +turn_type = 'main'").fetchone()[0])

    def feedback_per_version(self) -> list[VersionFeedback]:
        """For each version that served main calls: how many, and their applied ratings."""

        def q(c: sqlite3.Connection) -> list[VersionFeedback]:
            rated: dict[tuple[str | None, str], int] = {(r[0], r[1]): r[2] for r in c.execute(
                "SELECT c.adapter_version, f.kind, count(*) FROM feedback_events f JOIN calls c ON c.call_id = f.call_id "
                "WHERE f.state = 'applied' AND c.turn_type = 'main' GROUP BY c.adapter_version, f.kind")}
            return [VersionFeedback(Version.of(v), n, rated.get((v, "thumbs_up"), 0), rated.get((v, "thumbs_down"), 0),
                                    rated.get((v, "correction"), 0))
                    for v, n in c.execute("SELECT adapter_version, count(*) FROM calls WHERE turn_type = 'main' "
                                          "GROUP BY adapter_version")]

        return self.read(q)

    def feedback_count(self) -> int:
        return self.read(lambda c: c.execute(f"SELECT count(*) FROM feedback_events WHERE kind IN ({marks(LISTED_KINDS)})",
                                             LISTED_KINDS).fetchone()[0])

    def feedback_page(self, offset: int, limit: int) -> list[FeedbackView]:
        """Feedback events newest first, `limit` from `offset`."""
        return self.records(FeedbackView, (
            f"WITH recent AS (SELECT * FROM feedback_events WHERE kind IN ({marks(LISTED_KINDS)}) "
            "ORDER BY received_at DESC LIMIT ? OFFSET ?) "
            "SELECT f.event_id, f.kind, f.text, f.source, f.received_at, f.state, f.reason AS orphan_reason, "
            "f.session_id, c.response_text, s.state AS sample_state, s.reason AS sample_reason, s.hint, s.correction, "
            "s.reward, s.reward_source, s.outcome, s.consumed_version, t.step AS consumed_step FROM recent f "
            "LEFT JOIN calls c ON c.call_id = f.call_id LEFT JOIN samples s ON s.call_id = f.call_id "
            "LEFT JOIN train_steps t ON s.consumed_version = 'v' || t.version AND t.outcome = 'committed' "
            "ORDER BY f.received_at DESC"), (*LISTED_KINDS, limit, offset))

    def session_count(self) -> int:
        """Sessions with a name (calls without a session id are counted by `anonymous_calls`)."""
        return self.read(lambda c: c.execute(f"SELECT count(*) FROM sessions WHERE NOT ({ANON})").fetchone()[0])

    def session_page(self, offset: int, limit: int) -> list[SessionSummary]:
        """Named sessions, newest first, `limit` from `offset`."""
        return self.records(SessionSummary, (
            f"WITH recent AS (SELECT * FROM sessions WHERE NOT ({ANON}) ORDER BY last_seen_at DESC LIMIT ? OFFSET ?) "
            "SELECT s.session_id, s.state, s.last_seen_at, s.closed_reason, "
            "sum(c.turn_type = 'main') AS main_calls, count(c.call_id) AS calls, "
            "(SELECT count(*) FROM feedback_events f WHERE f.call_id IN "
            " (SELECT call_id FROM calls WHERE session_id = s.session_id) "
            f" AND f.kind IN ({marks(RATING_KINDS)})) AS feedback "
            "FROM recent s LEFT JOIN calls c USING (session_id) GROUP BY s.session_id "
            "ORDER BY s.last_seen_at DESC"), (limit, offset, *RATING_KINDS))

    def anonymous_calls(self) -> AnonymousCalls:
        n, last = self.read(lambda c: tuple(c.execute(f"SELECT count(*), max(created_at) FROM calls WHERE {ANON}").fetchone()))
        return AnonymousCalls(n, last)

    def session_calls(self, session_id: str) -> list[SessionCall]:
        """The session's main calls, oldest first."""

        def q(c: sqlite3.Connection) -> list[SessionCall]:
            out = []
            for r in c.execute(
                    "SELECT c.call_id, c.created_at, c.adapter_version, c.state, c.request_json, c.response_text, "
                    "n.messages_json, s.state AS sample_state, s.reason AS sample_reason, s.reward, s.reward_source, "
                    "s.outcome FROM calls c "
                    "LEFT JOIN next_states n USING (call_id) LEFT JOIN samples s USING (call_id) "
                    "WHERE c.session_id = ? AND c.turn_type = 'main' ORDER BY c.created_at", (session_id,)):
                feedback = c.execute("SELECT kind, text, received_at FROM feedback_events WHERE call_id = ? "
                                     "ORDER BY received_at", (r["call_id"],)).fetchall()
                out.append(SessionCall(
                    call_id=r["call_id"], created_at=r["created_at"], adapter_version=r["adapter_version"],
                    state=r["state"], request=json.loads(r["request_json"]), response_text=r["response_text"],
                    next_state=json.loads(r["messages_json"] or "[]"), sample_state=r["sample_state"],
                    sample_reason=r["sample_reason"], reward=r["reward"], reward_source=r["reward_source"],
                    outcome=r["outcome"], feedback=tuple(Feedback(*f) for f in feedback)))
            return out

        return self.read(q)

    # ---- the gate and the live guard ----

    def held_out_calls(self, limit: int) -> list[HeldOutCall]:
        """The newest `limit` held-out samples' calls."""
        return self.read(lambda c: [HeldOutCall(
            call_id=r["call_id"], prompt_ids=blob_ids(r["prompt_ids"]), response_ids=blob_ids(r["response_ids"]),
            reward=r["reward"] if r["reward_source"] == "explicit" else None,
            teacher_logprobs=None if r["teacher_logprobs"] is None else blob_logprobs(r["teacher_logprobs"]))
            for r in c.execute(
                "SELECT s.call_id, s.reward, s.reward_source, c.prompt_ids, c.response_ids, "
                "CASE WHEN s.hint_source = 'notes' THEN NULL ELSE s.teacher_logprobs END AS teacher_logprobs "
                "FROM samples s JOIN calls c USING (call_id) WHERE s.state = 'dropped' AND s.reason = 'held_out' "
                "ORDER BY s.updated_at DESC LIMIT ?", (limit,))])

    def liked_calls_with_notes(self, limit: int) -> list[NotesCall]:
        """The newest `limit` main calls the person liked that were served with notes, each of
        which is still a note (none since edited or forgotten), held out or not."""
        return self.read(lambda c: [NotesCall(r["call_id"], blob_ids(r["prompt_ids"]), blob_ids(r["response_ids"]),
                                              json.loads(r["request_json"])) for r in c.execute(
            "SELECT c.call_id, c.prompt_ids, c.response_ids, c.request_json FROM calls c JOIN samples s USING (call_id) "
            "WHERE c.turn_type = 'main' AND s.reward_source = 'explicit' AND s.reward > 0 "
            "AND json_array_length(c.request_json, '$.memory_notes') > 0 AND NOT EXISTS ("
            "SELECT 1 FROM json_each(c.request_json, '$.memory_notes') j "
            "WHERE j.value NOT IN (SELECT text FROM memory_notes)) "
            "ORDER BY c.created_at DESC LIMIT ?", (limit,))])

    def recent_sampled_prompts(self, limit: int) -> list[CallPrompt]:
        """The prompts of the newest `limit` main calls with a sample, newest first."""
        return self.read(lambda c: [CallPrompt(r["call_id"], blob_ids(r["prompt_ids"])) for r in c.execute(
            "SELECT c.call_id, c.prompt_ids FROM calls c JOIN samples s USING (call_id) WHERE c.turn_type = 'main' "
            "ORDER BY c.created_at DESC LIMIT ?", (limit,))])

    def offered_tools(self, call_ids: list[str]) -> dict[str, list[JsonObject]]:
        """The tools each call's request offered the model (none when its `tool_choice` was "none"),
        for the calls among `call_ids` that offered any."""
        if not call_ids:
            return {}
        return self.read(lambda c: {r[0]: json.loads(r[1]) for r in c.execute(
            f"SELECT call_id, json_extract(request_json, '$.tools') FROM calls WHERE call_id IN ({marks(call_ids)}) "
            "AND json_array_length(request_json, '$.tools') > 0 "
            "AND coalesce(json_extract(request_json, '$.tool_choice'), '') != 'none'", call_ids)})

    def reply_feedback(self, version: int | None, limit: int, newest: bool) -> ReplyFeedback:
        """Of the first (or, `newest`, the last) `limit` main replies `version` served (None = base):
        how many there are, how many got a 👎 and a correction applied, and how many a failed
        outcome rewarded below zero (a 👎 on the same reply overrides it: that is a 👎)."""

        def q(c: sqlite3.Connection) -> ReplyFeedback:
            where = "adapter_version IS NULL" if version is None else "adapter_version = ?"
            args = () if version is None else (Version(version).name,)
            call_ids = [r[0] for r in c.execute(
                f"SELECT call_id FROM calls WHERE turn_type = 'main' AND {where} "
                f"ORDER BY created_at {'DESC' if newest else 'ASC'} LIMIT ?", (*args, limit))]
            bad = dict[str, int]()
            if call_ids:
                bad = {kind: n for kind, n in c.execute(
                    f"SELECT kind, count(DISTINCT call_id) FROM feedback_events WHERE state = 'applied' "
                    f"AND kind IN ('thumbs_down', 'correction') AND call_id IN ({marks(call_ids)}) GROUP BY kind",
                    call_ids)}
                bad["failed_outcome"] = c.execute(
                    f"SELECT count(*) FROM samples WHERE reward < 0 AND reward_source IN ('outcome_rule', "
                    f"'outcome_event') AND call_id IN ({marks(call_ids)})", call_ids).fetchone()[0]
            return ReplyFeedback(len(call_ids), bad.get("thumbs_down", 0), bad.get("correction", 0),
                                 bad.get("failed_outcome", 0))

        return self.read(q)

    # ---- preference notes ----

    def note_evidence(self, call_id: str) -> NoteEvidence | None:
        """The call a note was learnt from, if its sample has the teacher's logprobs."""
        row = self.read(lambda c: c.execute(
            "SELECT c.request_json, c.response_ids, s.teacher_logprobs FROM calls c JOIN samples s USING (call_id) "
            "WHERE c.call_id = ? AND s.teacher_logprobs IS NOT NULL", (call_id,)).fetchone())
        if row is None:
            return None
        return NoteEvidence(json.loads(row["request_json"]), blob_ids(row["response_ids"]),
                            blob_logprobs(row["teacher_logprobs"]))

    def event_payloads(self, kind: str) -> list[tuple[str | None, JsonObject]]:
        """(subject, payload) of every event of `kind`, oldest first."""
        return self.read(lambda c: [(r[0], json.loads(r[1])) for r in c.execute(
            "SELECT subject_id, payload FROM events WHERE kind = ? ORDER BY id", (kind,))])

    # ---- samples ----

    def sample_counts(self) -> list[SampleCount]:
        return self.read(lambda c: [SampleCount(*r) for r in c.execute(
            "SELECT state, coalesce(reason, ''), count(*) FROM samples GROUP BY state, reason")])

    def loop_sample_count(self) -> int:
        """Samples trained against their repetition loop."""
        return self.read(lambda c: c.execute("SELECT count(*) FROM samples WHERE loop_from IS NOT NULL").fetchone()[0])
