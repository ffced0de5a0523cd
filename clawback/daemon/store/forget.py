"""Forgetting: delete what was stored about sessions, scrub their notes elsewhere, rewrite the files."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from clawback.records import Version

from .. import memory
from .schema import ids_blob, link_closure, marks
from .tx import Tx

log = logging.getLogger(__name__)


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



@dataclass(frozen=True)
class Forgotten:
    """What a forget deleted (rows per table), scrubbed elsewhere, which sessions it took and
    the adapter versions trained on any of it."""

    deleted: dict[str, int]
    scrubbed: dict[str, int]
    sessions: list[str]
    trained_versions: list[int]


class ForgetWrites(Tx):
    def _write_forget(self, scope: ForgetScope) -> Forgotten:
        c = self._conn
        c.execute("CREATE TEMP TABLE IF NOT EXISTS forget(session_id TEXT PRIMARY KEY)")
        c.execute("DELETE FROM temp.forget")
        if scope.everything:
            c.execute("INSERT INTO temp.forget SELECT session_id FROM sessions UNION SELECT session_id FROM "
                      "feedback_events UNION SELECT from_session FROM session_links UNION SELECT to_session FROM session_links")
        elif scope.session_id is not None:
            c.executemany("INSERT INTO temp.forget VALUES (?)", [(x,) for x in link_closure(c, scope.session_id)])
        else:
            c.execute("INSERT INTO temp.forget SELECT session_id FROM sessions WHERE last_seen_at < ?", (scope.before,))
        sessions = [r[0] for r in c.execute("SELECT session_id FROM temp.forget")]
        in_s = "IN (SELECT session_id FROM temp.forget)"
        in_c = f"IN (SELECT call_id FROM calls WHERE session_id {in_s})"
        trained: list[int] = sorted(v for (name,) in c.execute(
            f"SELECT DISTINCT consumed_version FROM samples WHERE consumed_version IS NOT NULL AND call_id {in_c}")
            if (v := Version.of(name)) is not None)
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
            gone = {r[0] for r in c.execute(f"DELETE FROM memory_notes WHERE note_id IN ({marks(touched)}) "
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
        return Forgotten(deleted, scrubbed, sessions, trained)

    def _scrub_notes(self, texts: list[str], forgotten: str) -> tuple[dict[str, int], list[Version]]:
        """Take the notes `texts` out of the stored main calls outside the `forgotten` sessions that
        were served with them: the request (messages and `memory_notes`) and the rendered prompt are
        rewritten as if the rest had been served. The prompt's token ids cannot be re-tokenised
        here, so they are emptied, and a sample of such a call that is not trained yet is dropped
        (`forgotten_note`; `_want_sample` queues none again); the teacher's prompt goes from every
        sample. Returns the counts and the versions trained on such a call."""
        c = self._conn
        rows = c.execute(
            "SELECT DISTINCT c.call_id, c.request_json, c.prompt_text FROM calls c, json_each(c.request_json, '$.memory_notes') j "
            f"WHERE c.session_id NOT {forgotten} AND j.value IN ({marks(texts)})", texts).fetchall()
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
        in_calls = f"IN ({marks(calls)})"
        tainted = [v for (name,) in c.execute(
            f"SELECT DISTINCT consumed_version FROM samples WHERE consumed_version IS NOT NULL AND call_id {in_calls}",
            calls) if (v := Version.of(name)) is not None]
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
