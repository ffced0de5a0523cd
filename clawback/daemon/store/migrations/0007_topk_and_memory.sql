-- The policy's top-K tokens per response position (top-K OPD), the sampling distribution's
-- logprobs (importance weights against what was really sampled), the teacher's logprobs of the
-- top-K, the teacher's own hinted reply (positive evidence), and the person's preference notes.
ALTER TABLE calls ADD COLUMN sampling_logprobs BLOB;     -- float32 per response token: logprob under the distribution it was drawn from (temperature, top-p); NULL = greedy
ALTER TABLE calls ADD COLUMN top_ids BLOB;               -- int32 T x K: the policy's K most likely tokens at each response position
ALTER TABLE calls ADD COLUMN top_logprobs BLOB;          -- float32 T x K: their temperature-1 logprobs
ALTER TABLE samples ADD COLUMN teacher_top_logprobs BLOB; -- float32 T x K: the teacher's logprobs of calls.top_ids
ALTER TABLE samples ADD COLUMN evidence_ids BLOB;         -- int32: the teacher's own reply under the hint (positive evidence)
ALTER TABLE samples ADD COLUMN evidence_logprobs BLOB;    -- float32: the policy's logprobs of evidence_ids without the hint

CREATE TABLE memory_notes (
    note_id     INTEGER PRIMARY KEY AUTOINCREMENT,
    text        TEXT NOT NULL,
    topic       TEXT NOT NULL,                  -- normalised key: a newer note on the same topic replaces it
    source      TEXT NOT NULL,                  -- correction | thumbs_down | edit
    call_id     TEXT,                           -- the reply it was learned from (NULL for an edit)
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL
);
CREATE UNIQUE INDEX memory_notes_topic ON memory_notes(topic);
