"""Durable store: SQLite in WAL mode, versioned migrations, one background writer.

The serving path never touches the disk: each write is a typed method (`add_call`, `close_session`,
...) that puts it on a bounded queue; a writer thread applies them in order, many per transaction.
Writes whose caller must know the outcome (`apply_feedback`, `write_sample`, `record_step`, ...)
are awaited until committed. If the
queue is ever full the write is counted as dropped (with its kind) and the count is exposed in
/metrics and `clawback status`, and written to the event log once there is room again.

Every state change also appends a row to `events`, which triggers keep append-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, fields, replace
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

import numpy as np

from clawback.records import (Call, Feedback, JudgedSample, Outcome, ReadySample, SampleInputs, StepRecord, parse_version,
                              version_name)

from . import memory

log = logging.getLogger(__name__)

_STOP = object()


class StoreBusy(RuntimeError):
    pass


SIGNAL_KINDS = ("thumbs_up", "thumbs_down", "correction")  # feedback that changes a sample
STEP_EPS = 1e-6  # step credit: the z-score's (v - mean) / (std + STEP_EPS), as upstream's step-wise normalisation


def _marks(values: Any) -> str:
    return ", ".join("?" for _ in values)


def ids_blob(ids: list[int] | list[list[int]]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def logprobs_blob(logprobs: list[float] | list[list[float]]) -> bytes:
    return np.asarray(logprobs, dtype="<f4").tobytes()


def blob_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


def blob_logprobs(blob: bytes) -> list[float]:
    return np.frombuffer(blob, dtype="<f4").tolist()


def blob_rows(decode: Callable[[bytes], list], blob: bytes, rows: int) -> list[list]:
    """A T x K matrix stored row-major as one blob."""
    flat = decode(blob)
    k = len(flat) // rows if rows else 0
    return [flat[i * k:(i + 1) * k] for i in range(rows)]


def _opt(decode: Callable[[bytes], list], blob: bytes | None) -> list | None:
    return None if blob is None else decode(blob)


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) for every file in migrations/, in order."""
    found = []
    for f in resources.files("clawback.daemon").joinpath("migrations").iterdir():
        if f.name.endswith(".sql"):
            found.append((int(f.name.split("_", 1)[0]), f.name, f.read_text()))
    return sorted(found)


def connect(db_path: Path, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, check_same_thread=False)
    else:
        with contextlib.suppress(FileExistsError):  # private from the start; SQLite gives -wal/-shm the same mode
            os.close(os.open(db_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        conn = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # an acknowledged commit survives power loss
        conn.execute("PRAGMA secure_delete=ON")  # deleted rows are overwritten, not left in free pages
    conn.execute("PRAGMA busy_timeout=5000")
    conn.row_factory = sqlite3.Row
    return conn


def migrate(conn: sqlite3.Connection, upto: int | None = None) -> int:
    """Apply pending migrations (each in its own transaction); return the schema version."""
    current = conn.execute("PRAGMA user_version").fetchone()[0]
    for version, name, sql in migrations():
        if version <= current or (upto is not None and version > upto):
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _split_sql(sql):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={version}")
            conn.execute(
                "INSERT INTO events(ts, kind, subject_id, payload) VALUES (?, 'schema.migrated', ?, ?)",
                (time.time(), name, json.dumps({"version": version})),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        current = version
    return current


def _split_sql(sql: str) -> list[str]:
    """Split a migration into statements; trigger bodies keep their inner semicolons."""
    statements, buf = [], ""
    for line in sql.splitlines():
        if line.strip().startswith("--") and not buf:
            continue
        buf += line + "\n"
        if sqlite3.complete_statement(buf):
            statements.append(buf.strip())
            buf = ""
    if buf.strip():
        statements.append(buf.strip())
    return statements


# The columns each write sets, declared once; tests/daemon/test_store.py checks them against the
# migrations (every column exists, every NOT NULL column without a default is set).
CALL_COLUMNS = (
    "call_id", "session_id", "turn_id", "request_id", "turn_type", "state", "created_at", "finished_at", "model",
    "adapter_version", "request_json", "prompt_text", "prompt_ids", "response_ids", "behaviour_logprobs",
    "response_text", "tool_calls_json", "finish_reason", "timings_json", "sampling_logprobs", "top_ids",
    "top_logprobs")
NEXT_STATE_COLUMNS = ("call_id", "next_call_id", "messages_json", "roles", "reply_matched", "created_at")
FEEDBACK_COLUMNS = ("event_id", "kind", "session_id", "target", "text", "source", "ts", "received_at", "state",
                    "call_id", "reason", "payload")
OUTCOME_REWARD_COLUMNS = ("event_id", "call_id", "group_id", "step", "raw_reward", "reward")
VOTE_COLUMNS = ("call_id", "kind", "backend", "prompt_version", "score", "hint", "raw", "error", "created_at")
# What the sample pipeline sets on its sample: the verdict's fields, by name.
SAMPLE_VERDICT_COLUMNS = tuple(f.name for f in fields(JudgedSample) if f.name not in ("call_id", "revision", "votes"))
# The verdict's token ids and logprobs, as the blobs their columns hold.
SAMPLE_BLOBS: dict[str, Callable[[Any], bytes]] = {
    "teacher_prompt_ids": ids_blob, "teacher_logprobs": logprobs_blob, "teacher_top_logprobs": logprobs_blob,
    "evidence_ids": ids_blob, "evidence_logprobs": logprobs_blob, "student_prompt_ids": ids_blob,
    "student_logprobs": logprobs_blob, "student_top_logprobs": logprobs_blob}
TRAIN_STEP_COLUMNS = ("version", "parent", "started_at", "finished_at", "samples", "outcome", "error", "metrics")
ADAPTER_COLUMNS = ("version", "parent", "path", "state", "reason", "method", "samples", "metrics", "created_at",
                   "updated_at")
# A preference note as `memory_notes` returns it (with `active` for the version asked about).
MEMORY_NOTE_COLUMNS = ("note_id", "text", "topic", "source", "call_id", "session_id", "created_at", "updated_at",
                       "retired_by", "retired_at")
ADAPTER_STATES = ("committed", "candidate", "live", "retired", "refused", "failed", "pruned")

Reply = Callable[[Any, "BaseException | None"], None]
# The write kinds that can change which notes are active: the notes, and the adapters' lineage.
NOTE_WRITES = ("feedback", "memory_edit", "memory_scope", "memory_forget", "memory_retire", "forget", "train_step")


@dataclass(frozen=True)
class _Write:
    kind: str  # what a drop is counted as
    apply: Callable[[], Any]  # runs on the writer thread, inside a transaction
    reply: Reply | None = None  # gets (result, error) once committed


@dataclass(frozen=True)
class _Flush:
    done: threading.Event


class Store:
    def __init__(self, db_path: Path, queue_size: int = 10_000, memory_max_notes: int = 8) -> None:
        self.db_path = Path(db_path)
        self.memory_max_notes = memory_max_notes
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.db_path)
        self.schema_version = migrate(self._conn)
        self._queue: queue.Queue[_Write | _Flush | object] = queue.Queue(maxsize=queue_size)
        self.dropped: dict[str, int] = {}
        self._dropped_logged: dict[str, int] = {}
        self.written = 0
        self.listeners: list[Callable[[str, str], None]] = []  # called on the writer thread after commits
        self._notes: list[tuple[str, str]] = []
        self._scrub_wanted = False  # a forget deleted rows: rewrite the files once it is committed
        self._notes_version = 0  # bumped after a commit that may have changed the preference notes
        self._note_texts: tuple[int, int | None, list[tuple[str, str | None]]] | None = None
        self._thread = threading.Thread(target=self._write_loop, name="clawback-store", daemon=True)
        self._thread.start()

    # ---- writes from the serving path: queued, never block; False = dropped (counted) ----

    def add_call(self, call: Call) -> bool:
        return self._submit(_Write("call", partial(self._write_call, call)))

    def add_next_state(self, call_id: str, next_call_id: str, messages: list[dict[str, Any]], matched: bool,
                       ts: float) -> bool:
        """`next_call_id` brought `messages`, the next state of `call_id`; queues its sample."""
        return self._submit(_Write("next_state", partial(self._write_next_state, call_id, next_call_id, messages,
                                                         matched, ts)))

    def close_call(self, call_id: str, reason: str) -> bool:
        return self._submit(_Write("close_call", partial(self._set_call_state, call_id, "closed_without_next_state",
                                                         {"reason": reason})))

    def close_session(self, session_id: str, reason: str, ts: float) -> bool:
        return self._submit(_Write("close_session", partial(self._write_close_session, session_id, reason, ts)))

    def reopen_session(self, session_id: str, ts: float) -> bool:
        return self._submit(_Write("reopen_session", partial(self._write_reopen_session, session_id, ts)))

    def add_event(self, kind: str, subject: str | None, payload: dict[str, Any]) -> bool:
        return self._submit(_Write("event", partial(self._event, kind, subject, payload)))

    # ---- writes that are awaited until committed; StoreBusy when the queue is full ----

    async def apply_feedback(self, event: dict[str, Any], received_at: float) -> dict[str, Any]:
        """Apply one feedback event (the validated wire record) exactly once; what happened, for the ack."""
        return await self._commit(_Write("feedback", partial(self._write_feedback, event, received_at)))

    async def write_sample(self, sample: JudgedSample) -> bool:
        """Store a judged sample; False when a newer signal re-queued it meanwhile (it is judged again)."""
        return await self._commit(_Write("sample", partial(self._write_sample, sample)))

    async def drop_samples(self, call_ids: Sequence[str], reason: str, state: str = "dropped") -> None:
        """Take ready samples out of training, with the reason: `dropped` (of no use), or
        `quarantined` (training on them failed; a new signal on the call queues it again)."""
        await self._commit(_Write("drop_samples", partial(self._write_drop_samples, list(call_ids), reason, state)))

    async def committed(self) -> None:
        """Returns once every write queued before this call is committed."""
        await self._commit(_Write("barrier", lambda: None))

    async def forget(self, scope: ForgetScope) -> dict[str, Any]:
        """Delete what was stored about the sessions in `scope` (calls, next states, feedback, votes,
        samples, the preference notes learned from them, links, the sessions) and rewrite the database files so that none of it remains in
        them; the event log keeps a tombstone with counts only. Returns the counts, the forgotten
        session ids and the adapter versions trained on the forgotten samples."""
        return await self._commit(_Write("forget", partial(self._write_forget, scope)))

    async def record_step(self, step: StepRecord) -> int:
        """Record a training step; a committed one also records its adapter version and marks its
        samples consumed, in one transaction (so a crash never leaves half of that). Returns the
        number of samples consumed."""
        return await self._commit(_Write("train_step", partial(self._write_train_step, step)))

    async def set_live(self, version: int | None) -> None:
        """`version` (None = base) serves now; the version live before leaves (see _write_adapter_live)."""
        await self._commit(_Write("adapter_live", partial(self._write_adapter_live, version)))

    async def update_adapter(self, version: int, *, pinned: bool | None = None, state: str | None = None,
                             reason: str | None = None, gate: dict[str, Any] | None = None) -> None:
        changes: dict[str, Any] = {}
        if pinned is not None:
            changes["pinned"] = int(pinned)
        if reason is not None:
            changes["reason"] = reason
        if gate is not None:  # the gate's report (gate.py)
            changes["gate"] = json.dumps(gate, default=str)
        if state is not None:
            if state not in ADAPTER_STATES:
                raise ValueError(f"unknown adapter state {state!r}")
            changes["state"] = state
        await self._commit(_Write("adapter_update", partial(self._write_adapter_update, version, changes)))

    async def edit_note(self, note_id: int, text: str) -> bool:
        """Replace a preference note's text (False: no such note)."""
        return await self._commit(_Write("memory_edit", partial(self._write_note_edit, note_id, text)))

    async def scope_note(self, note_id: int, scope: str, session_id: str | None = None) -> str | None:
        """Make a note general (`scope` "general") or about one conversation's task ("session":
        `session_id`, by default the session it was learnt from). None when done, else why not."""
        return await self._commit(_Write("memory_scope", partial(self._write_note_scope, note_id, scope, session_id)))

    async def retire_note(self, note_id: int, updated_at: float, version: int, report: dict[str, Any]) -> bool:
        """Retire a note as checked against `version` (`report`: the check's numbers, for the
        event); False if it changed since (edited, confirmed again by a new correction) or is gone."""
        return await self._commit(_Write("memory_retire", partial(self._write_retire_note, note_id, updated_at,
                                                                  version, report)))

    async def forget_notes(self, note_id: int | None = None) -> int:
        """Delete one preference note, or all of them (None); returns how many went."""
        return await self._commit(_Write("memory_forget", partial(self._write_forget_notes, note_id)))

    def _submit(self, write: _Write) -> bool:
        try:
            self._queue.put_nowait(write)
            return True
        except queue.Full:
            self.dropped[write.kind] = self.dropped.get(write.kind, 0) + 1
            log.error("store queue full: dropped a %s write (%d so far)", write.kind, self.dropped[write.kind])
            return False

    async def _commit(self, write: _Write) -> Any:
        """Queue a write and wait until it is committed; returns its result.

        For writes that are acknowledged to a client (feedback events) or that the caller must know
        landed: raises StoreBusy instead of dropping when the queue is full, so the client keeps
        the event and sends it again.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def reply(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if not fut.done():
                    fut.set_exception(error) if error is not None else fut.set_result(result)

            loop.call_soon_threadsafe(settle)

        try:
            self._queue.put_nowait(replace(write, reply=reply))
        except queue.Full:
            raise StoreBusy("the store is busy; send the event again") from None
        return await fut

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 30.0) -> None:
        """Block until everything submitted so far is committed (tests, shutdown, export)."""
        done = threading.Event()
        self._queue.put(_Flush(done), timeout=timeout)
        if not done.wait(timeout):
            raise TimeoutError("store writer did not drain in time")

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(60)
        self._conn.close()

    # ---- writer thread ----

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._apply([w for w in batch if isinstance(w, _Write)])
            for item in batch:
                if isinstance(item, _Flush):
                    item.done.set()
            if any(item is _STOP for item in batch):
                return

    def _apply(self, writes: list[_Write]) -> None:
        if not writes and self.dropped == self._dropped_logged:
            return
        self._notes = []
        outcomes: list[tuple[Any, BaseException | None]]
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            results = [w.apply() for w in writes]
            self._log_drops()
            self._conn.execute("COMMIT")
            self.written += len(writes)
            outcomes = [(r, None) for r in results]
        except Exception:
            log.exception("store batch failed; retrying its writes one by one")
            self._rollback()
            self._notes = []
            outcomes = []
            for w in writes:  # isolate the bad write so the others still land
                n_notes = len(self._notes)
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                    result = w.apply()
                    self._conn.execute("COMMIT")
                    self.written += 1
                    outcomes.append((result, None))
                except Exception as e:
                    self._rollback()
                    del self._notes[n_notes:]
                    self.dropped[f"{w.kind}:error"] = self.dropped.get(f"{w.kind}:error", 0) + 1
                    log.error("store write %s failed and was dropped: %s", w.kind, e)
                    outcomes.append((None, e))
        if any(w.kind in NOTE_WRITES for w in writes):  # after the commit: see note_texts
            self._notes_version += 1
        if self._scrub_wanted:
            self._scrub_wanted = False
            self._scrub()
        for w, (result, error) in zip(writes, outcomes):
            if w.reply is not None:
                w.reply(result, error)
        for note in self._notes:
            for listener in self.listeners:
                try:
                    listener(*note)
                except Exception:
                    log.exception("store listener failed")

    def _notify(self, kind: str, subject: str) -> None:
        """Tell listeners (after the commit) that something they may act on happened."""
        self._notes.append((kind, subject))

    def _rollback(self) -> None:
        # A BEGIN that failed (database locked past busy_timeout) leaves no transaction open, and
        # a bare ROLLBACK would then raise and kill the writer thread.
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _log_drops(self) -> None:
        if self.dropped != self._dropped_logged:
            self._event("store.dropped", None, {"dropped_total": dict(self.dropped)})
            self._dropped_logged = dict(self.dropped)

    def _insert(self, table: str, columns: tuple[str, ...], row: dict[str, Any], or_ignore: bool = False) -> None:
        """INSERT the named columns; `row` must give exactly these (a missing or extra one is a bug)."""
        if set(row) != set(columns):
            raise ValueError(f"{table}: expected columns {sorted(columns)}, got {sorted(row)}")
        self._conn.execute(
            f"INSERT {'OR IGNORE ' if or_ignore else ''}INTO {table} ({', '.join(columns)}) VALUES ({_marks(columns)})",
            [row[c] for c in columns])

    def _event(self, kind: str, subject: str | None, payload: dict[str, Any] | None = None) -> None:
        self._conn.execute(
            "INSERT INTO events(ts, kind, subject_id, payload) VALUES (?, ?, ?, ?)",
            (time.time(), kind, subject, json.dumps(payload or {})),
        )

    def _write_call(self, c: Call) -> None:
        self._conn.execute(
            "INSERT INTO sessions(session_id, created_at, last_seen_at) VALUES (?, ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET last_seen_at = max(last_seen_at, excluded.last_seen_at)",
            (c.session_id, c.created_at, c.finished_at),
        )
        self._insert("calls", CALL_COLUMNS, {
            "call_id": c.call_id, "session_id": c.session_id, "turn_id": c.turn_id, "request_id": c.request_id,
            "turn_type": c.turn_type, "state": c.state, "created_at": c.created_at, "finished_at": c.finished_at,
            "model": c.model, "adapter_version": version_name(c.adapter_version),
            "request_json": json.dumps(c.request, ensure_ascii=False), "prompt_text": c.prompt_text,
            "prompt_ids": ids_blob(c.prompt_ids), "response_ids": ids_blob(c.response_ids),
            "behaviour_logprobs": logprobs_blob(c.behaviour_logprobs), "response_text": c.response_text,
            "tool_calls_json": json.dumps(c.tool_calls) if c.tool_calls else None,
            "finish_reason": c.finish_reason, "timings_json": json.dumps(c.timings),
            "sampling_logprobs": None if c.sampling_logprobs is None else logprobs_blob(c.sampling_logprobs),
            "top_ids": ids_blob(c.top_ids) if c.top_ids else None,
            "top_logprobs": logprobs_blob(c.top_logprobs) if c.top_logprobs else None})
        self._event(f"call.{c.state}", c.call_id, {"turn_type": c.turn_type})  # no session: events outlive a forget
        if c.turn_type == "main":
            self._resolve_orphans(c)

    def _write_next_state(self, call_id: str, next_call_id: str, messages: list[dict[str, Any]], matched: bool,
                          ts: float) -> None:
        roles = ",".join(m.get("role", "?") for m in messages)
        self._insert("next_states", NEXT_STATE_COLUMNS, {
            "call_id": call_id, "next_call_id": next_call_id, "messages_json": json.dumps(messages, ensure_ascii=False),
            "roles": roles, "reply_matched": int(matched), "created_at": ts})
        self._set_call_state(call_id, "paired", {"next_call_id": next_call_id, "roles": roles})
        self._want_sample(call_id, "next_state")

    def _set_call_state(self, call_id: str, state: str, payload: dict[str, Any]) -> None:
        cur = self._conn.execute(
            "UPDATE calls SET state = ? WHERE call_id = ? AND state = 'awaiting_next_state'", (state, call_id)
        )
        if cur.rowcount != 1:
            raise ValueError(f"call {call_id} is not awaiting a next state")
        self._event(f"call.{state}", call_id, payload)

    def _write_close_session(self, session_id: str, reason: str, ts: float) -> None:
        sessions = self._linked_sessions(session_id)  # a linked-in session's waiting call ends here too
        waiting = self._conn.execute(
            f"SELECT call_id FROM calls WHERE session_id IN ({_marks(sessions)}) AND state = 'awaiting_next_state'",
            sessions,
        ).fetchall()
        for (call_id,) in waiting:
            self._set_call_state(call_id, "closed_without_next_state", {"reason": reason})
        self._conn.execute(
            "UPDATE sessions SET state = 'closed', closed_at = ?, closed_reason = ? WHERE session_id = ?",
            (ts, reason, session_id),
        )
        self._event("session.closed", None, {"reason": reason})

    def _write_reopen_session(self, session_id: str, ts: float) -> None:
        self._conn.execute(
            "UPDATE sessions SET state = 'open', closed_at = NULL, closed_reason = NULL, last_seen_at = ? "
            "WHERE session_id = ?",
            (ts, session_id),
        )
        self._event("session.reopened", None, {})

    # ---- signals: feedback events, samples, votes ----

    def _write_feedback(self, ev: dict[str, Any], received_at: float) -> dict[str, Any]:
        row = self._conn.execute(
            "SELECT state, call_id, reason FROM feedback_events WHERE event_id = ?", (ev["event_id"],)
        ).fetchone()
        if row is not None:
            return {"status": "duplicate", "state": row[0], "call_id": row[1], "reason": row[2]}
        kind, sid = ev["kind"], ev["session_id"]
        sessions = self._linked_sessions(sid)
        known = self._conn.execute(
            f"SELECT count(*) FROM sessions WHERE session_id IN ({_marks(sessions)})", sessions
        ).fetchone()[0] > 0
        call_id = reason = None
        if kind == "session_link":
            self._conn.execute("INSERT OR IGNORE INTO session_links VALUES (?, ?, ?)", (ev["from"], ev["to"], received_at))
            # The old id is done, but its waiting call now waits under the new id: close the
            # session without closing that call.
            self._conn.execute(
                "UPDATE sessions SET state = 'closed', closed_at = ?, closed_reason = 'linked' "
                "WHERE session_id = ? AND state = 'open'", (received_at, ev["from"]))
            self._event("session.linked", None, {})
            if not self._session_known(ev["from"]):
                reason = "unknown_session"
        elif not known:
            reason = "unknown_session"
        elif kind == "session_end":
            self._write_close_session(sid, "session_end", received_at)
        elif kind == "outcome":
            call_id, reason = self._write_outcome(ev, sessions)
        else:
            call_id = self._resolve_target(sessions, ev.get("target") or "last")
            if call_id is None:
                reason = "unknown_target"
        state = "orphan" if reason else "applied"
        self._insert("feedback_events", FEEDBACK_COLUMNS, {
            "event_id": ev["event_id"], "kind": kind, "session_id": sid, "target": ev.get("target"),
            "text": ev.get("text"), "source": ev.get("source") or "unknown", "ts": ev.get("ts"),
            "received_at": received_at, "state": state, "call_id": call_id, "reason": reason,
            "payload": json.dumps(ev, ensure_ascii=False)})
        self._event(f"feedback.{state}", ev["event_id"], {"kind": kind, "call_id": call_id, "reason": reason})
        if kind in ("correction", "thumbs_down") and (ev.get("text") or "").strip():
            self._remember(ev["text"], kind, call_id, sid, received_at, ev["event_id"])
        if call_id is not None and kind in SIGNAL_KINDS:
            self._want_sample(call_id, kind)
        return {"status": state, "call_id": call_id, "reason": reason}

    def _trajectory(self, sessions: list[str], ev: dict[str, Any]) -> list[str]:
        """The main calls an outcome event rates, oldest first: one call (`target`, a request id
        or "last"), one turn (`target`, a turn id), the turns from `turns[0]` to `turns[1]`, or the whole
        session (with the sessions linked to it)."""
        where = f"session_id IN ({_marks(sessions)}) AND turn_type = 'main'"
        calls = self._conn.execute(f"SELECT call_id, request_id, turn_id FROM calls WHERE {where} "
                                   "ORDER BY created_at, rowid", sessions).fetchall()
        if ev.get("target") == "last":
            return [c for c, _, _ in calls[-1:]]
        if ev.get("target"):
            one = [c for c, request_id, _ in calls if request_id == ev["target"]]
            return one[-1:] or [c for c, _, turn_id in calls if turn_id == ev["target"]]
        if ev.get("turns"):
            first, last = ev["turns"]
            starts = [i for i, (_, _, turn_id) in enumerate(calls) if turn_id == first]
            ends = [i for i, (_, _, turn_id) in enumerate(calls) if turn_id == last]
            if not starts or not ends or ends[-1] < starts[0]:
                return []
            return [c for c, _, _ in calls[starts[0]:ends[-1] + 1]]
        return [c for c, _, _ in calls]

    def _write_outcome(self, ev: dict[str, Any], sessions: list[str]) -> tuple[str | None, str | None]:
        """Credit an outcome event's reward to the main calls of the trajectory it rates (docs/
        protocol.md, "Credit assignment"): (the last of them, None), or (None, why not)."""
        trajectory = self._trajectory(sessions, ev)
        if not trajectory:
            return None, "unknown_target"
        credited = list(enumerate(trajectory))
        if ev["credit"] == "last":
            credited = credited[-1:]
        group = ev.get("group") if ev["credit"] == "step" else None
        for step, call_id in credited:
            self._insert("outcome_rewards", OUTCOME_REWARD_COLUMNS, {
                "event_id": ev["event_id"], "call_id": call_id, "group_id": group, "step": step,
                "raw_reward": ev["reward"], "reward": ev["reward"]})
        changed = {call_id for _, call_id in credited}
        if group is not None:
            changed |= self._normalise_steps(group)
        for call_id in sorted(changed):
            self._want_sample(call_id, "outcome")
        return trajectory[-1], None

    def _normalise_steps(self, group: str) -> set[str]:
        """Step credit: each call's reward is its event's reward z-scored among the group's calls
        at the same step index, clipped to [-1, 1]; a step only one trajectory reached keeps the
        raw reward, and a step where every trajectory got the same reward gets 0. Returns the
        calls whose reward changed."""
        rows = self._conn.execute("SELECT event_id, call_id, step, raw_reward, reward FROM outcome_rewards "
                                  "WHERE group_id = ?", (group,)).fetchall()
        by_step: dict[int, list[sqlite3.Row]] = {}
        for r in rows:
            by_step.setdefault(r["step"], []).append(r)
        changed = set()
        for bucket in by_step.values():
            raw = np.array([r["raw_reward"] for r in bucket], dtype=np.float64)
            if len(raw) == 1:
                new = raw
            elif raw.var() <= 1e-12:
                new = np.zeros_like(raw)
            else:
                new = np.clip((raw - raw.mean()) / (raw.std() + STEP_EPS), -1.0, 1.0)
            for r, value in zip(bucket, new.tolist()):
                if value != r["reward"]:
                    self._conn.execute("UPDATE outcome_rewards SET reward = ? WHERE event_id = ? AND call_id = ?",
                                       (value, r["event_id"], r["call_id"]))
                    changed.add(r["call_id"])
        return changed

    # ---- preference notes (daemon/memory.py) ----

    def _remember(self, text: str, source: str, call_id: str | None, session_id: str, now: float,
                  event_id: str) -> None:
        notes, skipped = memory.notes_from(text)
        for i, note in enumerate(notes):  # a microsecond apart: the notes keep the person's sentence order
            scope = session_id if memory.scope(note) == "session" else None
            note_id = self._put_note(note, source, call_id, now + i * 1e-6, scope, event_id)
            self._conn.execute("INSERT OR IGNORE INTO note_sources VALUES (?, ?)", (note_id, session_id))
        for reason, count in skipped.items():  # content-free: the event table outlives a forget
            self._event("memory.skipped", call_id, {"source": source, "sentences": count, "reason": reason})
        self._bound_notes()

    def _bound_notes(self) -> None:
        """At most `memory_max_notes` general notes, and as many for each conversation: the least
        recently confirmed go first."""
        self._conn.execute(
            "DELETE FROM memory_notes WHERE note_id IN (SELECT note_id FROM (SELECT note_id, row_number() OVER "
            "(PARTITION BY session_id ORDER BY updated_at DESC, note_id DESC) AS n FROM memory_notes) WHERE n > ?)",
            (self.memory_max_notes,))

    def _put_note(self, text: str, source: str, call_id: str | None, now: float, session_id: str | None = None,
                  event_id: str | None = None, replace_id: int | None = None) -> int:
        """Insert a note in its scope (`session_id`; None: general); one of that scope on the same
        topic is replaced (newest wins), and so is one whose topic the new note's covers and goes
        beyond ("Please start with 'Sure!' and show the work." covers "Please start with
        'Sure!'."): the same request twice in one prompt makes a small model repeat it. For that
        reason a new note that repeats part of an older one in its words only confirms the older
        one. Returns its id."""
        t = memory.topic(text)
        words = set(t.split())
        notes = self._conn.execute("SELECT note_id, topic, text FROM memory_notes WHERE session_id IS ?",
                                   (session_id,)).fetchall()
        if replace_id is None:
            for old_id, old_topic, old_text in notes:
                if words < set(old_topic.split()) and memory.repeats(text, old_text):
                    self._conn.execute("UPDATE memory_notes SET updated_at = ?, retired_by = NULL, retired_at = NULL "
                                       "WHERE note_id = ?", (now, old_id))
                    self._event("memory.confirmed", str(old_id), {"source": source, "call_id": call_id,
                                                                   "reason": "repeats part of this note"})
                    return old_id
        for old_id, old_topic, _ in notes:
            if old_id != replace_id and set(old_topic.split()) < words:
                self._conn.execute("DELETE FROM memory_notes WHERE note_id = ?", (old_id,))
                self._event("memory.subsumed", str(old_id), {"source": source, "reason": "covered by a newer note"})
        if replace_id is not None:  # an edit: its new topic may now collide with another note
            self._conn.execute("DELETE FROM memory_notes WHERE topic = ? AND session_id IS ? AND note_id != ?",
                               (t, session_id, replace_id))
            self._conn.execute("UPDATE memory_notes SET text = ?, topic = ?, source = ?, updated_at = ?, "
                               "retired_by = NULL, retired_at = NULL WHERE note_id = ?", (text, t, source, now, replace_id))
            note_id = replace_id
        else:
            note_id = self._conn.execute(
                "INSERT INTO memory_notes(text, topic, source, call_id, session_id, event_id, created_at, updated_at) "
                "VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(topic, coalesce(session_id, '')) DO UPDATE SET "
                "text = excluded.text, source = excluded.source, call_id = excluded.call_id, "
                "event_id = excluded.event_id, updated_at = excluded.updated_at, retired_by = NULL, retired_at = NULL "
                "RETURNING note_id",
                (text, t, source, call_id, session_id, event_id, now, now)).fetchone()[0]
        self._event("memory.noted", str(note_id), {"source": source, "call_id": call_id})
        return note_id

    def _write_note_edit(self, note_id: int, text: str) -> bool:
        row = self._conn.execute("SELECT session_id FROM memory_notes WHERE note_id = ?", (note_id,)).fetchone()
        if row is None:
            return False
        self._put_note(" ".join(text.split())[: memory.MAX_NOTE_CHARS], "edit", None, time.time(), row[0],
                       replace_id=note_id)
        return True

    def _write_note_scope(self, note_id: int, scope: str, session_id: str | None) -> str | None:
        c = self._conn
        row = c.execute("SELECT n.topic, c.session_id FROM memory_notes n LEFT JOIN calls c USING (call_id) "
                        "WHERE n.note_id = ?", (note_id,)).fetchone()
        if row is None:
            return f"no memory note {note_id}"
        sources = [r[0] for r in c.execute("SELECT session_id FROM note_sources WHERE note_id = ?", (note_id,))]
        if scope == "general":
            session_id = None
        elif session_id is None:  # the session it was learnt from, when that is one session
            session_id = row[1] or (sources[0] if len(sources) == 1 else None)
            if session_id is None:
                return f"memory note {note_id} was asked for in {len(sources)} sessions: name one"
        elif session_id not in sources and not self._session_known(session_id):
            return f"no session {session_id!r}"
        # The person just acted on it: it takes its topic's place in its new scope and counts as
        # confirmed now, as an edit does (else a widened note could be the first the bound drops).
        for (other,) in c.execute("SELECT note_id FROM memory_notes WHERE topic = ? AND session_id IS ? AND note_id != ?",
                                  (row[0], session_id, note_id)).fetchall():  # whoever asked for that one asks for this
            c.execute("INSERT OR IGNORE INTO note_sources SELECT ?, session_id FROM note_sources WHERE note_id = ?",
                      (note_id, other))
            c.execute("DELETE FROM memory_notes WHERE note_id = ?", (other,))
        c.execute("UPDATE memory_notes SET session_id = ?, updated_at = ? WHERE note_id = ?",
                  (session_id, time.time(), note_id))
        self._bound_notes()
        self._event("memory.scoped", str(note_id), {"scope": scope})  # never the session: events outlive a forget
        return None

    def _write_retire_note(self, note_id: int, updated_at: float, version: int, report: dict[str, Any]) -> bool:
        done = self._conn.execute(
            "UPDATE memory_notes SET retired_by = ?, retired_at = ? WHERE note_id = ? AND updated_at = ? "
            "AND retired_by IS NULL", (version, time.time(), note_id, updated_at)).rowcount == 1
        if done:  # the numbers, never the note's text: the event table outlives a forget
            self._event("memory.retired", str(note_id), report)
        return done

    def _write_forget_notes(self, note_id: int | None) -> int:
        """Delete one note, or every note (None); returns how many went."""
        if note_id is None:
            n = self._conn.execute("DELETE FROM memory_notes").rowcount
        else:
            n = self._conn.execute("DELETE FROM memory_notes WHERE note_id = ?", (note_id,)).rowcount
        self._event("memory.forgotten", None if note_id is None else str(note_id), {"notes": n})
        return n

    async def note_texts(self, live: int | None, session_id: str) -> list[str]:
        """The texts of the preference notes a main call of `session_id` gets under version `live`
        (the general ones and those of its conversation, active), in `memory_notes` order: read
        off the event loop once, then kept until a commit may have changed them or another version
        serves (every main call gets them; most find them unchanged)."""
        version, cached = self._notes_version, self._note_texts
        if cached is None or cached[:2] != (version, live):
            notes = [(n["text"], n["session_id"]) for n in await asyncio.to_thread(self.memory_notes, live) if n["active"]]
            cached = self._note_texts = (version, live, notes)  # read after `version`: a later change bumps it again
        notes = cached[2]
        if any(s not in (None, session_id) for _, s in notes):  # another conversation's, or one this continues
            ours = set(await asyncio.to_thread(self.read, lambda c: linked_sessions(c, session_id)))
        else:
            ours = {session_id}
        return [text for text, s in notes if s is None or s in ours]

    def memory_notes(self, live: int | None = None) -> list[dict[str, Any]]:
        """The person's preference notes, least recently confirmed first (the order they are injected
        in: what the person asked for last sits nearest their message), each with `scope`
        ("general", or "session": only the conversation of `session_id` gets it) and `active`:
        whether main calls served by version `live` (None = the base model) get it. A
        retired note is inactive while `live` is the version that retired it or descends from it
        (the adapters' parent links); a rollback to anything else brings it back."""
        return self.read(lambda c: [{**dict(r), "scope": "general" if r["session_id"] is None else "session",
                                     "active": bool(r["active"])} for r in c.execute(
            "WITH RECURSIVE lineage(version) AS (SELECT ? WHERE ? IS NOT NULL UNION "
            "SELECT a.parent FROM adapters a JOIN lineage l ON a.version = l.version WHERE a.parent IS NOT NULL) "
            f"SELECT {', '.join(MEMORY_NOTE_COLUMNS)}, "
            "(retired_by IS NULL OR retired_by NOT IN (SELECT version FROM lineage)) AS active "
            "FROM memory_notes ORDER BY updated_at, note_id", (live, live))])

    def _session_known(self, session_id: str) -> bool:
        return self._conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone() is not None

    def _linked_sessions(self, session_id: str) -> list[str]:
        return linked_sessions(self._conn, session_id)

    def _resolve_target(self, sessions: list[str], target: str) -> str | None:
        where = f"session_id IN ({_marks(sessions)}) AND turn_type = 'main'"
        if target == "last":  # the final main call of the most recent turn: the reply the person saw
            row = self._conn.execute(
                f"SELECT call_id FROM calls WHERE {where} ORDER BY created_at DESC LIMIT 1", sessions
            ).fetchone()
        else:  # a request id names one call; a turn id names the final call of that turn
            row = self._conn.execute(
                f"SELECT call_id FROM calls WHERE {where} AND (request_id = ? OR turn_id = ?) "
                "ORDER BY request_id = ? DESC, created_at DESC LIMIT 1",
                (*sessions, target, target, target),
            ).fetchone()
        return row[0] if row else None

    def _resolve_orphans(self, c: Call) -> None:
        """Feedback that arrived before the call it names was stored is applied now, and the notes
        it made are linked to the call. The reply reaches the person before its call is stored, so
        feedback on "last" in a session with no stored call yet names the first call made before
        it was received; one received before any call of its session was made names none, and
        says so."""
        targets = [t for t in (c.turn_id, c.request_id) if t]
        kinds = SIGNAL_KINDS + ("comment",)
        rows = self._conn.execute(
            f"SELECT event_id, kind, target = 'last' AND received_at < ? FROM feedback_events WHERE state = 'orphan' "
            f"AND session_id = ? AND (target IN ({_marks(targets)}) OR (target = 'last' AND reason = 'unknown_session')) "
            f"AND kind IN ({_marks(kinds)})",
            (c.created_at, c.session_id, *targets, *kinds),
        ).fetchall()
        for event_id, kind, before_the_call in rows:
            if before_the_call:
                self._conn.execute("UPDATE feedback_events SET reason = 'before_first_call' WHERE event_id = ?",
                                   (event_id,))
                self._link_notes(event_id, None, "before_first_call")
                continue
            self._conn.execute(
                "UPDATE feedback_events SET state = 'applied', call_id = ?, reason = NULL WHERE event_id = ?",
                (c.call_id, event_id),
            )
            self._event("feedback.applied", event_id, {"kind": kind, "call_id": c.call_id, "resolved_orphan": True})
            self._link_notes(event_id, c.call_id)
            if kind in SIGNAL_KINDS:
                self._want_sample(c.call_id, kind)

    def _link_notes(self, event_id: str, call_id: str | None, reason: str | None = None) -> None:
        """The notes an orphan event made get its call now (`call_id`), or stay without one (`reason`)."""
        if call_id is not None:
            n = self._conn.execute("UPDATE memory_notes SET call_id = ? WHERE event_id = ? AND call_id IS NULL",
                                   (call_id, event_id)).rowcount
        else:
            n = self._conn.execute("SELECT count(*) FROM memory_notes WHERE event_id = ? AND call_id IS NULL",
                                   (event_id,)).fetchone()[0]
        if n:
            self._event("memory.linked" if call_id else "memory.unlinked", None,
                        {"notes": n, "call_id": call_id, "reason": reason})

    def _want_sample(self, call_id: str, why: str) -> None:
        """A new signal for this call: (re)queue its sample for judging, in the same transaction."""
        now = time.time()
        row = self._conn.execute("SELECT state FROM samples WHERE call_id = ?", (call_id,)).fetchone()
        if row is not None and row[0] == "consumed":
            self._event("sample.signal_after_consumed", call_id, {"signal": why})
            return
        if self._conn.execute("SELECT length(prompt_ids) FROM calls WHERE call_id = ?", (call_id,)).fetchone()[0] == 0:
            self._event("sample.not_queued", call_id, {"signal": why, "reason": "forgotten_note"})  # see _scrub_notes
            return
        self._conn.execute(
            "INSERT INTO samples(call_id, state, created_at, updated_at) VALUES (?, 'pending_judge', ?, ?) "
            "ON CONFLICT(call_id) DO UPDATE SET state = 'pending_judge', reason = NULL, "
            "revision = revision + 1, updated_at = excluded.updated_at",
            (call_id, now, now),
        )
        self._event("sample.pending_judge", call_id, {"signal": why})
        self._notify("sample.pending", call_id)

    def _write_sample(self, sample: JudgedSample) -> bool:
        now = time.time()
        for v in sample.votes:  # every vote is kept, also when the sample itself went stale
            self._insert("votes", VOTE_COLUMNS, {
                "call_id": sample.call_id, "kind": v.kind, "backend": v.backend, "prompt_version": v.prompt_version,
                "score": v.score, "hint": v.hint, "raw": v.raw, "error": v.error, "created_at": now})
        values = {name: getattr(sample, name) for name in SAMPLE_VERDICT_COLUMNS}
        values["teacher_adapter"] = version_name(sample.teacher_adapter)
        if sample.teacher_messages is not None:
            values["teacher_messages"] = json.dumps(sample.teacher_messages, ensure_ascii=False)
        for name, encode in SAMPLE_BLOBS.items():
            if values[name] is not None:
                values[name] = encode(values[name])
        assignments = ", ".join(f"{k} = ?" for k in values)
        cur = self._conn.execute(
            f"UPDATE samples SET {assignments}, updated_at = ? "
            "WHERE call_id = ? AND revision = ? AND state = 'pending_judge'",
            (*values.values(), now, sample.call_id, sample.revision),
        )
        if cur.rowcount != 1:
            return False
        self._event(f"sample.{sample.state}", sample.call_id, {
            "reason": sample.reason, "reward": sample.reward, "reward_source": sample.reward_source,
            "hint": sample.hint is not None})
        if sample.state == "ready":
            self._notify("sample.ready", sample.call_id)
        return True

    def _write_drop_samples(self, call_ids: list[str], reason: str, state: str) -> None:
        n = self._conn.execute(
            f"UPDATE samples SET state = ?, reason = ?, updated_at = ? WHERE state = 'ready' "
            f"AND call_id IN ({_marks(call_ids)})", (state, reason, time.time(), *call_ids)).rowcount
        self._event(f"samples.{state}", None, {"reason": reason, "samples": n, "call_ids": call_ids})

    # ---- forgetting ----

    def _write_forget(self, scope: ForgetScope) -> dict[str, Any]:
        c = self._conn
        c.execute("CREATE TEMP TABLE IF NOT EXISTS forget(session_id TEXT PRIMARY KEY)")
        c.execute("DELETE FROM temp.forget")
        if scope.everything:
            c.execute("INSERT INTO temp.forget SELECT session_id FROM sessions UNION SELECT session_id FROM "
                      "feedback_events UNION SELECT from_session FROM session_links UNION SELECT to_session FROM session_links")
        elif scope.session_id is not None:
            c.executemany("INSERT INTO temp.forget VALUES (?)", [(x,) for x in _link_closure(c, scope.session_id)])
        else:
            c.execute("INSERT INTO temp.forget SELECT session_id FROM sessions WHERE last_seen_at < ?", (scope.before,))
        sessions = [r[0] for r in c.execute("SELECT session_id FROM temp.forget")]
        in_s = "IN (SELECT session_id FROM temp.forget)"
        in_c = f"IN (SELECT call_id FROM calls WHERE session_id {in_s})"
        trained = sorted(v for (name,) in c.execute(
            f"SELECT DISTINCT consumed_version FROM samples WHERE consumed_version IS NOT NULL AND call_id {in_c}")
            if (v := parse_version(name)) is not None)
        deleted: dict[str, int] = {}
        scrubbed = {"calls": 0, "samples_dropped": 0}
        if scope.everything:  # every call goes too: no copy of a note is left anywhere
            notes = c.execute("DELETE FROM memory_notes").rowcount
            c.execute("DELETE FROM note_sources")
        else:  # the forgotten sessions no longer ask for their notes; a note no session asks for goes
            touched = [r[0] for r in c.execute(f"SELECT note_id FROM note_sources WHERE session_id {in_s} "
                                               f"UNION SELECT note_id FROM memory_notes WHERE call_id {in_c}")]
            c.execute(f"DELETE FROM note_sources WHERE session_id {in_s}")
            c.execute(f"UPDATE memory_notes SET call_id = NULL WHERE call_id {in_c}")
            gone = {r[0] for r in c.execute(f"DELETE FROM memory_notes WHERE note_id IN ({_marks(touched)}) "
                                            "AND note_id NOT IN (SELECT note_id FROM note_sources) RETURNING text", touched)}
            notes = len(gone)
            # What the forgotten sessions asked for, also in a wording a later note replaced, leaves
            # the calls of other sessions it was injected into, unless a note still asks for it.
            for (text,) in c.execute(f"SELECT text FROM feedback_events WHERE (session_id {in_s} OR call_id {in_c}) "
                                     "AND kind IN ('correction', 'thumbs_down') AND text IS NOT NULL").fetchall():
                gone.update(memory.notes_from(text)[0])
            gone -= {r[0] for r in c.execute("SELECT text FROM memory_notes")}
            scrubbed, tainted = self._scrub_notes(sorted(gone), in_s)
            trained = sorted(set(trained) | set(tainted))
        if notes:
            deleted["memory_notes"] = notes
        for table, where, args in (
            ("votes", f"call_id {in_c}", ()),
            ("samples", f"call_id {in_c}", ()),
            ("outcome_rewards", f"call_id {in_c} OR event_id IN (SELECT event_id FROM feedback_events "
                                f"WHERE session_id {in_s})", ()),
            ("next_states", f"call_id {in_c} OR next_call_id {in_c}", ()),
            ("feedback_events", f"session_id {in_s} OR call_id {in_c}", ()),
            # feedback for sessions that never appeared, received before the cut
            ("feedback_events", "state = 'orphan' AND received_at < ? AND session_id NOT IN (SELECT session_id FROM sessions)",
             (scope.before if scope.before is not None else float("-inf"),)),
            ("session_links", f"from_session {in_s} OR to_session {in_s}", ()),
            ("calls", f"session_id {in_s}", ()),
            ("sessions", f"session_id {in_s}", ()),
        ):
            n = c.execute(f"DELETE FROM {table} WHERE {where}", args).rowcount
            if n:
                deleted[table] = deleted.get(table, 0) + n
        c.execute("DELETE FROM temp.forget")
        if deleted:  # the tombstone: what kind of forget and how much, never what
            self._event("forgotten", None, {"scope": scope.kind, "before": scope.before, "deleted": deleted,
                                            "scrubbed": scrubbed, "trained_versions": trained})
            self._scrub_wanted = True
        return {"deleted": deleted, "scrubbed": scrubbed, "sessions": sessions, "trained_versions": trained}

    def _scrub_notes(self, texts: list[str], forgotten: str) -> tuple[dict[str, int], list[int]]:
        """Take the notes `texts` out of the stored main calls outside the `forgotten` sessions that
        were served with them: the request (messages and `memory_notes`) and the rendered prompt are
        rewritten as if the rest had been served. The prompt's token ids cannot be re-tokenised
        here, so they are emptied, and a sample of such a call that is not trained yet is dropped
        (`forgotten_note`; `_want_sample` queues none again); the teacher's prompt goes from every
        sample. Returns the counts and the versions trained on such a call."""
        c = self._conn
        rows = c.execute(
            "SELECT DISTINCT c.call_id, c.request_json, c.prompt_text FROM calls c, json_each(c.request_json, '$.memory_notes') j "
            f"WHERE c.session_id NOT {forgotten} AND j.value IN ({_marks(texts)})", texts).fetchall()
        for call_id, request_json, prompt_text in rows:
            body = json.loads(request_json)
            old = body.pop("memory_notes")
            new = [n for n in old if n not in texts]
            body["messages"] = memory.renote(body["messages"], old, new)
            if new:
                body["memory_notes"] = new
            block, new_block = "\n".join(old), "\n".join(new)
            prompt_text = prompt_text.replace("\n\n" + block, "\n\n" + new_block if new else "").replace(block, new_block)
            c.execute("UPDATE calls SET request_json = ?, prompt_text = ?, prompt_ids = ? WHERE call_id = ?",
                      (json.dumps(body, ensure_ascii=False), prompt_text, ids_blob([]), call_id))
        calls = [r[0] for r in rows]
        in_calls = f"IN ({_marks(calls)})"
        tainted = [v for (name,) in c.execute(
            f"SELECT DISTINCT consumed_version FROM samples WHERE consumed_version IS NOT NULL AND call_id {in_calls}",
            calls) if (v := parse_version(name)) is not None]
        dropped = c.execute(f"UPDATE samples SET state = 'dropped', reason = 'forgotten_note', updated_at = ? "
                            f"WHERE state != 'consumed' AND call_id {in_calls}", (time.time(), *calls)).rowcount
        c.execute(f"UPDATE samples SET teacher_messages = NULL, teacher_prompt_ids = NULL WHERE call_id {in_calls}", calls)
        return {"calls": len(calls), "samples_dropped": dropped}, tainted

    def _scrub(self) -> None:
        """Rewrite the database and empty the WAL, so deleted text is in neither file (old WAL
        frames and free pages would otherwise keep it). Waits for readers to let go of the WAL."""
        for _ in range(50):
            busy = self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if not busy:
                break
            time.sleep(0.1)
        self._conn.execute("VACUUM")
        for _ in range(50):
            if not self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
                return
            time.sleep(0.1)
        log.error("after a forget a reader kept the WAL from being emptied; the next forget empties it")

    # ---- adapters and training steps ----

    def _write_train_step(self, step: StepRecord) -> int:
        now = time.time()
        metrics = json.dumps(step.metrics)
        self._insert("train_steps", TRAIN_STEP_COLUMNS, {
            "version": step.version, "parent": step.parent, "started_at": step.started_at, "finished_at": now,
            "samples": len(step.call_ids), "outcome": step.outcome, "error": step.error, "metrics": metrics})
        if step.path is not None:
            state = "candidate" if step.candidate else step.outcome
            self._insert("adapters", ADAPTER_COLUMNS, {
                "version": step.version, "parent": step.parent, "path": step.path, "state": state,
                "reason": step.error, "method": step.method, "samples": len(step.call_ids), "metrics": metrics,
                "created_at": now, "updated_at": now})
            self._event(f"adapter.{state}", str(step.version), {"parent": step.parent, "error": step.error})
        if step.outcome != "committed":
            return 0
        consumed = self._conn.execute(
            f"UPDATE samples SET state = 'consumed', consumed_version = ?, updated_at = ? "
            f"WHERE state = 'ready' AND call_id IN ({_marks(step.call_ids)})",
            (version_name(step.version), now, *step.call_ids),
        ).rowcount
        self._event("samples.consumed", str(step.version), {"samples": consumed})
        return consumed

    def _write_adapter_live(self, version: int | None) -> None:
        now = time.time()
        # The version that leaves: refused again if it was refused (promoted by hand over the gate,
        # its reason kept); `committed` (good, not live) when a newer version replaces it; else
        # `retired`, rolled back from. Neither of the last two states is what a restart falls back to.
        self._conn.execute(
            "UPDATE adapters SET state = CASE WHEN reason IS NOT NULL THEN 'refused' "
            "WHEN ?1 IS NOT NULL AND ?1 > version THEN 'committed' ELSE 'retired' END, updated_at = ?2 "
            "WHERE state = 'live'", (version, now))
        if version is not None:
            self._conn.execute("UPDATE adapters SET state = 'live', live_at = ?, updated_at = ? WHERE version = ?",
                               (now, now, version))
        self._event("adapter.live", None if version is None else str(version), {})

    def _write_adapter_update(self, version: int, changes: dict[str, Any]) -> None:
        assignments = ", ".join(f"{k} = ?" for k in changes)
        self._conn.execute(f"UPDATE adapters SET {assignments}, updated_at = ? WHERE version = ?",
                           (*changes.values(), time.time(), version))
        self._event("adapter.updated", str(version), changes)

    # ---- reads (own read-only connection per call; safe from any thread) ----

    def read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        conn = connect(self.db_path, readonly=True)
        try:
            return fn(conn)
        finally:
            conn.close()

    def last_awaiting_call(self, session_id: str) -> sqlite3.Row | None:
        """The session's main call still waiting for its next state, if any (state after a restart).

        Sessions linked into this one count too: the conversation continues under the new id."""

        def q(c: sqlite3.Connection) -> sqlite3.Row | None:
            sessions = linked_sessions(c, session_id)
            return c.execute(
                "SELECT call_id, response_text, tool_calls_json, request_json FROM calls "
                f"WHERE session_id IN ({_marks(sessions)}) AND state = 'awaiting_next_state' "
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

    def counts(self) -> dict[str, Any]:
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
                "s.evidence_logprobs, s.loop_from, s.loop_to, s.student_prompt_ids, s.student_logprobs, "
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
                    call_id=r["call_id"], reward=r["reward"] or 0.0, adapter_version=parse_version(r["adapter_version"]),
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
                    loop_from=r["loop_from"],
                    served_prompt_ids=blob_ids(r["prompt_ids"]) if consolidated else None,
                ))
            return out

        return self.read(q)

    def ready_count(self) -> int:
        return self.read(lambda c: c.execute("SELECT count(*) FROM samples WHERE state = 'ready'").fetchone()[0])

    def adapters(self) -> list[dict[str, Any]]:
        def q(c: sqlite3.Connection) -> list[dict[str, Any]]:
            out = []
            for r in c.execute("SELECT * FROM adapters ORDER BY version"):
                row = dict(r)
                row["metrics"] = json.loads(row["metrics"])
                row["pinned"] = bool(row["pinned"])
                row["gate"] = json.loads(row["gate"])
                out.append(row)
            return out

        return self.read(q)

    def base_was_live(self) -> bool:
        """Whether the last version sent live was the base model (a rollback to base)."""
        row = self.read(lambda c: c.execute(
            "SELECT subject_id FROM events WHERE kind = 'adapter.live' ORDER BY id DESC LIMIT 1").fetchone())
        return row is not None and row[0] is None

    def last_train_step(self) -> dict[str, Any] | None:
        def q(c: sqlite3.Connection) -> dict[str, Any] | None:
            r = c.execute("SELECT * FROM train_steps ORDER BY step DESC LIMIT 1").fetchone()
            return None if r is None else {**dict(r), "metrics": json.loads(r["metrics"])}

        return self.read(q)

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
                adapter_version=parse_version(call["adapter_version"]),
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


@dataclass(frozen=True)
class ForgetScope:
    """One session (with every session linked to it, either way), every session last seen
    before a time, or everything."""

    session_id: str | None = None
    before: float | None = None
    everything: bool = False

    def __post_init__(self) -> None:
        if sum((self.session_id is not None, self.before is not None, self.everything)) != 1:
            raise ValueError("forget one session, everything before a time, or everything")

    @property
    def kind(self) -> str:
        return "all" if self.everything else ("session" if self.session_id is not None else "before")


def _link_closure(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """The session and every session linked to it, in either direction (one conversation)."""
    found, frontier = [session_id], [session_id]
    while frontier:
        marks = _marks(frontier)
        rows = conn.execute(f"SELECT from_session, to_session FROM session_links WHERE from_session IN ({marks}) "
                            f"OR to_session IN ({marks})", frontier + frontier).fetchall()
        frontier = sorted({s for r in rows for s in r} - set(found))
        found += frontier
    return found


def linked_sessions(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """The session plus every session that continues into it (OpenClaw rotates ids on compaction)."""
    found, frontier = [session_id], [session_id]
    while frontier and len(found) < 64:
        rows = conn.execute(
            f"SELECT from_session FROM session_links WHERE to_session IN ({_marks(frontier)})", frontier
        ).fetchall()
        frontier = [r[0] for r in rows if r[0] not in found]
        found += frontier
    return found


def counts(conn: sqlite3.Connection) -> dict[str, Any]:
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
    return {"calls": calls, "sessions": sessions, "events": events, "samples": samples, "feedback": feedback,
            "dropped_samples": dropped, "opd": opd_counts(conn)}


def opd_counts(conn: sqlite3.Connection) -> dict[str, Any]:
    """Of the samples with a teacher that train or trained (ready or consumed), how many distil
    the policy's top-K and how many only the sampled token, with the reasons of the latter."""
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
    return {"top_k": top_k, "token_level": token_level, "token_level_reasons": reasons,
            "token_level_share": token_level / (top_k + token_level) if top_k + token_level else None}


def export_jsonl(db_path: Path, out: TextIO, since: float | None = None) -> int:
    """Write sessions, calls (with token ids and logprobs) and next states as JSON lines."""
    conn = connect(db_path, readonly=True)
    n = 0
    try:
        for line in _export_rows(conn, since or 0.0):
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    finally:
        conn.close()
    return n


def _export_rows(conn: sqlite3.Connection, since: float) -> Iterator[dict[str, Any]]:
    for r in conn.execute("SELECT * FROM sessions WHERE last_seen_at >= ? ORDER BY created_at", (since,)):
        yield {"type": "session", **dict(r)}
    for r in conn.execute("SELECT * FROM calls WHERE created_at >= ? ORDER BY created_at", (since,)):
        row = dict(r)
        row["request"] = json.loads(row.pop("request_json"))
        row["tool_calls"] = json.loads(row.pop("tool_calls_json") or "null")
        row["timings"] = json.loads(row.pop("timings_json"))
        row["prompt_ids"] = blob_ids(row["prompt_ids"])
        row["response_ids"] = blob_ids(row["response_ids"])
        row["behaviour_logprobs"] = blob_logprobs(row["behaviour_logprobs"])
        n = len(row["response_ids"])
        row["sampling_logprobs"] = None if row["sampling_logprobs"] is None else blob_logprobs(row["sampling_logprobs"])
        row["top_ids"] = None if row["top_ids"] is None else blob_rows(blob_ids, row["top_ids"], n)
        row["top_logprobs"] = None if row["top_logprobs"] is None else blob_rows(blob_logprobs, row["top_logprobs"], n)
        yield {"type": "call", **row}
    for r in conn.execute("SELECT * FROM next_states WHERE created_at >= ? ORDER BY created_at", (since,)):
        row = dict(r)
        row["messages"] = json.loads(row.pop("messages_json"))
        row["reply_matched"] = bool(row["reply_matched"])
        yield {"type": "next_state", **row}
