-- Query paths used by pairing, the idle sweep and export; and the audit log made append-only.
CREATE INDEX calls_session ON calls(session_id, created_at);
CREATE INDEX calls_created ON calls(created_at);
CREATE INDEX sessions_open ON sessions(state, last_seen_at);
CREATE INDEX events_subject ON events(subject_id);

CREATE TRIGGER events_no_update BEFORE UPDATE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER events_no_delete BEFORE DELETE ON events
BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
