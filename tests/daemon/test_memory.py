"""Preference notes: made from corrections and 👎 reasons in the store's feedback transaction,
bounded, de-duplicated, newest wins; injected into main calls and stored as served; listed,
edited and forgotten over HTTP and with `clawback memory` against a real daemon process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from clawback.chat import ChatRequest
from clawback.daemon.display import note_retirement
from clawback.daemon.memory import inject, notes_from, renote, repeats, scope, strip, topic
from clawback.daemon.retirement import NoteRetirement
from clawback.daemon.store import Store, blob_ids
from clawback.engine import EngineError
from clawback.records import Call, FeedbackRecord, JudgedSample, StepRecord
from tests.conftest import DaemonProcess, query, random_lora, wait_for


def test_notes_are_the_request_sentences_of_a_correction():
    assert notes_from("Hmm. Please start your reply with 'Sure!'.  Thanks") == (["Please start your reply with 'Sure!'."], {})
    # What went wrong is not what to do: the complaint and "It was cut off." are skipped, counted.
    assert notes_from("That looks AI-written. It was cut off. Don't use bold. Next time, keep it short.") == (
        ["Don't use bold.", "Next time, keep it short."], {"not a request": 2})
    assert notes_from("That comment is not what I need. I'd like shorter replies. No bold. No, that is wrong.") == (
        ["I'd like shorter replies.", "No bold."], {"not a request": 2})
    # A request about the exchange is not one about replies: skipped under its own reason.
    assert notes_from("That is wrong. Just answer, don't talk about my feedback. Don't repeat yourself. Please use bold.") == (
        ["Please use bold."], {"not a request": 1, "about the exchange, not replies": 2})
    assert notes_from("Please ignore what I said about bold. Don't repeat the question.")[0] == ["Don't repeat the question."]
    assert topic("Please use bold.") == topic("Don't use bold, please.")  # a reversal is the same topic
    assert topic("Please use bold.") != topic("Please use headers.")
    assert notes_from("   ") == ([], {})


def test_injection_goes_into_the_last_user_message_or_the_system_prompt_and_leaves_the_input_alone():
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "sum 2 and 3"}]
    out = inject(msgs, ["Be brief.", "No bold."])  # the default: the person's latest message
    assert out[3]["content"] == "sum 2 and 3\n\nBe brief.\nNo bold."  # as if the person had written them
    assert out[:3] == msgs[:3] and msgs[3]["content"] == "sum 2 and 3"
    out = inject(msgs, ["Be brief.", "No bold."], "system")
    assert out[0]["content"] == "You are helpful.\n\nBe brief.\nNo bold."
    assert out[1:] == msgs[1:] and msgs[0]["content"] == "You are helpful."
    assert inject([{"role": "user", "content": "hi"}], ["Be brief."], "system")[0]["role"] == "system"
    assert inject(msgs, []) is msgs


def test_a_repeat_is_part_of_a_note_in_its_words_not_a_reversal_of_it():
    wider = "Please answer in under 20 words and give the number you get."
    assert repeats("Please answer in under 20 words.", wider) and repeats("Give the number you get.", wider)
    assert not repeats("Please answer in under 30 words.", wider) and not repeats("Please.", wider)
    assert not repeats("Please use bold.", "Please don't use bold and keep it short.")
    assert repeats("Don't use bold.", "Please don't use bold and keep it short.")


def _feedback(store: Store, kind: str, text: str | None) -> None:
    ev = {"event_id": str(uuid.uuid4()), "kind": kind, "session_id": "nobody", "target": "last", "text": text}
    asyncio.run(store.apply_feedback(FeedbackRecord.of(ev), time.time()))


def test_a_note_that_covers_older_ones_replaces_them(tmp_path: Path):
    """The same request twice in one prompt makes a small model repeat it (bench/README.md), so a
    note that says what older ones said and more replaces them, and one that repeats part of an
    older one confirms it; one that reverses part of it is kept beside it."""
    store = Store(tmp_path / "db.sqlite")
    try:
        _feedback(store, "correction", "Hmm. Please start your reply with 'Sure!'.")
        _feedback(store, "correction", "Hmm. Please write the work out in plain sentences with the numbers.")
        _feedback(store, "correction", "Don't use bold.")
        _feedback(store, "correction", "Hmm. Please start your reply with 'Sure!' and write the work out in plain "
                                       "sentences with the numbers.")
        assert [n.text for n in store.memory_notes()] == [
            "Don't use bold.", "Please start your reply with 'Sure!' and write the work out in plain sentences "
            "with the numbers."]
        events = store._conn.execute("SELECT payload FROM events WHERE kind = 'memory.subsumed'").fetchall()
        assert len(events) == 2 and all("Sure" not in e[0] for e in events)  # a reason, never the text
        covering = store.memory_notes()[1]
        _feedback(store, "correction", "Hmm. Please start your reply with 'Sure!'.")  # a repeat: confirms it
        assert [n.text for n in store.memory_notes()] == [
            "Don't use bold.", "Please start your reply with 'Sure!' and write the work out in plain sentences "
            "with the numbers."]
        assert store.memory_notes()[1].updated_at > covering.updated_at
        assert store._conn.execute("SELECT COUNT(*) FROM events WHERE kind = 'memory.confirmed'").fetchone()[0] == 1
        _feedback(store, "correction", "Please use bold and keep it short.")
        _feedback(store, "correction", "Please don't use bold.")  # part of it reversed: kept beside it
        assert [n.text for n in store.memory_notes()][-2:] == ["Please use bold and keep it short.",
                                                                   "Please don't use bold."]
    finally:
        store.close()


def test_store_dedupes_replaces_on_conflict_and_stays_bounded(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite", memory_max_notes=3)
    try:
        _feedback(store, "correction", "That looks AI-written. Please don't use bold.")
        _feedback(store, "correction", "That looks AI-written. Please don't use headers.")
        _feedback(store, "correction", "Keep it short. Don't talk about my feedback.")
        assert [n.text for n in store.memory_notes()] == [
            "Please don't use bold.", "Please don't use headers.", "Keep it short."]
        skipped = store._conn.execute("SELECT json_extract(payload, '$.reason'), json_extract(payload, '$.sentences') "
                                      "FROM events WHERE kind = 'memory.skipped' ORDER BY rowid").fetchall()
        # the complaint, once per correction, and the request about the exchange
        assert [tuple(r) for r in skipped] == [("not a request", 1), ("not a request", 1), ("about the exchange, not replies", 1)]
        _feedback(store, "thumbs_down", "Actually, please use bold.")  # a 👎 reason; newest wins
        texts = [n.text for n in store.memory_notes()]
        assert "Please don't use bold." not in texts and "Actually, please use bold." in texts and len(texts) == 3
        _feedback(store, "thumbs_up", "Nice one, well done.")  # praise is not a preference
        _feedback(store, "correction", "Answer in one sentence.")  # bounded: the stalest note goes
        assert len(store.memory_notes()) == 3 and "Please don't use headers." not in [
            n.text for n in store.memory_notes()]
        first = store.memory_notes()[0].note_id
        assert asyncio.run(store.edit_note(first, "  Keep   it brief. "))
        assert asyncio.run(store.forget_notes(999)) == 0
        edited = store.memory_notes()[-1]  # what the person said last sits nearest their message
        assert (edited.note_id, edited.text, edited.source) == (first, "Keep it brief.", "edit")
        assert asyncio.run(store.forget_notes()) == 3 and store.memory_notes() == []
    finally:
        store.close()


def test_notes_are_injected_least_recently_confirmed_first_in_the_persons_sentence_order(tmp_path: Path):
    """The note nearest the person's message is the one a small model follows (bench/README.md,
    "The order of the notes"): what they asked for last goes there, and the notes of one
    correction keep the order they were written in."""
    store = Store(tmp_path / "db.sqlite")
    try:
        _feedback(store, "correction", "Hmm. Please answer in under 20 words and give the number you get.")
        _feedback(store, "correction", "Hmm. No bold. Please answer in under 20 words and give the number you get.")
        brief = "Please answer in under 20 words and give the number you get."
        assert [n.text for n in store.memory_notes()] == ["No bold.", brief]
        _feedback(store, "correction", "Don't use headers.")
        _feedback(store, "correction", "Hmm. Please answer in under 20 words.")  # confirms the brief note
        assert [n.text for n in store.memory_notes()] == ["No bold.", "Don't use headers.", brief]
        assert asyncio.run(store.note_texts(None, "nobody")) == [n.text for n in store.memory_notes()]
    finally:
        store.close()


def test_a_note_about_the_task_is_scoped_to_its_conversation_by_its_wording():
    """The rule of `memory.scope`, one case per clause; its accuracy on the simulator's corrections
    and on hand-written cases is measured by bench/note_scope.py."""
    general = ["Please start your reply with 'Sure!'.", "Don't use markdown.", "Keep answers short.",
               "Please answer in under 20 words and give the number you get.", "Could you please not use headers?",
               "Don't end with answer labels like 'Final answer:', 'The answer is:' or '#### 7'.",
               "Always answer with just the number, like: 4.", "Keep it between 15 and 80 words."]
    session = ["Answer with just the number, like: 4.", "The answer is 12, not 4.", "Use pandas for this one.",
               "And a string?", "Skip the intro for now.", "In this chat, call me Captain.", "Use the table above."]
    assert [s for s in general if scope(s) != "general"] == []
    assert [s for s in session if scope(s) != "session"] == []


def _say(store: Store, session: str, text: str) -> dict:
    ev = {"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": session, "target": "last", "text": text}
    return asyncio.run(store.apply_feedback(FeedbackRecord.of(ev), time.time()))


def test_a_session_note_reaches_its_own_conversation_only_until_the_person_widens_it(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite", memory_max_notes=2)
    try:
        _say(store, "A", "Hmm. Don't use bold. Answer with just the number, like: 4.")
        _say(store, "B", "Use pandas for this one.")
        _say(store, "C", "Use pandas for this one.")  # the same words in another conversation: its own note
        notes = {n.text + "@" + str(n.session_id): n for n in store.memory_notes()}
        assert sorted(notes) == ["Answer with just the number, like: 4.@A", "Don't use bold.@None",
                                 "Use pandas for this one.@B", "Use pandas for this one.@C"]
        assert [n.scope for n in store.memory_notes()] == ["general", "session", "session", "session"]
        assert asyncio.run(store.note_texts(None, "A")) == ["Don't use bold.", "Answer with just the number, like: 4."]
        assert asyncio.run(store.note_texts(None, "B")) == ["Don't use bold.", "Use pandas for this one."]
        assert asyncio.run(store.note_texts(None, "new")) == ["Don't use bold."]
        # A conversation that continues A (a new session id after compaction) keeps A's notes.
        asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "session_link", "session_id": "A-2",
                                          "from": "A", "to": "A-2"}), time.time()))
        assert "Answer with just the number, like: 4." in asyncio.run(store.note_texts(None, "A-2"))

        # Bounded per scope: two general notes and two per conversation.
        for text in ("Keep answers short.", "Use metric units."):
            _say(store, "B", text)
        assert [n.text for n in store.memory_notes() if n.scope == "general"] == [
            "Keep answers short.", "Use metric units."]
        assert len([n for n in store.memory_notes() if n.session_id == "B"]) == 1

        four = notes["Answer with just the number, like: 4.@A"].note_id
        pandas_c = notes["Use pandas for this one.@C"].note_id
        assert asyncio.run(store.scope_note(4242, "general")) == "no memory note 4242"
        assert asyncio.run(store.scope_note(four, "session", "never-seen")) == "no session 'never-seen'"
        assert asyncio.run(store.scope_note(pandas_c, "general")) is None  # the person widens it: confirmed
        assert asyncio.run(store.note_texts(None, "new")) == ["Use metric units.", "Use pandas for this one."]
        pandas_b = notes["Use pandas for this one.@B"].note_id
        assert asyncio.run(store.scope_note(pandas_b, "general")) is None  # same topic, same scope: it takes the place
        assert [n.note_id for n in store.memory_notes() if n.text == "Use pandas for this one."] == [pandas_b]
        assert asyncio.run(store.scope_note(pandas_b, "session")) == (  # asked for in B and C: which?
            f"memory note {pandas_b} was asked for in 2 sessions: name one")
        assert asyncio.run(store.scope_note(pandas_b, "session", "B")) is None
        assert asyncio.run(store.note_texts(None, "new")) == ["Use metric units."]
        scoped = store._conn.execute("SELECT payload FROM events WHERE kind = 'memory.scoped'").fetchall()
        assert len(scoped) == 3 and all('"B"' not in r[0] and '"C"' not in r[0] for r in scoped)  # no session names
    finally:
        store.close()


def _stored_call(store: Store, session: str, created_at: float, turn_id: str = "turn-1") -> str:
    call_id = f"chatcmpl-{uuid.uuid4().hex}"
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id=turn_id, request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=created_at, finished_at=created_at, model="tiny", adapter_version=None,
        request={"messages": [{"role": "user", "content": "What is 12 - 4?"}]}, prompt_text="What is 12 - 4?",
        prompt_ids=[1, 2], response_ids=[3], behaviour_logprobs=[-1.0], response_text="4", tool_calls=None,
        finish_reason="stop"))
    store.flush()
    return call_id


def test_a_note_from_a_correction_stored_before_its_call_is_linked_when_the_call_arrives(tmp_path: Path):
    """The reply reaches the person before its call is stored, so a quick correction can find no
    call: it waits as an orphan, and so does its note's link to the reply it was about (which the
    note's retirement check needs). When the call arrives the note is linked to it; a correction
    sent before any call of its session was made names none, and its note stays unlinked with the
    reason recorded."""
    store = Store(tmp_path / "db.sqlite")
    try:
        sent = time.time()
        early = {"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "fresh", "target": "last",
                 "text": "Hmm. Don't use bold."}
        assert asyncio.run(store.apply_feedback(FeedbackRecord.of(early), sent))["status"] == "orphan"
        assert [n.call_id for n in store.memory_notes()] == [None]
        call_id = _stored_call(store, "fresh", sent - 1)  # served before the correction was sent
        assert [n.call_id for n in store.memory_notes()] == [call_id]
        assert query(store.db_path, "SELECT state, call_id FROM feedback_events")[0][:] == ("applied", call_id)
        assert query(store.db_path, "SELECT state FROM samples WHERE call_id = ?", call_id)[0][0] == "pending_judge"

        # A correction naming a turn that is not stored yet is linked when that turn's call is.
        turn = {"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "fresh", "target": "turn-2",
                "text": "Keep answers short."}
        assert asyncio.run(store.apply_feedback(FeedbackRecord.of(turn), time.time()))["status"] == "orphan"
        second = _stored_call(store, "fresh", time.time(), "turn-2")
        assert {n.text: n.call_id for n in store.memory_notes()}["Keep answers short."] == second

        before = {"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "later", "target": "last",
                  "text": "Use metric units."}
        asyncio.run(store.apply_feedback(FeedbackRecord.of(before), time.time()))
        _stored_call(store, "later", time.time() + 1)  # made after the correction: not what it was about
        assert {n.text: n.call_id for n in store.memory_notes()}["Use metric units."] is None
        assert query(store.db_path, "SELECT state, reason FROM feedback_events WHERE session_id = 'later'")[0][:] == (
            "orphan", "before_first_call")
        linked = query(store.db_path, "SELECT kind, json_extract(payload, '$.notes'), json_extract(payload, '$.reason') "
                                      "FROM events WHERE kind IN ('memory.linked', 'memory.unlinked') ORDER BY id")
        assert [tuple(r) for r in linked] == [("memory.linked", 1, None), ("memory.linked", 1, None),
                                              ("memory.unlinked", 1, "before_first_call")]
    finally:
        store.close()


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("memory-data"), tiny_model_dir, "--served-model-name", "policy")
    d.start()
    yield d
    d.stop()


def test_notes_reach_the_next_main_call_as_stored_and_can_be_edited_and_forgotten(daemon: DaemonProcess):
    h = {"authorization": f"Bearer {daemon.api_key}"}
    with httpx.Client(base_url=daemon.url, headers=h, timeout=120) as c:
        def ask(session: str, turn: str = "main", **extra: object) -> str:
            r = c.post("/v1/chat/completions", headers={"x-session-id": session, "x-turn-type": turn},
                       json={"model": "policy", "max_tokens": 4, "messages": [
                           {"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}], **extra})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        ask("m1")
        r = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "m1",
                                         "target": "last", "text": "Hmm. Please answer in French."})
        assert r.status_code in (200, 202), r.text
        notes = c.get("/v1/memory").json()
        assert notes["enabled"] and [n["text"] for n in notes["data"]] == ["Please answer in French."]
        assert c.get("/v1/status").json()["memory"]["notes"] == [  # what the extension's /clawback shows
            {"note_id": notes["data"][0]["note_id"], "text": "Please answer in French.", "active": True, "retired_by": None}]

        # A client's own `memory_notes` is not taken for the daemon's: the side call stores none.
        main_id, side_id = ask("m2"), ask("m3", "side", memory_notes=["hi"])
        db = daemon.data_dir / "clawback.db"
        row = wait_for(lambda: query(db, "SELECT request_json, prompt_text FROM calls WHERE call_id = ?", main_id),
                       what="the main call stored")[0]
        served = json.loads(row["request_json"])
        assert served["messages"] == [{"role": "system", "content": "Be kind."},  # stored exactly as served
                                      {"role": "user", "content": "hi\n\nPlease answer in French."}]
        assert served["memory_notes"] == ["Please answer in French."]
        assert "Please answer in French." in row["prompt_text"]
        side = wait_for(lambda: query(db, "SELECT request_json FROM calls WHERE call_id = ?", side_id))[0]
        assert "French" not in side["request_json"], "side calls (titles, summaries) get no notes"
        assert "memory_notes" not in json.loads(side["request_json"])

        note_id = notes["data"][0]["note_id"]
        assert c.put(f"/v1/memory/{note_id}", json={"text": "Answer in German."}).json()["data"][0]["text"] == \
            "Answer in German."
        def served_user(call_id: str) -> str:
            row = wait_for(lambda: query(db, "SELECT request_json FROM calls WHERE call_id = ?", call_id))[0]
            return json.loads(row["request_json"])["messages"][-1]["content"]

        assert served_user(ask("m4")) == "hi\n\nAnswer in German."  # the edit, at once
        assert c.put(f"/v1/memory/{note_id}", json={"text": " "}).status_code == 400
        assert c.put("/v1/memory/9999", json={"text": "x y"}).status_code == 404
        assert c.delete("/v1/memory/9999").status_code == 404

        # A correction about the task stays in its conversation until the person widens it.
        ask("t1")
        r = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "t1",
                                         "target": "last", "text": "Answer with just the number, like: 4."})
        assert r.status_code == 200, r.text
        task = c.get("/v1/memory").json()["data"][-1]
        assert (task["text"], task["scope"], task["session_id"]) == (
            "Answer with just the number, like: 4.", "session", "t1")
        assert served_user(ask("t1")) == "hi\n\nAnswer in German.\nAnswer with just the number, like: 4."
        assert served_user(ask("t2")) == "hi\n\nAnswer in German."
        for bad in ({"scope": "everywhere"}, {"scope": "general", "session_id": "t1"}, {"scope": "session", "x": 1},
                    {"scope": "session", "session_id": "nobody-said-this"}):
            assert c.patch(f"/v1/memory/{task['note_id']}", json=bad).status_code == 400, bad
        assert c.patch("/v1/memory/9999", json={"scope": "general"}).status_code == 404

        cli = [sys.executable, "-m", "clawback.cli", "memory", "--data-dir", str(daemon.data_dir),
               "--url", daemon.url]
        out = subprocess.run([*cli, "list"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "Answer in German." in out.stdout and "2 of at most 8" in out.stdout
        assert "(edit, general)" in out.stdout and "session t1 only" in out.stdout
        out = subprocess.run([*cli, "scope", str(task["note_id"]), "general"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert served_user(ask("t2")) == "hi\n\nAnswer in German.\nAnswer with just the number, like: 4."
        bad = subprocess.run([*cli, "forget"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "needs a note id" in bad.stderr
        out = subprocess.run([*cli, "forget", "all"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and c.get("/v1/memory").json()["data"] == []
        assert served_user(ask("m5")) == "hi"


@pytest.mark.parametrize("placement", ["user", "system"])
def test_strip_and_renote_take_out_exactly_what_inject_put_in(placement: str):
    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    assert strip(inject(msgs, ["Be brief.", "No bold."], placement), ["Be brief.", "No bold."]) == msgs
    bare = [{"role": "user", "content": "hi"}]
    assert strip(inject(bare, ["Be brief."], placement), ["Be brief."]) == bare  # a message inject created goes too
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert strip(inject(parts, ["Be brief."], placement), ["Be brief."]) == parts
    assert strip(msgs, None) == msgs and strip(bare, ["Be brief."]) == bare
    # Only what was appended goes: the person's own line that happens to match a note stays.
    said = [{"role": "user", "content": "Be brief."}, {"role": "assistant", "content": "OK."},
            {"role": "user", "content": "hi"}]
    assert strip(inject(said, ["Be brief."], placement), ["Be brief."]) == said
    # Renoting (a forgotten note taken out of a stored request) leaves what inject of the rest gives.
    for m in (msgs, bare, parts):
        assert renote(inject(m, ["Be brief.", "No bold."], placement), ["Be brief.", "No bold."], ["No bold."]) == \
            inject(m, ["No bold."], placement)


def _adapter_row(store: Store, version: int, parent: int | None) -> None:
    asyncio.run(store.record_step(StepRecord(version, parent, time.time(), "combined", (), "committed",
                                             path=f"/nowhere/v{version}")))


def test_a_retired_note_stays_out_only_while_its_version_or_a_descendant_serves(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    try:
        for version, parent in ((1, None), (2, 1), (3, 2), (4, 1)):  # v4 was trained after a rollback to v1
            _adapter_row(store, version, parent)
        _feedback(store, "correction", "Please answer in French.")
        note = store.memory_notes()[0]
        assert note.active and note.retired_by is None
        assert not asyncio.run(store.retire_note(note.note_id, note.updated_at - 1, 2, {}))  # changed since
        assert asyncio.run(store.retire_note(note.note_id, note.updated_at, 2,
                                             {"version": 2, "gap_live": 0.1, "gap_note": 0.3}))
        active = {live: store.memory_notes(live)[0].active for live in (None, 1, 2, 3, 4)}
        assert active == {None: True, 1: True, 2: False, 3: False, 4: True}
        event = json.loads(query(store.db_path, "SELECT payload FROM events WHERE kind = 'memory.retired'")[0][0])
        assert event == {"version": 2, "gap_live": 0.1, "gap_note": 0.3}  # numbers only: events outlive a forget
        # The person says it again: the version evidently does not follow it, so it is back.
        _feedback(store, "correction", "Please answer in French.")
        assert store.memory_notes(3)[0].active and store.memory_notes(3)[0].retired_by is None
        note = store.memory_notes()[0]
        asyncio.run(store.retire_note(note.note_id, note.updated_at, 3, {}))
        asyncio.run(store.edit_note(note.note_id, "Please answer in German."))  # an edit is a new preference
        assert store.memory_notes(3)[0].active
        asyncio.run(store.retire_note(note.note_id, store.memory_notes()[0].updated_at, 3, {}))
        assert asyncio.run(store.forget_notes()) == 1 and store.memory_notes() == []  # retired notes are forgotten too
    finally:
        store.close()


# ---- retirement on the engine (daemon/retirement.py) ----


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The daemon's own state and app in-process (tiny Llama, no training, no background tasks, so
    nothing judges the samples this test writes), with v1: a LoRA with random weights."""
    from clawback.daemon.config import Settings
    from clawback.daemon.server import build_state, daemon_app

    tmp = tmp_path_factory.mktemp("retire")
    settings = Settings(data_dir=tmp, model=str(tiny_model_dir), device="cpu", no_auth=True, log_level="warning",
                        served_model_name="policy", train={"enabled": False})
    state = build_state(settings)
    path = random_lora(tiny_model_dir, tmp / "adapters", 1)
    asyncio.run(state.store.record_step(StepRecord(1, None, time.time(), "combined", (), "committed", path=str(path))))
    yield state, daemon_app(settings, state)
    asyncio.run(state.engine.close())
    state.store.close()


def test_a_note_the_live_version_follows_without_it_retires_and_a_rollback_brings_it_back(served, monkeypatch):
    state, app = served
    db = state.store.db_path

    async def go() -> None:
        await state.adapters.go_live(1, state.store.adapters()[0].path)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://clawback",
                                     timeout=300) as c:
            async def ask(session: str) -> dict:
                r = await c.post("/v1/chat/completions", headers={"x-session-id": session, "x-turn-type": "main"},
                                 json={"model": "policy", "max_tokens": 6, "temperature": 0, "messages": [
                                     {"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]})
                assert r.status_code == 200, r.text
                await asyncio.to_thread(state.store.flush)
                row = query(db, "SELECT * FROM calls WHERE call_id = ?", r.json()["id"])[0]
                return {"call_id": row["call_id"], "request": json.loads(row["request_json"]),
                        "response_ids": blob_ids(row["response_ids"])}

            async def correct(session: str, text: str) -> None:
                r = await c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "correction",
                                                       "session_id": session, "target": "last", "text": text})
                assert r.status_code in (200, 202), r.text
                await asyncio.to_thread(state.store.flush)

            async def teach(call: dict, prompt: list[dict], version: str | None) -> None:
                """The sample's teacher logprobs: `call`'s reply scored on `prompt` by `version`."""
                req = ChatRequest.model_validate({**call["request"], "messages": prompt})
                teacher = await state.engine.score(state.renderer.render(req)[1], call["response_ids"], version)
                (_, revision), = [p for p in state.store.pending_samples() if p[0] == call["call_id"]]
                assert await state.store.write_sample(JudgedSample(
                    call["call_id"], revision, "ready", method="combined", reward=-1.0, reward_source="explicit",
                    teacher_logprobs=teacher))

            french = await ask("s1")
            await correct("s1", "Hmm. Please answer in French.")
            bold = await ask("s2")  # served with the French note
            await correct("s2", "Don't use bold.")
            assert bold["request"]["memory_notes"] == ["Please answer in French."]
            # French: what v1 gives without any note is what the person wanted there: it retires.
            await teach(french, strip(french["request"]["messages"], None), "v1")
            # Bold: the base model told by the note is exactly what was wanted; v1 alone is not.
            unserved = strip(bold["request"]["messages"], bold["request"]["memory_notes"])
            assert unserved[-1]["content"] == "hi"
            await teach(bold, inject(unserved, ["Don't use bold."]), None)

            reports = await NoteRetirement(state.engine, state.renderer, state.store).check(1)
            by_text = {n.note_id: n.text for n in state.store.memory_notes()}
            result = {by_text[r.note_id]: r for r in reports}
            assert result["Please answer in French."].retired and result["Please answer in French."].gap_live < 1e-4
            assert not result["Don't use bold."].retire and result["Don't use bold."].gap_note < 1e-4
            assert result["Don't use bold."].gap_live > 0.01
            await asyncio.to_thread(state.store.flush)
            events = query(db, "SELECT kind, payload FROM events WHERE kind IN ('memory.retired', 'memory.checked')")
            assert sorted(e["kind"] for e in events) == ["memory.checked", "memory.checked", "memory.retired"]
            assert not any("French" in e["payload"] or "bold" in e["payload"] for e in events)
            assert {json.loads(e["payload"])["retired"] for e in events if e["kind"] == "memory.checked"} == {True, False}

            listed = (await c.get("/v1/memory")).json()
            assert listed["live"] == "v1" and [(n["text"], n["retired_by"], n["active"]) for n in listed["data"]] == [
                ("Please answer in French.", 1, False), ("Don't use bold.", None, True)]
            status = (await c.get("/v1/status")).json()["memory"]["notes"]
            assert [(n["retired_by"], n["active"]) for n in status] == [(1, False), (None, True)]
            assert note_retirement(listed["data"][0], listed["live"]) == ", retired by v1"
            await c.get("/ui/login")  # no API key: a dashboard session at once
            page = (await c.get("/ui/part/memory")).text
            assert page.count("no: retired by v1") == 1 and page.count("<td>yes</td>") == 1
            served_v1 = (await ask("s3"))["request"]["messages"][-1]["content"]
            assert served_v1 == "hi\n\nDon't use bold."  # stored exactly as served

            r = await c.post("/v1/adapters/rollback", json={"version": "base"})
            assert r.status_code == 200, r.text
            served_base = (await ask("s4"))["request"]["messages"][-1]["content"]
            assert served_base == "hi\n\nPlease answer in French.\nDon't use bold."
            listed = (await c.get("/v1/memory")).json()
            assert listed["data"][0]["active"] and note_retirement(listed["data"][0], listed["live"]) == \
                ", retired by v1; injected while base serves"
            assert "yes: retired by v1, base serves" in (await c.get("/ui/part/memory")).text

            # A check that cannot score leaves every note as it was and raises nothing.
            async def broken(*_: object, **__: object) -> list[float]:
                raise EngineError("scoring failed")

            monkeypatch.setattr(state.engine, "score", broken)
            assert await NoteRetirement(state.engine, state.renderer, state.store).check(1) == []
            assert [n.retired_by for n in state.store.memory_notes()] == [1, None]

    asyncio.run(go())
