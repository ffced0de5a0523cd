-- A preference note's scope: NULL when it is about replies in general (injected into every main
-- call), else the session whose task it is about (injected only into that conversation's calls).
-- Notes from before are general, as they were served. A topic is unique within its scope.
ALTER TABLE memory_notes ADD COLUMN session_id TEXT;
-- The feedback event a note was last learnt from: a correction stored before its call (an orphan)
-- gives its notes their call when that call arrives.
ALTER TABLE memory_notes ADD COLUMN event_id TEXT;
DROP INDEX memory_notes_topic;
CREATE UNIQUE INDEX memory_notes_topic ON memory_notes(topic, coalesce(session_id, ''));
CREATE INDEX memory_notes_event ON memory_notes(event_id);
