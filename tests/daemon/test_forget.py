"""Forgetting with a real store: what a session left is deleted, none of its text remains in the
database files (free pages and WAL included), a content-free tombstone stays in the event log,
the memory notes learnt from it go (every note when everything goes), and the adapter versions
trained on it are named with the rollback that removes them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from clawback.daemon.adapters import Taint, tainted_versions
from clawback.daemon.capture import Capture
from clawback.daemon.forget import forget
from clawback.daemon.memory import inject
from clawback.daemon.store import ForgetScope, Store
from clawback.daemon.store.reads import AdapterRow
from clawback.records import Call, FeedbackRecord, JudgedSample, StepRecord
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
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": session,
                                      "target": "last", "text": f"say {secret}", "source": "cli"}), t))
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
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "session_link", "session_id": "gone-2",
                                      "from": "gone", "to": "gone-2", "source": "cli"}), time.time()))
    converse(store, "gone-2", "GONE-MARKER-4", time.time())  # the same conversation after compaction
    step(store, 2, 1, (gone,))
    step(store, 3, 2, ())
    store.flush()
    assert b"GONE-MARKER-3" in raw_bytes(store.db_path)

    capture = Capture(store, 1800, 100)
    report = asyncio.run(forget(store, ForgetScope(session_id="gone"), capture))

    assert report["sessions"] == 2 and report["deleted"]["calls"] == 2 and report["deleted"]["feedback_events"] == 3
    assert report["deleted"]["memory_notes"] == 2  # the notes its corrections left
    assert [n.text for n in store.memory_notes()] == ["say KEEP-MARKER-7"]
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
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": "never-seen",
                                      "source": "cli"}), time.time() - 86400 * 40))  # an old orphan
    report = asyncio.run(forget(store, ForgetScope(before=time.time() - 86400 * 30)))
    assert report["sessions"] == 1 and report["affected_versions"] == []
    assert [r[0] for r in query(store.db_path, "SELECT session_id FROM sessions")] == ["new"]
    assert not query(store.db_path, "SELECT * FROM feedback_events WHERE session_id IN ('old', 'never-seen')")
    assert not query(store.db_path, "SELECT * FROM samples WHERE call_id = ?", old)
    raw = raw_bytes(store.db_path)
    assert b"OLD-MARKER-1" not in raw and b"NEW-MARKER-2" in raw

    assert asyncio.run(store.edit_note(store.memory_notes()[0].note_id, "Call me NOTE-MARKER-5."))
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
    rows = [AdapterRow(version=v, parent=p, path=f"/adapters/v{v}", state=st, reason=None, pinned=False, method="opd",
                       samples=4, metrics={}, created_at=0.0, live_at=None, updated_at=0.0, gate={}) for v, p, st in
            [(1, None, "committed"), (2, 1, "pruned"), (3, 2, "committed"), (4, 3, "live"), (5, 1, "committed")]]
    assert tainted_versions(rows, [3]) == Taint([3, 4], 1)  # v2 is pruned
    rolled_back_from = [replace(r, state="retired") if r.version == 1 else r for r in rows]
    assert tainted_versions(rolled_back_from, [3]).rollback_to is None  # offered only what serves without force
    assert tainted_versions(rows, [1]) == Taint([1, 2, 3, 4, 5], None)
    assert tainted_versions(rows, []) == Taint([], None)


def correct(store: Store, session: str, text: str) -> dict:
    return asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": session,
                                             "target": "last", "text": text, "source": "cli"}), time.time()))


def test_forget_a_session_takes_the_note_of_a_correction_sent_before_its_first_call(store: Store):
    """A correction can arrive before the session's first call is stored (it is kept as an orphan
    until its call comes); the note it made belongs to that session all the same. The event log
    keeps a tombstone and never the session's name."""
    assert correct(store, "early-S", "Please say ORPHAN-MARKER-9.")["status"] == "orphan"
    converse(store, "early-S", "EARLY-MARKER-8", time.time())
    converse(store, "other", "OTHER-MARKER-1", time.time())
    store.flush()
    assert any("ORPHAN-MARKER-9" in n.text for n in store.memory_notes())

    asyncio.run(forget(store, ForgetScope(session_id="early-S")))

    assert [n.text for n in store.memory_notes()] == ["say OTHER-MARKER-1"]
    raw = raw_bytes(store.db_path)
    assert b"ORPHAN-MARKER-9" not in raw and b"EARLY-MARKER-8" not in raw
    assert b"early-S" not in raw, "the forgotten session's id is still in the database files"
    named = query(store.db_path, "SELECT kind, subject_id, payload FROM events WHERE subject_id = 'early-S' "
                                 "OR payload LIKE '%early-S%'")
    assert not [tuple(r) for r in named]
    (tomb,) = query(store.db_path, "SELECT payload FROM events WHERE kind = 'forgotten'")
    assert '"deleted"' in tomb[0] and "early-S" not in tomb[0]


def test_a_note_other_sessions_asked_for_survives_forgetting_one_of_them(store: Store):
    """A note is the person's standing preference while any stored session asked for it: forgetting
    one of those sessions leaves it; it goes with the last of them."""
    sessions = [f"asks-{i}" for i in range(6)]
    for s in sessions:
        converse(store, s, f"MARKER-{s}", time.time())
        correct(store, s, "Please answer in French.")
    store.flush()
    french = [n for n in store.memory_notes() if n.text == "Please answer in French."]
    assert len(french) == 1

    asyncio.run(forget(store, ForgetScope(session_id=sessions[-1])))  # the session that asked last
    assert [n.note_id for n in store.memory_notes() if n.text == "Please answer in French."] == [french[0].note_id]

    for s in sessions[:-1]:
        asyncio.run(forget(store, ForgetScope(session_id=s)))
    assert store.memory_notes() == []
    assert not query(store.db_path, "SELECT * FROM note_sources")


def served_with_notes(store: Store, session: str, notes: list[str]) -> str:
    """A main call served with `notes` injected, stored as the daemon stores it (request as served
    with its `memory_notes`, the rendered prompt), with a ready sample."""
    call_id, t = f"chatcmpl-{uuid.uuid4().hex}", time.time()
    messages = inject([{"role": "user", "content": "What is 2 + 2?"}], notes)
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id="t1", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=t, finished_at=t, model="tiny", adapter_version=None,
        request={"messages": messages, "memory_notes": notes}, prompt_text=f"<user>{messages[0]['content']}</user>",
        prompt_ids=[1, 2, 3], response_ids=[4, 5], behaviour_logprobs=[-1.0, -1.0], response_text="4",
        tool_calls=None, finish_reason="stop"))
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": session,
                                      "target": call_id, "source": "cli"}), t))
    asyncio.run(store.write_sample(JudgedSample(call_id=call_id, revision=0, state="ready", reward=1.0,
                                                teacher_messages=messages, teacher_prompt_ids=[1, 2, 3])))
    return call_id


def test_forget_takes_a_forgotten_note_out_of_every_request_it_was_injected_into(store: Store):
    """A note goes with the last session that asked for it, and so does its text in the calls of
    other sessions that were served with it: their requests and rendered prompts are rewritten
    without it; their prompt tokens, which the store cannot re-tokenise, are emptied, so a sample
    not yet trained is dropped (a later signal does not queue it again) and the version that
    trained on one is named like one trained on the session itself."""
    converse(store, "asker", "ASKER-MARKER-2", time.time())
    correct(store, "asker", "Please say SCRUB-MARKER-6.")
    converse(store, "other", "OTHER-MARKER-3", time.time())
    correct(store, "other", "Keep it short.")
    notes = ["Please say SCRUB-MARKER-6.", "Keep it short."]
    trained, queued = served_with_notes(store, "other", notes), served_with_notes(store, "other", notes)
    step(store, 1, None, (trained,))
    store.flush()

    report = asyncio.run(forget(store, ForgetScope(session_id="asker")))

    raw = raw_bytes(store.db_path)
    assert b"SCRUB-MARKER-6" not in raw, "the forgotten note's text is still in the database files"
    assert b"OTHER-MARKER-3" in raw and b"Keep it short." in raw  # the other conversation keeps the rest
    for call_id in (trained, queued):
        (row,) = query(store.db_path, "SELECT request_json, prompt_text, prompt_ids FROM calls WHERE call_id = ?", call_id)
        request = json.loads(row["request_json"])
        assert request["messages"] == inject([{"role": "user", "content": "What is 2 + 2?"}], ["Keep it short."])
        assert request["memory_notes"] == ["Keep it short."]
        assert row["prompt_text"] == "<user>What is 2 + 2?\n\nKeep it short.</user>" and row["prompt_ids"] == b""
    states = dict(tuple(r) for r in query(store.db_path, "SELECT call_id, state || ':' || coalesce(reason, '') "
                                                         "FROM samples WHERE call_id IN (?, ?)", trained, queued))
    assert states == {trained: "consumed:", queued: "dropped:forgotten_note"}
    assert report["affected_versions"] == [1] and report["rollback_to"] is None
    assert report["scrubbed"] == {"calls": 2, "samples_dropped": 1}
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "thumbs_down", "session_id": "other",
                                      "target": queued, "source": "cli"}), time.time()))
    assert query(store.db_path, "SELECT state FROM samples WHERE call_id = ?", queued)[0][0] == "dropped"
    assert [n.text for n in store.memory_notes()] == ["say OTHER-MARKER-3", "Keep it short."]


def test_an_older_store_loses_the_session_names_in_its_event_log(tmp_path: Path):
    """Events written before the log stopped naming sessions: the migration takes the names out,
    and a note learnt from a stored call keeps its session."""
    from clawback.daemon.store import connect, migrate

    db = tmp_path / "clawback.db"
    conn = connect(db)
    migrate(conn, upto=10)
    conn.execute("INSERT INTO sessions(session_id, created_at, last_seen_at) VALUES ('OLD-SESSION', 1.0, 2.0)")
    conn.execute("INSERT INTO calls(call_id, session_id, request_id, turn_type, state, created_at, finished_at, model, request_json, "
                 "prompt_text, prompt_ids, response_ids, behaviour_logprobs, response_text, finish_reason, timings_json) "
                 "VALUES ('c1', 'OLD-SESSION', 'r1', 'main', 'awaiting_next_state', 1, 2, 'm', '{}', 'p', x'', x'', x'', 'r', "
                 "'stop', '{}')")
    conn.execute("INSERT INTO memory_notes(text, topic, source, call_id, created_at, updated_at) "
                 "VALUES ('Be brief.', 'brief', 'correction', 'c1', 1, 1)")
    for kind, subject, payload in (("call.awaiting_next_state", "c1", '{"session_id": "OLD-SESSION", "turn_type": "main"}'),
                                   ("session.closed", "OLD-SESSION", '{"reason": "idle"}'),
                                   ("session.linked", "OLD-SESSION", '{"from": "OLD-SESSION-0"}')):
        conn.execute("INSERT INTO events(ts, kind, subject_id, payload) VALUES (1, ?, ?, ?)", (kind, subject, payload))
    conn.commit()
    conn.close()

    s = Store(db)
    try:
        assert not query(db, "SELECT * FROM events WHERE subject_id LIKE 'OLD-SESSION%' OR payload LIKE '%OLD-SESSION%'")
        assert [tuple(r) for r in query(db, "SELECT note_id, session_id FROM note_sources")] == [(1, "OLD-SESSION")]
        asyncio.run(forget(s, ForgetScope(session_id="OLD-SESSION")))
        assert s.memory_notes() == []
    finally:
        s.close()
