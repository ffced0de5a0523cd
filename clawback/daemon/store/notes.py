"""Preference-note writes (daemon/memory.py): remember, bound, edit, scope, retire, forget."""

from __future__ import annotations

import time

from .. import memory
from .tx import Tx


class NoteWrites(Tx):
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

    def _write_retire_note(self, note_id: int, updated_at: float, version: int, report: dict[str, float]) -> bool:
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
