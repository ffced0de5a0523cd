"""Reads: each on its own read-only connection, so they are safe from any thread."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from clawback.records import Feedback, JsonObject, Outcome, ReadySample, SampleInputs, Version

from .schema import MEMORY_NOTE_COLUMNS, blob_ids, blob_logprobs, blob_rows, connect, linked_sessions, marks


def _opt(decode: Callable[[bytes], list], blob: bytes | None) -> list | None:
    return None if blob is None else decode(blob)


@dataclass(frozen=True)
class AdapterRow:
    """An adapter version as the `adapters` table keeps it: its columns in their order, the JSON
    ones decoded (`asdict` of it is what the HTTP API shows)."""

    version: int
    parent: int | None
    path: str
    state: str  # one of ADAPTER_STATES
    reason: str | None  # why it was refused (kept when a person promotes it anyway)
    pinned: bool
    method: str
    samples: int
    metrics: dict[str, float]  # the trainer's numbers for the step that made it
    created_at: float
    live_at: float | None
    updated_at: float
    # What was checked, as written: the gate's report (gate.GateReport), the live guard's
    # comparison, a promotion by hand (`promoted_by_hand`, `overridden`); read back as stored.
    gate: JsonObject

    @classmethod
    def of(cls, r: sqlite3.Row) -> AdapterRow:
        return cls(**{**dict(r), "metrics": json.loads(r["metrics"]), "pinned": bool(r["pinned"]),
                      "gate": json.loads(r["gate"])})


@dataclass(frozen=True)
class MemoryNote:
    """A preference note as `memory_notes` reads it, for one version that serves."""

    note_id: int
    text: str
    topic: str | None
    source: str | None
    call_id: str | None  # the call whose correction taught it (None until that call is known)
    session_id: str | None  # None: general; else only that conversation gets it
    created_at: float
    updated_at: float
    retired_by: int | None  # the version that learnt it, so that it is no longer injected
    retired_at: float | None
    active: bool  # injected into main calls while the version asked about serves
    scope: str  # "general" | "session"


@dataclass(frozen=True)
class OpdCounts:
    """Of the samples with a teacher that train or trained (ready or consumed), how many distil
    the policy's top-K and how many only the sampled token, with the reasons of the latter."""

    top_k: int
    token_level: int
    token_level_reasons: dict[str, int]
    token_level_share: float | None  # None: no such samples


@dataclass(frozen=True)
class StoreCounts:
    """What the store holds, by state: `clawback status` and the dashboard's health."""

    calls: dict[str, int]  # "main/paired", "side/served", ...: turn type / state
    sessions: dict[str, int]
    events: int
    samples: dict[str, int]
    feedback: dict[str, int]
    dropped_samples: dict[str, int]  # why samples were not trained on
    opd: OpdCounts


T = TypeVar("T")


class Reads:
    db_path: Path

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = connect(self.db_path, readonly=True)
        try:
            return fn(conn)
        finally:
            conn.close()

    def records(self, record: Callable[..., T], sql: str, params: Sequence[object]) -> list[T]:
        """One record per row of `sql`, from the row's columns by name."""
        return self.read(lambda c: [record(**dict(r)) for r in c.execute(sql, params)])

    def last_awaiting_call(self, session_id: str) -> sqlite3.Row | None:
        """The session's main call still waiting for its next state, if any (state after a restart).

        Sessions linked into this one count too: the conversation continues under the new id."""

        def q(c: sqlite3.Connection) -> sqlite3.Row | None:
            sessions = linked_sessions(c, session_id)
            return c.execute(
                "SELECT call_id, response_text, tool_calls_json, request_json FROM calls "
                f"WHERE session_id IN ({marks(sessions)}) AND state = 'awaiting_next_state' "
                "ORDER BY created_at DESC LIMIT 1",
                sessions,
            ).fetchone()

        return self.read(q)

    def session_row(self, session_id: str) -> sqlite3.Row | None:
        return self.read(lambda c: c.execute("SELECT * FROM sessions WHERE session_id = ?", (session_id,)).fetchone())

    def stale_open_sessions(self, idle_before: float) -> list[str]:
        return self.read(
            lambda c: [
                r[0]
                for r in c.execute(
                    "SELECT session_id FROM sessions WHERE state = 'open' AND last_seen_at < ?", (idle_before,)
                )
            ]
        )

    def counts(self) -> StoreCounts:
        return self.read(counts)

    def pending_samples(self, limit: int = 32) -> list[tuple[str, int]]:
        return self.read(lambda c: [tuple(r) for r in c.execute(
            "SELECT call_id, revision FROM samples WHERE state = 'pending_judge' ORDER BY updated_at LIMIT ?",
            (limit,))])

    def ready_samples(self, limit: int) -> list[ReadySample]:
        """Ready samples, oldest first, with what the trainer needs (token ids, logprobs, reward)."""

        def q(c: sqlite3.Connection) -> list[ReadySample]:
            rows = c.execute(
                "SELECT s.call_id, s.reward, s.reward_source, s.correction, s.teacher_logprobs, s.teacher_top_logprobs, s.evidence_ids, "
                "s.evidence_logprobs, s.evidence_teacher_logprobs, s.evidence_prompt_ids, s.loop_from, s.loop_to, s.student_prompt_ids, s.student_logprobs, "
                "s.student_top_logprobs, c.prompt_ids, c.response_ids, "
                "c.behaviour_logprobs, c.sampling_logprobs, c.top_ids, c.top_logprobs, c.adapter_version "
                "FROM samples s JOIN calls c USING (call_id) "
                "WHERE s.state = 'ready' ORDER BY s.updated_at LIMIT ?", (limit,)).fetchall()
            out = []
            for r in rows:
                T = len(r["response_ids"]) // 4
                end = r["loop_to"]  # a loop sample trains the reply up to the end of the loop's first repeat
                sampling = _opt(blob_logprobs, r["sampling_logprobs"])
                prompt, behaviour, top_behaviour = r["prompt_ids"], r["behaviour_logprobs"], r["top_logprobs"]
                consolidated = r["student_prompt_ids"] is not None
                if consolidated:
                    # Consolidating notes: the reply trains in the request without them, against the
                    # serving version's logprobs there. No importance weight for the notes: the
                    # replies they led to are the states to teach, not a distribution to correct.
                    prompt, behaviour, top_behaviour = (r["student_prompt_ids"], r["student_logprobs"],
                                                        r["student_top_logprobs"])
                    sampling = None
                # Top-K OPD needs all three; without the teacher's view the sample is token-level.
                if r["teacher_top_logprobs"] is None or r["top_ids"] is None:
                    top_behaviour = None
                out.append(ReadySample(
                    call_id=r["call_id"], reward=r["reward"] or 0.0, adapter_version=Version.of(r["adapter_version"]),
                    reward_source=r["reward_source"], correction=r["correction"],
                    prompt_ids=blob_ids(prompt), response_ids=blob_ids(r["response_ids"])[:end],
                    behaviour_logprobs=blob_logprobs(behaviour)[:end],
                    teacher_logprobs=_opt(blob_logprobs, r["teacher_logprobs"]),
                    sampling_logprobs=None if sampling is None else sampling[:end],
                    top_ids=blob_rows(blob_ids, r["top_ids"], T) if top_behaviour is not None else None,
                    top_logprobs=blob_rows(blob_logprobs, top_behaviour, T) if top_behaviour is not None else None,
                    teacher_top_logprobs=(blob_rows(blob_logprobs, r["teacher_top_logprobs"], T)
                                          if top_behaviour is not None else None),
                    evidence_ids=_opt(blob_ids, r["evidence_ids"]),
                    evidence_logprobs=_opt(blob_logprobs, r["evidence_logprobs"]),
                    evidence_teacher_logprobs=_opt(blob_logprobs, r["evidence_teacher_logprobs"]),
                    evidence_prompt_ids=_opt(blob_ids, r["evidence_prompt_ids"]),
                    loop_from=r["loop_from"],
                    served_prompt_ids=blob_ids(r["prompt_ids"]) if consolidated else None,
                ))
            return out

        return self.read(q)

    def ready_count(self) -> int:
        return self.read(lambda c: c.execute("SELECT count(*) FROM samples WHERE state = 'ready'").fetchone()[0])

    def adapters(self) -> list[AdapterRow]:
        return self.read(lambda c: [AdapterRow.of(r) for r in c.execute("SELECT * FROM adapters ORDER BY version")])

    def base_was_live(self) -> bool:
        """Whether the last version sent live was the base model (a rollback to base)."""
        row = self.read(lambda c: c.execute(
            "SELECT subject_id FROM events WHERE kind = 'adapter.live' ORDER BY id DESC LIMIT 1").fetchone())
        return row is not None and row[0] is None

    def last_train_step(self) -> JsonObject | None:
        """The newest step's row, its metrics decoded, as `/v1/status` shows it."""
        r = self.read(lambda c: c.execute("SELECT * FROM train_steps ORDER BY step DESC LIMIT 1").fetchone())
        return None if r is None else {**dict(r), "metrics": json.loads(r["metrics"])}

    def sample_inputs(self, call_id: str) -> SampleInputs | None:
        """Everything the judge and the teacher need for one call, decoded."""

        def q(c: sqlite3.Connection) -> SampleInputs | None:
            sample = c.execute("SELECT revision, state FROM samples WHERE call_id = ?", (call_id,)).fetchone()
            call = c.execute("SELECT * FROM calls WHERE call_id = ?", (call_id,)).fetchone()
            if sample is None or call is None:
                return None
            nxt = c.execute("SELECT messages_json FROM next_states WHERE call_id = ?", (call_id,)).fetchone()
            feedback = c.execute(
                "SELECT kind, text, received_at FROM feedback_events WHERE call_id = ? AND state = 'applied' "
                "ORDER BY received_at, rowid", (call_id,)).fetchall()
            outcome = c.execute(
                "SELECT o.reward, o.raw_reward, f.source, f.text FROM outcome_rewards o JOIN feedback_events f "
                "USING (event_id) WHERE o.call_id = ? ORDER BY f.received_at DESC, f.rowid DESC LIMIT 1",
                (call_id,)).fetchone()
            return SampleInputs(
                call_id=call_id,
                revision=sample["revision"],
                state=sample["state"],
                session_id=call["session_id"],
                adapter_version=Version.of(call["adapter_version"]),
                request=json.loads(call["request_json"]),
                prompt_ids=blob_ids(call["prompt_ids"]),
                response_ids=blob_ids(call["response_ids"]),
                behaviour_logprobs=blob_logprobs(call["behaviour_logprobs"]),
                response_text=call["response_text"],
                tool_calls=json.loads(call["tool_calls_json"] or "null"),
                finish_reason=call["finish_reason"],
                top_ids=None if call["top_ids"] is None else blob_rows(
                    blob_ids, call["top_ids"], len(call["response_ids"]) // 4),
                next_state=json.loads(nxt[0]) if nxt else None,
                feedback=tuple(Feedback(f["kind"], f["text"], f["received_at"]) for f in feedback),
                # A failure's text is the hint; a success's says nothing the teacher could use.
                outcome=None if outcome is None else Outcome(
                    outcome["reward"], outcome["source"], outcome["text"] if outcome["raw_reward"] < 0 else None),
            )

        return self.read(q)

    def memory_notes(self, live: int | None = None) -> list[MemoryNote]:
        """The person's preference notes, least recently confirmed first (the order they are injected
        in: what the person asked for last sits nearest their message), each with `scope`
        ("general", or "session": only the conversation of `session_id` gets it) and `active`:
        whether main calls served by version `live` (None = the base model) get it. A
        retired note is inactive while `live` is the version that retired it or descends from it
        (the adapters' parent links); a rollback to anything else brings it back."""
        return self.read(lambda c: [MemoryNote(**{**dict(r), "active": bool(r["active"]),
                                                  "scope": "general" if r["session_id"] is None else "session"})
                                    for r in c.execute(
            "WITH RECURSIVE lineage(version) AS (SELECT ? WHERE ? IS NOT NULL UNION "
            "SELECT a.parent FROM adapters a JOIN lineage l ON a.version = l.version WHERE a.parent IS NOT NULL) "
            f"SELECT {', '.join(MEMORY_NOTE_COLUMNS)}, "
            "(retired_by IS NULL OR retired_by NOT IN (SELECT version FROM lineage)) AS active "
            "FROM memory_notes ORDER BY updated_at, note_id", (live, live))])


def counts(conn: sqlite3.Connection) -> StoreCounts:
    calls = {f"{r[0]}/{r[1]}": r[2] for r in conn.execute(
        "SELECT turn_type, state, count(*) FROM calls GROUP BY turn_type, state")}
    sessions = {r[0]: r[1] for r in conn.execute("SELECT state, count(*) FROM sessions GROUP BY state")}
    events = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    samples = {r[0]: r[1] for r in conn.execute("SELECT state, count(*) FROM samples GROUP BY state")}
    feedback = {r[0]: r[1] for r in conn.execute("SELECT state, count(*) FROM feedback_events GROUP BY state")}
    # Why samples were not trained on; a reason's detail after ': ' (an exception's text) is left out.
    dropped: dict[str, int] = {}
    for reason, n in conn.execute("SELECT reason, count(*) FROM samples WHERE state = 'dropped' GROUP BY reason"):
        key = (reason or "unknown").split(": ", 1)[0]
        dropped[key] = dropped.get(key, 0) + n
    return StoreCounts(calls, sessions, events, samples, feedback, dropped, opd_counts(conn))


def opd_counts(conn: sqlite3.Connection) -> OpdCounts:
    top_k, reasons = 0, dict[str, int]()
    for reason, n in conn.execute(
            "SELECT token_level_reason, count(*) FROM samples WHERE state IN ('ready', 'consumed') "
            "AND teacher_logprobs IS NOT NULL GROUP BY token_level_reason"):
        if reason is None:
            top_k += n
        else:
            key = reason.split(": ", 1)[0]
            reasons[key] = reasons.get(key, 0) + n
    token_level = sum(reasons.values())
    return OpdCounts(top_k, token_level, reasons, token_level / (top_k + token_level) if top_k + token_level else None)

