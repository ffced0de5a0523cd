-- Who asked for each preference note: every session whose correction or 👎 made it or confirmed
-- it. Forgetting a session takes it off its notes; a note goes once no session that asked for it
-- is left (an orphan correction, sent before its session's first call, counts for that session).
CREATE TABLE note_sources (
    note_id     INTEGER NOT NULL,
    session_id  TEXT NOT NULL,
    PRIMARY KEY (note_id, session_id)
);
CREATE INDEX note_sources_session ON note_sources(session_id);
INSERT OR IGNORE INTO note_sources SELECT n.note_id, c.session_id FROM memory_notes n JOIN calls c ON c.call_id = n.call_id;

-- The event log outlives a forget, so it never names a session: the names go from older rows.
DROP TRIGGER events_no_update;
UPDATE events SET payload = json_remove(payload, '$.session_id') WHERE kind LIKE 'call.%' AND json_valid(payload);
UPDATE events SET subject_id = NULL WHERE kind IN ('session.closed', 'session.reopened', 'session.linked');
UPDATE events SET payload = json_remove(payload, '$.from') WHERE kind = 'session.linked' AND json_valid(payload);
CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
