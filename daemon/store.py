"""Durable store: SQLite in WAL mode, versioned migrations, one background writer.

The serving path never touches the disk: it hands write operations to `Store.submit`, which puts
them on a bounded queue; a writer thread applies them in order, many per transaction. If the
queue is ever full the write is counted as dropped (with its kind) and the count is exposed in
/metrics and `clawback status`, and written to the event log once there is room again.

Every state change also appends a row to `events`, which triggers keep append-only.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import numpy as np

log = logging.getLogger(__name__)

_STOP = object()


def ids_blob(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def logprobs_blob(logprobs: list[float]) -> bytes:
    return np.asarray(logprobs, dtype="<f4").tobytes()


def blob_ids(blob: bytes) -> list[int]:
    return np.frombuffer(blob, dtype="<i4").tolist()


def blob_logprobs(blob: bytes) -> list[float]:
    return np.frombuffer(blob, dtype="<f4").tolist()


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
        conn = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")  # an acknowledged commit survives power loss
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


@dataclass
class CallRecord:
    call_id: str
    session_id: str
    turn_id: str | None
    request_id: str
    turn_type: str
    state: str
    created_at: float
    finished_at: float
    model: str
    adapter_version: str | None
    request: dict[str, Any]
    prompt_text: str
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float]
    response_text: str
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str
    timings: dict[str, float] = field(default_factory=dict)


class Store:
    def __init__(self, db_path: Path, queue_size: int = 10_000) -> None:
        self.db_path = Path(db_path)
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.db_path)
        self.schema_version = migrate(self._conn)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.dropped: dict[str, int] = {}
        self._dropped_logged: dict[str, int] = {}
        self.written = 0
        self._thread = threading.Thread(target=self._write_loop, name="clawback-store", daemon=True)
        self._thread.start()

    # ---- writes (any thread; never block) ----

    def submit(self, op: str, *args: Any) -> bool:
        try:
            self._queue.put_nowait((op, args))
            return True
        except queue.Full:
            self.dropped[op] = self.dropped.get(op, 0) + 1
            log.error("store queue full: dropped a %s write (%d so far)", op, self.dropped[op])
            return False

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 30.0) -> None:
        """Block until everything submitted so far is committed (tests, shutdown, export)."""
        done = threading.Event()
        self._queue.put(("_flush", (done,)), timeout=timeout)
        if not done.wait(timeout):
            raise TimeoutError("store writer did not drain in time")

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put((_STOP, ()))
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
            stop = any(op is _STOP for op, _ in batch)
            waiters = [args[0] for op, args in batch if op == "_flush"]
            ops = [(op, args) for op, args in batch if op not in (_STOP, "_flush")]
            self._apply(ops)
            for w in waiters:
                w.set()
            if stop:
                return

    def _apply(self, ops: list[tuple[str, tuple]]) -> None:
        if not ops and self.dropped == self._dropped_logged:
            return
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            for op, args in ops:
                getattr(self, f"_op_{op}")(*args)
            self._log_drops()
            self._conn.execute("COMMIT")
            self.written += len(ops)
        except Exception:
            log.exception("store batch failed; retrying its writes one by one")
            self._rollback()
            for op, args in ops:  # isolate the bad write so the others still land
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                    getattr(self, f"_op_{op}")(*args)
                    self._conn.execute("COMMIT")
                    self.written += 1
                except Exception as e:
                    self._rollback()
                    self.dropped[f"{op}:error"] = self.dropped.get(f"{op}:error", 0) + 1
                    log.error("store write %s failed and was dropped: %s", op, e)

    def _rollback(self) -> None:
        # A BEGIN that failed (database locked past busy_timeout) leaves no transaction open, and
        # a bare ROLLBACK would then raise and kill the writer thread.
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _log_drops(self) -> None:
        if self.dropped != self._dropped_logged:
            self._event("store.dropped", None, {"dropped_total": dict(self.dropped)})
            self._dropped_logged = dict(self.dropped)

    def _event(self, kind: str, subject: str | None, payload: dict[str, Any] | None = None) -> None:
        self._conn.execute(
            "INSERT INTO events(ts, kind, subject_id, payload) VALUES (?, ?, ?, ?)",
            (time.time(), kind, subject, json.dumps(payload or {})),
        )

    def _op_event(self, kind: str, subject: str | None, payload: dict[str, Any]) -> None:
        self._event(kind, subject, payload)

    def _op_call(self, c: CallRecord) -> None:
        self._conn.execute(
            "INSERT INTO sessions(session_id, created_at, last_seen_at) VALUES (?, ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET last_seen_at = max(last_seen_at, excluded.last_seen_at)",
            (c.session_id, c.created_at, c.finished_at),
        )
        self._conn.execute(
            "INSERT INTO calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                c.call_id, c.session_id, c.turn_id, c.request_id, c.turn_type, c.state,
                c.created_at, c.finished_at, c.model, c.adapter_version,
                json.dumps(c.request, ensure_ascii=False), c.prompt_text,
                ids_blob(c.prompt_ids), ids_blob(c.response_ids), logprobs_blob(c.behaviour_logprobs),
                c.response_text, json.dumps(c.tool_calls) if c.tool_calls else None,
                c.finish_reason, json.dumps(c.timings),
            ),
        )
        self._event(f"call.{c.state}", c.call_id, {"session_id": c.session_id, "turn_type": c.turn_type})

    def _op_next_state(self, call_id: str, next_call_id: str, messages: list[dict], matched: bool, ts: float) -> None:
        roles = ",".join(m.get("role", "?") for m in messages)
        self._conn.execute(
            "INSERT INTO next_states VALUES (?, ?, ?, ?, ?, ?)",
            (call_id, next_call_id, json.dumps(messages, ensure_ascii=False), roles, int(matched), ts),
        )
        self._set_call_state(call_id, "paired", {"next_call_id": next_call_id, "roles": roles})

    def _op_close_call(self, call_id: str, reason: str) -> None:
        self._set_call_state(call_id, "closed_without_next_state", {"reason": reason})

    def _set_call_state(self, call_id: str, state: str, payload: dict[str, Any]) -> None:
        cur = self._conn.execute(
            "UPDATE calls SET state = ? WHERE call_id = ? AND state = 'awaiting_next_state'", (state, call_id)
        )
        if cur.rowcount != 1:
            raise ValueError(f"call {call_id} is not awaiting a next state")
        self._event(f"call.{state}", call_id, payload)

    def _op_close_session(self, session_id: str, reason: str, ts: float) -> None:
        waiting = self._conn.execute(
            "SELECT call_id FROM calls WHERE session_id = ? AND state = 'awaiting_next_state'", (session_id,)
        ).fetchall()
        for (call_id,) in waiting:
            self._set_call_state(call_id, "closed_without_next_state", {"reason": reason})
        self._conn.execute(
            "UPDATE sessions SET state = 'closed', closed_at = ?, closed_reason = ? WHERE session_id = ?",
            (ts, reason, session_id),
        )
        self._event("session.closed", session_id, {"reason": reason})

    def _op_reopen_session(self, session_id: str, ts: float) -> None:
        self._conn.execute(
            "UPDATE sessions SET state = 'open', closed_at = NULL, closed_reason = NULL, last_seen_at = ? "
            "WHERE session_id = ?",
            (ts, session_id),
        )
        self._event("session.reopened", session_id, {})

    # ---- reads (own read-only connection per call; safe from any thread) ----

    def read(self, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        conn = connect(self.db_path, readonly=True)
        try:
            return fn(conn)
        finally:
            conn.close()

    def last_awaiting_call(self, session_id: str) -> sqlite3.Row | None:
        """The session's main call still waiting for its next state, if any (state after a restart)."""
        return self.read(
            lambda c: c.execute(
                "SELECT call_id, response_text, tool_calls_json, request_json FROM calls "
                "WHERE session_id = ? AND state = 'awaiting_next_state' ORDER BY created_at DESC LIMIT 1",
                (session_id,),
            ).fetchone()
        )

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


def counts(conn: sqlite3.Connection) -> dict[str, Any]:
    calls = {f"{r[0]}/{r[1]}": r[2] for r in conn.execute(
        "SELECT turn_type, state, count(*) FROM calls GROUP BY turn_type, state")}
    sessions = {r[0]: r[1] for r in conn.execute("SELECT state, count(*) FROM sessions GROUP BY state")}
    events = conn.execute("SELECT count(*) FROM events").fetchone()[0]
    return {"calls": calls, "sessions": sessions, "events": events}


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
        yield {"type": "call", **row}
    for r in conn.execute("SELECT * FROM next_states WHERE created_at >= ? ORDER BY created_at", (since,)):
        row = dict(r)
        row["messages"] = json.loads(row.pop("messages_json"))
        row["reply_matched"] = bool(row["reply_matched"])
        yield {"type": "next_state", **row}
