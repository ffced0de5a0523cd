"""The schema: connecting, versioned migrations, the columns each write sets, and token blobs."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable, Collection
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from clawback.records import JudgedSample


def marks(values: Collection[object]) -> str:
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
    for f in resources.files("clawback.daemon.store").joinpath("migrations").iterdir():
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
# The verdict's token ids and logprobs, as the blobs their columns hold (Any: a list or a T x K matrix).
SAMPLE_BLOBS: dict[str, Callable[[Any], bytes]] = {
    "teacher_prompt_ids": ids_blob, "teacher_logprobs": logprobs_blob, "teacher_top_logprobs": logprobs_blob,
    "evidence_ids": ids_blob, "evidence_logprobs": logprobs_blob, "evidence_teacher_logprobs": logprobs_blob,
    "evidence_prompt_ids": ids_blob, "student_prompt_ids": ids_blob,
    "student_logprobs": logprobs_blob, "student_top_logprobs": logprobs_blob}
TRAIN_STEP_COLUMNS = ("version", "parent", "started_at", "finished_at", "samples", "outcome", "error", "metrics")
ADAPTER_COLUMNS = ("version", "parent", "path", "state", "reason", "method", "samples", "metrics", "created_at",
                   "updated_at")
# A preference note as `memory_notes` returns it (with `active` for the version asked about).
MEMORY_NOTE_COLUMNS = ("note_id", "text", "topic", "source", "call_id", "session_id", "created_at", "updated_at",
                       "retired_by", "retired_at")
ADAPTER_STATES = ("committed", "candidate", "live", "retired", "refused", "failed", "pruned")


def link_closure(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """The session and every session linked to it, in either direction (one conversation)."""
    found, frontier = [session_id], [session_id]
    while frontier:
        qs = marks(frontier)
        rows = conn.execute(f"SELECT from_session, to_session FROM session_links WHERE from_session IN ({qs}) "
                            f"OR to_session IN ({qs})", frontier + frontier).fetchall()
        frontier = sorted({s for r in rows for s in r} - set(found))
        found += frontier
    return found


def linked_sessions(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """The session plus every session that continues into it (OpenClaw rotates ids on compaction)."""
    found, frontier = [session_id], [session_id]
    while frontier and len(found) < 64:
        rows = conn.execute(
            f"SELECT from_session FROM session_links WHERE to_session IN ({marks(frontier)})", frontier
        ).fetchall()
        frontier = [r[0] for r in rows if r[0] not in found]
        found += frontier
    return found
