"""Forgetting with a real store: what a session left is deleted, none of its text remains in the
database files (free pages and WAL included), a content-free tombstone stays in the event log,
the memory notes learnt from it go (every note when everything goes), and the adapter versions
trained on it are named with the rollback that removes them."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from clawback.daemon.adapters import tainted_versions
from clawback.daemon.capture import Capture
from clawback.daemon.forget import forget
from clawback.daemon.store import ForgetScope, Store
from clawback.records import Call, JudgedSample, StepRecord
from tests.conftest import query


def raw_bytes(db: Path) -> bytes:
    """Every byte SQLite keeps for the database: the file, its WAL and shared memory."""
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


def converse(store: Store, session: str, secret: str, t: float) -> str:
    """A main call carrying `secret` in its request, reply, next state, correction and sample."""
    call_id = f"chatcmpl-{uuid.uuid4().hex}"
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id="t1", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=t, finished_at=t, model="tiny", adapter_version=None,
        request={"messages": [{"role": "user", "content": f"my secret is {secret}"}]}, prompt_text=f"user: {secret}",
        prompt_ids=[1, 2, 3], response_ids=[4, 5], behaviour_logprobs=[-1.0, -1.0], response_text=f"ok {secret}",
        tool_calls=None, finish_reason="stop"))
    store.add_next_state(call_id, "next", [{"role": "user", "content": f"no, {secret}!"}], True, t)
    asyncio.run(store.apply_feedback({"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": session,
                                      "target": "last", "text": f"say {secret}", "source": "cli"}, t))
    asyncio.run(store.write_sample(JudgedSample(call_id=call_id, revision=1, state="ready", reward=-1.0,
                                                hint=f"hint {secret}", correction=f"say {secret}")))
    return call_id


def step(store: Store, version: int, parent: int | None, call_ids: tuple[str, ...]) -> None:
    asyncio.run(store.record_step(StepRecord(version=version, parent=parent, started_at=time.time(), method="binary",
                                             call_ids=call_ids, outcome="committed", path=f"/nowhere/v{version}")))


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "clawback.db")
    yield s
    s.close()


def test_forget_a_session_leaves_no_trace_of_its_text(store: Store):
    keep = converse(store, "keep", "KEEP-MARKER-7", time.time())
    step(store, 1, None, (keep,))
    gone = converse(store, "gone", "GONE-MARKER-3", time.time())
    asyncio.run(store.apply_feedback({"event_id": str(uuid.uuid4()), "kind": "session_link", "session_id": "gone-2",
                                      "from": "gone", "to": "gone-2", "source": "cli"}, time.time()))
    converse(store, "gone-2", "GONE-MARKER-4", time.time())  # the same conversation after compaction
    step(store, 2, 1, (gone,))
    step(store, 3, 2, ())
    store.flush()
    assert b"GONE-MARKER-3" in raw_bytes(store.db_path)

    capture = Capture(store, 1800, 100)
    report = asyncio.run(forget(store, ForgetScope(session_id="gone"), capture))

    assert report["sessions"] == 2 and report["deleted"]["calls"] == 2 and report["deleted"]["feedback_events"] == 3
    assert report["deleted"]["memory_notes"] == 2  # the notes its corrections left
    assert [n["text"] for n in store.memory_notes()] == ["say KEEP-MARKER-7"]
    assert report["affected_versions"] == [2, 3] and report["rollback_to"] == 1
    raw = raw_bytes(store.db_path)
    assert b"GONE-MARKER" not in raw, "forgotten text is still in the database files"
    assert b"KEEP-MARKER-7" in raw  # the other conversation is untouched
    db, gone_sessions = store.db_path, "('gone', 'gone-2')"
    for table in ("calls", "sessions", "feedback_events"):
        assert not query(db, f"SELECT * FROM {table} WHERE session_id IN {gone_sessions}"), table
    assert not query(db, "SELECT * FROM next_states WHERE call_id = ?", gone)
    assert not query(db, "SELECT * FROM samples WHERE call_id = ?", gone)
    assert not query(db, "SELECT * FROM session_links")
    # the preference note learned from the forgotten correction went too; the kept one stays
    assert [r[0] for r in query(db, "SELECT text FROM memory_notes")] == ["say KEEP-MARKER-7"]
    (tomb,) = query(store.db_path, "SELECT payload FROM events WHERE kind = 'forgotten'")
    assert "MARKER" not in tomb[0] and '"scope": "session"' in tomb[0]


def test_forget_before_a_time_and_everything(store: Store):
    old = converse(store, "old", "OLD-MARKER-1", time.time() - 86400 * 40)
    converse(store, "new", "NEW-MARKER-2", time.time())
    asyncio.run(store.apply_feedback({"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "never-seen",
                                      "source": "cli"}, time.time() - 86400 * 40))  # an old orphan
    report = asyncio.run(forget(store, ForgetScope(before=time.time() - 86400 * 30)))
    assert report["sessions"] == 1 and report["affected_versions"] == []
    assert [r[0] for r in query(store.db_path, "SELECT session_id FROM sessions")] == ["new"]
    assert not query(store.db_path, "SELECT * FROM feedback_events WHERE session_id IN ('old', 'never-seen')")
    assert not query(store.db_path, "SELECT * FROM samples WHERE call_id = ?", old)
    raw = raw_bytes(store.db_path)
    assert b"OLD-MARKER-1" not in raw and b"NEW-MARKER-2" in raw

    assert asyncio.run(store.edit_note(store.memory_notes()[0]["note_id"], "Call me NOTE-MARKER-5."))
    report = asyncio.run(forget(store, ForgetScope(everything=True)))
    assert report["deleted"]["sessions"] == 1 and report["deleted"]["memory_notes"] == 1
    assert store.memory_notes() == []  # a person forgetting everything loses their notes, edited ones too
    assert b"NEW-MARKER-2" not in raw_bytes(store.db_path) and b"NOTE-MARKER-5" not in raw_bytes(store.db_path)
    assert [r[0] for r in query(store.db_path, "SELECT json_extract(payload, '$.scope') FROM events "
                                               "WHERE kind = 'forgotten' ORDER BY id")] == ["before", "all"]


def test_a_scope_is_exactly_one_thing():
    for bad in ({}, {"session_id": "a", "everything": True}, {"before": 1.0, "session_id": "a"}):
        with pytest.raises(ValueError):
            ForgetScope(**bad)


def test_tainted_versions_follow_the_lineage():
    rows = [{"version": v, "parent": p, "state": st} for v, p, st in
            [(1, None, "retired"), (2, 1, "pruned"), (3, 2, "retired"), (4, 3, "live"), (5, 1, "committed")]]
    assert tainted_versions(rows, [3]) == {"affected_versions": [3, 4], "rollback_to": 1}  # v2 is pruned
    assert tainted_versions(rows, [1]) == {"affected_versions": [1, 2, 3, 4, 5], "rollback_to": None}
    assert tainted_versions(rows, []) == {"affected_versions": [], "rollback_to": None}
