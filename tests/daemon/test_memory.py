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

from clawback.daemon.memory import HEADER, inject, notes_from, topic
from clawback.daemon.store import Store
from tests.conftest import DaemonProcess, query, wait_for


def test_notes_are_the_request_sentences_of_a_correction():
    assert notes_from("Hmm. Please start your reply with 'Sure!'.  Thanks") == (["Please start your reply with 'Sure!'."], 0)
    # What went wrong is not what to do: the complaint and "It was cut off." are skipped, counted.
    assert notes_from("That looks AI-written. It was cut off. Don't use bold. Next time, keep it short.") == (
        ["Don't use bold.", "Next time, keep it short."], 2)
    assert notes_from("That comment is not what I need. I'd like shorter replies. No bold. No, that is wrong.") == (
        ["I'd like shorter replies.", "No bold."], 2)
    assert topic("Please use bold.") == topic("Don't use bold, please.")  # a reversal is the same topic
    assert topic("Please use bold.") != topic("Please use headers.")
    assert notes_from("   ") == ([], 0)


def test_injection_goes_into_the_system_prompt_and_leaves_the_input_alone():
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}]
    out = inject(msgs, ["Be brief.", "No bold."])
    assert out[0]["content"] == f"You are helpful.\n\n{HEADER}\n- Be brief.\n- No bold."
    assert out[1:] == msgs[1:] and msgs[0]["content"] == "You are helpful."
    assert inject([{"role": "user", "content": "hi"}], ["Be brief."])[0]["role"] == "system"
    assert inject(msgs, []) is msgs


def _feedback(store: Store, kind: str, text: str | None) -> None:
    ev = {"event_id": str(uuid.uuid4()), "kind": kind, "session_id": "nobody", "target": "last", "text": text}
    asyncio.run(store.apply_feedback(ev, time.time()))


def test_store_dedupes_replaces_on_conflict_and_stays_bounded(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite", memory_max_notes=3)
    try:
        _feedback(store, "correction", "That looks AI-written. Please don't use bold.")
        _feedback(store, "correction", "That looks AI-written. Please don't use headers.")
        _feedback(store, "correction", "Keep it short.")
        assert [n["text"] for n in store.memory_notes()] == [
            "Please don't use bold.", "Please don't use headers.", "Keep it short."]
        skipped = store._conn.execute("SELECT COUNT(*) FROM events WHERE kind = 'memory.skipped'").fetchone()[0]
        assert skipped == 2  # the complaint, once per correction
        _feedback(store, "thumbs_down", "Actually, please use bold.")  # a 👎 reason; newest wins
        texts = [n["text"] for n in store.memory_notes()]
        assert "Please don't use bold." not in texts and "Actually, please use bold." in texts and len(texts) == 3
        _feedback(store, "thumbs_up", "Nice one, well done.")  # praise is not a preference
        _feedback(store, "correction", "Answer in one sentence.")  # bounded: the stalest note goes
        assert len(store.memory_notes()) == 3 and "Please don't use headers." not in [
            n["text"] for n in store.memory_notes()]
        first = store.memory_notes()[0]["note_id"]
        assert asyncio.run(store.edit_note(first, "  Keep   it brief. "))
        assert asyncio.run(store.forget_notes(999)) == 0
        assert store.memory_notes()[0]["text"] == "Keep it brief." and store.memory_notes()[0]["source"] == "edit"
        assert asyncio.run(store.forget_notes()) == 3 and store.memory_notes() == []
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
        def ask(session: str, turn: str = "main") -> str:
            r = c.post("/v1/chat/completions", headers={"x-session-id": session, "x-turn-type": turn},
                       json={"model": "policy", "max_tokens": 4, "messages": [
                           {"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        ask("m1")
        r = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "m1",
                                         "target": "last", "text": "Hmm. Please answer in French."})
        assert r.status_code in (200, 202), r.text
        notes = c.get("/v1/memory").json()
        assert notes["enabled"] and [n["text"] for n in notes["data"]] == ["Please answer in French."]
        assert c.get("/v1/status").json()["memory"]["notes"] == [  # what the extension's /clawback shows
            {"note_id": notes["data"][0]["note_id"], "text": "Please answer in French."}]

        main_id, side_id = ask("m2"), ask("m3", "side")
        db = daemon.data_dir / "clawback.db"
        row = wait_for(lambda: query(db, "SELECT request_json, prompt_text FROM calls WHERE call_id = ?", main_id),
                       what="the main call stored")[0]
        system = json.loads(row["request_json"])["messages"][0]["content"]
        assert system == f"Be kind.\n\n{HEADER}\n- Please answer in French."  # stored exactly as served
        assert "Please answer in French." in row["prompt_text"]
        side = wait_for(lambda: query(db, "SELECT request_json FROM calls WHERE call_id = ?", side_id))[0]
        assert "French" not in side["request_json"], "side calls (titles, summaries) get no notes"

        note_id = notes["data"][0]["note_id"]
        assert c.put(f"/v1/memory/{note_id}", json={"text": "Answer in German."}).json()["data"][0]["text"] == \
            "Answer in German."
        def served_system(call_id: str) -> str:
            row = wait_for(lambda: query(db, "SELECT request_json FROM calls WHERE call_id = ?", call_id))[0]
            return json.loads(row["request_json"])["messages"][0]["content"]

        assert served_system(ask("m4")) == f"Be kind.\n\n{HEADER}\n- Answer in German."  # the edit, at once
        assert c.put(f"/v1/memory/{note_id}", json={"text": " "}).status_code == 400
        assert c.put("/v1/memory/9999", json={"text": "x y"}).status_code == 404
        assert c.delete("/v1/memory/9999").status_code == 404

        cli = [sys.executable, "-m", "clawback.cli", "memory", "--data-dir", str(daemon.data_dir),
               "--url", daemon.url]
        out = subprocess.run([*cli, "list"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "Answer in German." in out.stdout and "1 of at most 8" in out.stdout
        bad = subprocess.run([*cli, "forget"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and "needs a note id" in bad.stderr
        out = subprocess.run([*cli, "forget", "all"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and c.get("/v1/memory").json()["data"] == []
        assert served_system(ask("m5")) == "Be kind."
