-- Sessions, served calls, next states, and the append-only event log.
CREATE TABLE sessions (
    session_id    TEXT PRIMARY KEY,
    created_at    REAL NOT NULL,
    last_seen_at  REAL NOT NULL,
    state         TEXT NOT NULL DEFAULT 'open',       -- open | closed
    closed_at     REAL,
    closed_reason TEXT                                -- session_done | idle_timeout
);

CREATE TABLE calls (
    call_id             TEXT PRIMARY KEY,
    session_id          TEXT NOT NULL,
    turn_id             TEXT,
    request_id          TEXT NOT NULL,
    turn_type           TEXT NOT NULL,                -- main | side
    state               TEXT NOT NULL,                -- served | awaiting_next_state | paired | closed_without_next_state
    created_at          REAL NOT NULL,
    finished_at         REAL NOT NULL,
    model               TEXT NOT NULL,
    adapter_version     TEXT,                         -- NULL = base model
    request_json        TEXT NOT NULL,                -- the OpenAI request body as received
    prompt_text         TEXT NOT NULL,
    prompt_ids          BLOB NOT NULL,                -- int32 little-endian
    response_ids        BLOB NOT NULL,                -- int32, exactly as sampled
    behaviour_logprobs  BLOB NOT NULL,                -- float32, temperature-1 logprobs of response_ids
    response_text       TEXT NOT NULL,
    tool_calls_json     TEXT,
    finish_reason       TEXT NOT NULL,
    timings_json        TEXT NOT NULL
);

CREATE TABLE next_states (
    call_id        TEXT PRIMARY KEY REFERENCES calls(call_id),
    next_call_id   TEXT NOT NULL,                     -- the main call that brought it
    messages_json  TEXT NOT NULL,                     -- every new trailing message (user reply, tool results)
    roles          TEXT NOT NULL,                     -- comma-separated roles of those messages
    reply_matched  INTEGER NOT NULL,                  -- 1 if the history echoes our reply unchanged
    created_at     REAL NOT NULL
);

CREATE TABLE events (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    ts          REAL NOT NULL,
    kind        TEXT NOT NULL,
    subject_id  TEXT,
    payload     TEXT NOT NULL DEFAULT '{}'
);
