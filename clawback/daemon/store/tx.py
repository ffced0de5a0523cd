"""What every write shares: the writer's connection, the event log, and queueing a sample."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Mapping

from .schema import linked_sessions, marks


class Tx:
    """The writer thread's side of the store; every write method runs inside its transaction."""

    _conn: sqlite3.Connection
    memory_max_notes: int
    # Called with the call id on the writer thread, after the commit that queued a call's sample
    # for judging, or stored a judged sample ready for training.
    on_sample_pending: list[Callable[[str], None]]
    on_sample_ready: list[Callable[[str], None]]
    _told: list[tuple[list[Callable[[str], None]], str]]  # (listeners, call id), told after the commit
    _scrub_wanted: bool  # a forget deleted rows: rewrite the files once it is committed

    def _tell_after_commit(self, listeners: list[Callable[[str], None]], call_id: str) -> None:
        self._told.append((listeners, call_id))

    def _insert(self, table: str, columns: tuple[str, ...], row: dict[str, object], or_ignore: bool = False) -> None:
        """INSERT the named columns; `row` must give exactly these (a missing or extra one is a bug)."""
        if set(row) != set(columns):
            raise ValueError(f"{table}: expected columns {sorted(columns)}, got {sorted(row)}")
        self._conn.execute(
            f"INSERT {'OR IGNORE ' if or_ignore else ''}INTO {table} ({', '.join(columns)}) VALUES ({marks(columns)})",
            [row[c] for c in columns])

    def _event(self, kind: str, subject: str | None, payload: Mapping[str, object] | None = None) -> None:
        self._conn.execute(
            "INSERT INTO events(ts, kind, subject_id, payload) VALUES (?, ?, ?, ?)",
            (time.time(), kind, subject, json.dumps(payload or {})),
        )

    def _session_known(self, session_id: str) -> bool:
        return self._conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (session_id,)).fetchone() is not None

    def _linked_sessions(self, session_id: str) -> list[str]:
        return linked_sessions(self._conn, session_id)

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
        self._tell_after_commit(self.on_sample_pending, call_id)
