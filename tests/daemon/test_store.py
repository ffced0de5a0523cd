"""The durable store: migrations, the append-only event log, blobs, the background writer, export."""

from __future__ import annotations

import io
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from clawback.daemon import store as store_mod
from clawback.daemon.store import (
    Store,
    blob_ids,
    blob_logprobs,
    connect,
    export_jsonl,
    ids_blob,
    logprobs_blob,
    migrate,
    migrations,
    schema,
)
from clawback.records import Call

MIGRATIONS_DIR = Path(store_mod.__file__).parent / "migrations"


def record(call_id: str, session_id: str = "s1", *, state: str = "awaiting_next_state", t: float = 100.0,
           prompt_ids: list[int] | None = None, response_ids: list[int] | None = None,
           logprobs: list[float] | None = None, tool_calls: list[dict[str, Any]] | None = None,
           turn_type: str = "main") -> Call:
    response_ids = [7, 8] if response_ids is None else response_ids
    return Call(
        call_id=call_id, session_id=session_id, turn_id="t-1", request_id=f"req-{call_id}",
        turn_type=turn_type, state=state, created_at=t, finished_at=t + 1.0, model="tiny",
        adapter_version=None,
        request={"model": "clawback", "messages": [{"role": "user", "content": f"hi {call_id}"}]},
        prompt_text=f"<user>hi {call_id}</user>", prompt_ids=[1, 2, 3] if prompt_ids is None else prompt_ids,
        response_ids=response_ids,
        behaviour_logprobs=[-0.5] * len(response_ids) if logprobs is None else logprobs,
        response_text=f"reply {call_id}", tool_calls=tool_calls, finish_reason="stop",
        timings={"total_s": 0.25},
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "clawback.db"


@pytest.fixture
def store(db_path: Path):
    s = Store(db_path)
    yield s
    s.close()


def rows(s: Store, sql: str, *args: Any) -> list[sqlite3.Row]:
    s.flush()
    return s.read(lambda c: c.execute(sql, args).fetchall())


def wait_for(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


# ---------------------------------------------------------------- migrations


def test_migrations_are_found_in_order() -> None:
    files = sorted(f.name for f in MIGRATIONS_DIR.glob("*.sql"))
    found = migrations()
    assert len(files) >= 2
    assert [name for _, name, _ in found] == files
    assert [v for v, _, _ in found] == list(range(1, len(files) + 1))


def test_fresh_db_ends_at_latest_version(store: Store, db_path: Path) -> None:
    latest = migrations()[-1][0]
    assert store.schema_version == latest == len(list(MIGRATIONS_DIR.glob("*.sql")))
    assert db_path.is_file()
    conn = connect(db_path, readonly=True)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == latest
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        assert {"sessions", "calls", "next_states", "events"} <= names
        assert {"calls_session", "calls_created", "sessions_open", "events_subject"} <= names
        assert {"events_no_update", "events_no_delete"} <= names
        migrated = conn.execute(
            "SELECT subject_id, payload FROM events WHERE kind = 'schema.migrated' ORDER BY id").fetchall()
    finally:
        conn.close()
    assert [json.loads(p)["version"] for _, p in migrated] == list(range(1, latest + 1))
    assert [s for s, _ in migrated] == [name for _, name, _ in migrations()]


def test_old_db_is_migrated_forward_and_keeps_its_rows(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    conn = connect(db_path)
    assert migrate(conn, upto=1) == 1
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert "calls" in names and "calls_session" not in names and "events_no_update" not in names
    conn.execute("INSERT INTO sessions(session_id, created_at, last_seen_at) VALUES ('old', 1.0, 2.0)")
    conn.execute(
        "INSERT INTO calls VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        ("c-old", "old", None, "r", "main", "awaiting_next_state", 1.0, 2.0, "tiny", None, "{}", "p",
         ids_blob([5, 6]), ids_blob([9]), logprobs_blob([-1.5]), "hello", None, "stop", "{}"),
    )
    conn.execute("INSERT INTO events(ts, kind, subject_id) VALUES (1.0, 'old.event', 'c-old')")
    conn.close()

    s = Store(db_path)
    try:
        assert s.schema_version == migrations()[-1][0] >= 2
        old = rows(s, "SELECT * FROM calls WHERE call_id = 'c-old'")
        assert len(old) == 1
        assert blob_ids(old[0]["prompt_ids"]) == [5, 6] and blob_logprobs(old[0]["behaviour_logprobs"]) == [-1.5]
        assert rows(s, "SELECT session_id FROM sessions")[0][0] == "old"
        assert len(rows(s, "SELECT * FROM events WHERE kind = 'old.event'")) == 1
        names = {r[0] for r in rows(s, "SELECT name FROM sqlite_master")}
        assert {"calls_session", "events_no_update", "events_no_delete"} <= names
        versions = [json.loads(r[0])["version"] for r in
                    rows(s, "SELECT payload FROM events WHERE kind = 'schema.migrated' ORDER BY id")]
        assert versions == list(range(1, s.schema_version + 1))
        # The migrated store works: the old awaiting call can be paired.
        s.add_call(record("c-new", "old", t=3.0))
        s.add_next_state("c-old", "c-new", [{"role": "user", "content": "next"}], True, 3.0)
        assert rows(s, "SELECT state FROM calls WHERE call_id = 'c-old'")[0][0] == "paired"
        assert s.dropped == {}
    finally:
        s.close()


def test_opening_twice_is_idempotent(db_path: Path) -> None:
    s = Store(db_path)
    s.add_call(record("c1"))
    s.flush()
    first_events = len(rows(s, "SELECT * FROM events"))
    s.close()

    s2 = Store(db_path)
    try:
        assert s2.schema_version == migrations()[-1][0]
        assert len(rows(s2, "SELECT * FROM events WHERE kind = 'schema.migrated'")) == s2.schema_version
        assert len(rows(s2, "SELECT * FROM events")) == first_events
        assert [r[0] for r in rows(s2, "SELECT call_id FROM calls")] == ["c1"]
        conn = connect(db_path)
        try:
            assert migrate(conn) == s2.schema_version  # nothing left to apply
        finally:
            conn.close()
        assert len(rows(s2, "SELECT * FROM events")) == first_events
    finally:
        s2.close()


def test_events_are_append_only(store: Store, db_path: Path) -> None:
    store.add_event("test.kind", "subj", {"a": 1})
    before = rows(store, "SELECT id, ts, kind, subject_id, payload FROM events ORDER BY id")
    conn = connect(db_path)
    try:
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("UPDATE events SET kind = 'forged' WHERE kind = 'test.kind'")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("DELETE FROM events")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute("DELETE FROM events WHERE kind = 'test.kind'")
        conn.execute("INSERT INTO events(ts, kind) VALUES (1.0, 'appended')")  # appending still works
    finally:
        conn.close()
    after = rows(store, "SELECT id, ts, kind, subject_id, payload FROM events ORDER BY id")
    assert [tuple(r) for r in after[:-1]] == [tuple(r) for r in before]
    assert after[-1]["kind"] == "appended"


# ---------------------------------------------------------------- blobs


def test_blob_helpers_are_exact_little_endian() -> None:
    ids = [0, 1, -1, 2**31 - 1, -(2**31), 49151, 123456789]
    blob = ids_blob(ids)
    assert len(blob) == 4 * len(ids)
    assert ids_blob([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert blob_ids(blob) == ids
    assert all(type(i) is int for i in blob_ids(blob))
    assert ids_blob([]) == b"" and blob_ids(b"") == []

    lps = [float(np.float32(x)) for x in (0.0, -0.1, -1e-7, -12.345678, -2.0**-20, -80.5)]
    lblob = logprobs_blob(lps)
    assert len(lblob) == 4 * len(lps)
    assert logprobs_blob([-1.0]) == b"\x00\x00\x80\xbf"
    assert blob_logprobs(lblob) == lps
    assert blob_logprobs(b"") == []


def test_blobs_round_trip_through_the_store(store: Store) -> None:
    prompt = [1, 151643, 2**31 - 1, 0, -5]
    response = [42, 7, 99999]
    lps = [float(np.float32(x)) for x in (-0.1, -2.5e-6, -17.25)]
    store.add_call(record("c1", prompt_ids=prompt, response_ids=response, logprobs=lps))
    store.add_call(record("c2", prompt_ids=[3], response_ids=[], logprobs=[]))
    r = {row["call_id"]: row for row in rows(store, "SELECT * FROM calls")}
    assert isinstance(r["c1"]["prompt_ids"], bytes)
    assert blob_ids(r["c1"]["prompt_ids"]) == prompt
    assert blob_ids(r["c1"]["response_ids"]) == response
    assert blob_logprobs(r["c1"]["behaviour_logprobs"]) == lps
    assert blob_ids(r["c2"]["response_ids"]) == [] and blob_logprobs(r["c2"]["behaviour_logprobs"]) == []


# ---------------------------------------------------------------- the writer


def test_writer_commits_in_submission_order(store: Store) -> None:
    # Order matters across ops: the pairing needs the call row written before it.
    store.add_call(record("a", t=1.0))
    store.add_call(record("b", t=2.0))
    store.add_next_state("a", "b", [{"role": "user", "content": "u2"}], True, 2.0)
    store.close_session("s1", "session_done", 3.0)
    n = 700  # more than one writer batch
    for i in range(n):
        assert store.add_event("test.order", None, {"i": i})
    store.flush()
    assert store.dropped == {}
    assert store.written == 4 + n
    assert [json.loads(r[0])["i"] for r in
            rows(store, "SELECT payload FROM events WHERE kind = 'test.order' ORDER BY id")] == list(range(n))
    states = {r[0]: r[1] for r in rows(store, "SELECT call_id, state FROM calls")}
    assert states == {"a": "paired", "b": "closed_without_next_state"}
    kinds = [(r[0], r[1]) for r in rows(
        store, "SELECT kind, subject_id FROM events WHERE kind LIKE 'call.%' OR kind LIKE 'session.%' ORDER BY id")]
    assert kinds == [
        ("call.awaiting_next_state", "a"), ("call.awaiting_next_state", "b"), ("call.paired", "a"),
        ("call.closed_without_next_state", "b"), ("session.closed", None),
    ]
    sess = rows(store, "SELECT state, closed_reason, closed_at FROM sessions")[0]
    assert tuple(sess) == ("closed", "session_done", 3.0)


def test_full_queue_counts_drops_and_logs_them_later(tmp_path: Path) -> None:
    s = Store(tmp_path / "q.db", queue_size=1)
    blocker = connect(tmp_path / "q.db")
    try:
        blocker.execute("BEGIN IMMEDIATE")  # the writer cannot start a transaction now
        assert s.add_call(record("first"))
        wait_for(lambda: s.queue_depth() == 0)  # the writer took it and waits on the lock
        assert s.add_event("test.kept", None, {})  # fills the one slot
        assert not s.add_call(record("lost"))
        assert not s.add_event("test.lost", None, {})
        assert not s.add_event("test.lost", None, {})
        assert s.dropped == {"call": 1, "event": 2}
        assert s.queue_depth() == 1
        blocker.execute("COMMIT")
        s.flush()
        assert [r[0] for r in rows(s, "SELECT call_id FROM calls")] == ["first"]
        assert len(rows(s, "SELECT * FROM events WHERE kind = 'test.kept'")) == 1
        assert rows(s, "SELECT * FROM events WHERE kind = 'test.lost'") == []
        logged = rows(s, "SELECT payload FROM events WHERE kind = 'store.dropped'")
        assert [json.loads(r[0]) for r in logged] == [{"dropped_total": {"call": 1, "event": 2}}]
        # Logged once: later batches without new drops do not repeat it.
        s.add_event("test.after", None, {})
        s.flush()
        assert len(rows(s, "SELECT * FROM events WHERE kind = 'store.dropped'")) == 1
    finally:
        blocker.close()
        s.close()


def test_writer_survives_a_lock_held_past_busy_timeout(tmp_path: Path) -> None:
    s = Store(tmp_path / "lock.db")
    s._conn.execute("PRAGMA busy_timeout=50")  # the daemon waits 5 s; keep the test fast
    blocker = connect(tmp_path / "lock.db")
    try:
        blocker.execute("BEGIN IMMEDIATE")
        s.add_event("test.locked_out", None, {})
        wait_for(lambda: s.dropped.get("event:error") == 1)
        blocker.execute("COMMIT")
        assert s._thread.is_alive()
        s.add_event("test.after_lock", None, {})
        s.flush(timeout=10)
        assert len(rows(s, "SELECT * FROM events WHERE kind = 'test.after_lock'")) == 1
        assert rows(s, "SELECT * FROM events WHERE kind = 'test.locked_out'") == []
        logged = rows(s, "SELECT payload FROM events WHERE kind = 'store.dropped'")
        assert [json.loads(r[0]) for r in logged] == [{"dropped_total": {"event:error": 1}}]
    finally:
        blocker.close()
        s.close()


def test_bad_write_is_dropped_and_the_rest_of_its_batch_lands(tmp_path: Path) -> None:
    s = Store(tmp_path / "bad.db")
    blocker = connect(tmp_path / "bad.db")
    try:
        # Hold the writer on a first op so that the next ones are applied as one batch.
        blocker.execute("BEGIN IMMEDIATE")
        s.add_event("test.sentinel", None, {})
        wait_for(lambda: s.queue_depth() == 0)
        s.add_call(record("a", t=1.0))
        s.add_next_state("unknown-call", "a", [{"role": "user", "content": "x"}], True, 1.0)
        s.add_call(record("b", t=2.0))
        s.add_next_state("a", "b", [{"role": "user", "content": "u"}], False, 2.0)
        s.close_call("a", "retried")  # a is paired by now: not awaiting any more
        s.add_event("test.same_batch", None, {})
        assert s.queue_depth() == 6
        blocker.execute("COMMIT")
        s.flush()
        assert s.dropped == {"next_state:error": 1, "close_call:error": 1}
        states = {r[0]: r[1] for r in rows(s, "SELECT call_id, state FROM calls")}
        assert states == {"a": "paired", "b": "awaiting_next_state"}
        ns = rows(s, "SELECT call_id, next_call_id, roles, reply_matched FROM next_states")
        assert [tuple(r) for r in ns] == [("a", "b", "user", 0)]  # the bad insert was rolled back
        assert len(rows(s, "SELECT * FROM events WHERE kind = 'test.same_batch'")) == 1
        assert rows(s, "SELECT * FROM events WHERE subject_id = 'unknown-call'") == []
        assert s.written == 5  # sentinel, a, b, the pairing, the event
        s.add_event("test.later", None, {})
        s.flush()
        logged = rows(s, "SELECT payload FROM events WHERE kind = 'store.dropped'")
        assert [json.loads(r[0]) for r in logged] == [
            {"dropped_total": {"next_state:error": 1, "close_call:error": 1}}]
    finally:
        blocker.close()
        s.close()


def test_close_session_closes_its_waiting_calls_and_reopen(store: Store) -> None:
    store.add_call(record("a", "s1", t=1.0))
    store.add_call(record("side", "s1", state="served", turn_type="side", t=1.5))
    store.add_call(record("z", "s2", t=1.0))
    store.close_session("s1", "idle_timeout", 50.0)
    states = {r[0]: r[1] for r in rows(store, "SELECT call_id, state FROM calls")}
    assert states == {"a": "closed_without_next_state", "side": "served", "z": "awaiting_next_state"}
    reason = rows(store, "SELECT payload FROM events WHERE kind = 'call.closed_without_next_state'")
    assert [json.loads(r[0]) for r in reason] == [{"reason": "idle_timeout"}]
    assert store.session_row("s1")["state"] == "closed"
    assert store.stale_open_sessions(1000.0) == ["s2"]
    assert store.last_awaiting_call("s1") is None and store.last_awaiting_call("s2")["call_id"] == "z"
    store.reopen_session("s1", 60.0)
    store.flush()
    row = store.session_row("s1")
    assert (row["state"], row["closed_at"], row["closed_reason"], row["last_seen_at"]) == ("open", None, None, 60.0)
    assert store.counts().sessions == {"open": 2}


# ---------------------------------------------------------------- export


def test_export_jsonl_writes_everything_and_respects_since(store: Store, db_path: Path) -> None:
    tool_calls = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    lps = [float(np.float32(x)) for x in (-0.25, -3.1)]
    store.add_call(record("a", "old", t=100.0, prompt_ids=[1, 2], response_ids=[3, 4], logprobs=lps,
                                tool_calls=tool_calls))
    store.add_call(record("b", "old", t=200.0))
    store.add_next_state("a", "b", [{"role": "tool", "tool_call_id": "call_1", "content": "ok"}], True, 200.0)
    store.add_call(record("c", "new", t=300.0, response_ids=[5], logprobs=[-0.5]))
    store.add_call(record("d", "new", t=400.0))
    store.add_next_state("c", "d", [{"role": "user", "content": "é"}], False, 400.0)
    store.flush()

    out = io.StringIO()
    n = export_jsonl(db_path, out)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert n == len(lines) == 2 + 4 + 2
    sessions = [x for x in lines if x["type"] == "session"]
    calls = {x["call_id"]: x for x in lines if x["type"] == "call"}
    nexts = {x["call_id"]: x for x in lines if x["type"] == "next_state"}
    assert [x["session_id"] for x in sessions] == ["old", "new"]
    assert sessions[0]["state"] == "open" and sessions[0]["last_seen_at"] == 201.0
    a = calls["a"]
    assert (a["prompt_ids"], a["response_ids"], a["behaviour_logprobs"]) == ([1, 2], [3, 4], lps)
    assert a["tool_calls"] == tool_calls and a["timings"] == {"total_s": 0.25}
    assert a["request"]["messages"] == [{"role": "user", "content": "hi a"}]
    assert a["state"] == "paired" and calls["b"]["state"] == "awaiting_next_state"
    assert calls["b"]["tool_calls"] is None
    assert not any(k.endswith("_json") for k in a)
    assert nexts["a"]["messages"] == [{"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    assert nexts["a"]["reply_matched"] is True and nexts["c"]["reply_matched"] is False
    assert nexts["a"]["roles"] == "tool" and nexts["a"]["next_call_id"] == "b"
    assert nexts["c"]["messages"][0]["content"] == "é" and "é" in out.getvalue()  # not ascii-escaped
    # Types come in order: sessions, then calls, then next states.
    assert [x["type"] for x in lines] == ["session"] * 2 + ["call"] * 4 + ["next_state"] * 2

    out = io.StringIO()
    n = export_jsonl(db_path, out, since=250.0)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert n == len(lines)
    assert [(x["type"], x["session_id"] if x["type"] == "session" else x["call_id"]) for x in lines] == [
        ("session", "new"), ("call", "c"), ("call", "d"), ("next_state", "c")]
    assert export_jsonl(db_path, io.StringIO(), since=10_000.0) == 0


def test_declared_write_columns_match_the_migrations(tmp_path: Path) -> None:
    conn = connect(tmp_path / "cols.db")
    migrate(conn)
    declared = {"calls": schema.CALL_COLUMNS, "next_states": schema.NEXT_STATE_COLUMNS,
                "feedback_events": schema.FEEDBACK_COLUMNS, "votes": schema.VOTE_COLUMNS,
                "samples": schema.SAMPLE_VERDICT_COLUMNS, "train_steps": schema.TRAIN_STEP_COLUMNS,
                "adapters": schema.ADAPTER_COLUMNS, "memory_notes": schema.MEMORY_NOTE_COLUMNS}
    for table, columns in declared.items():
        info = conn.execute(f"PRAGMA table_info({table})").fetchall()  # cid, name, type, notnull, default, pk
        assert len(set(columns)) == len(columns), table
        assert set(columns) <= {r[1] for r in info}, f"{table}: {set(columns) - {r[1] for r in info}} not in the schema"
        if table != "samples":  # inserted: every required column must be written
            required = {r[1] for r in info if r[3] and r[4] is None and not r[5]}
            assert required <= set(columns), f"{table}: required {required - set(columns)} not written"
    assert {r[1] for r in conn.execute("PRAGMA table_info(calls)")} == set(schema.CALL_COLUMNS)
    conn.close()
