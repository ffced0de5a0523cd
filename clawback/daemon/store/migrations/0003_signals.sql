-- Feedback events, session links, judge votes and training samples.
CREATE TABLE feedback_events (
    event_id     TEXT PRIMARY KEY,                  -- the client's idempotency key
    kind         TEXT NOT NULL,                     -- thumbs_up | thumbs_down | correction | comment | session_end | session_link
    session_id   TEXT NOT NULL,
    target       TEXT,                              -- turn id | request id | 'last'
    text         TEXT,
    source       TEXT NOT NULL,                     -- channel: telegram, discord, webchat, cli, ...
    ts           REAL,                              -- client time
    received_at  REAL NOT NULL,
    state        TEXT NOT NULL,                     -- applied | orphan
    call_id      TEXT,                              -- the resolved target call
    reason       TEXT,                              -- why it is an orphan
    payload      TEXT NOT NULL                      -- the event as received
);
CREATE INDEX feedback_call ON feedback_events(call_id);
CREATE INDEX feedback_orphans ON feedback_events(state, session_id);

CREATE TABLE session_links (
    from_session TEXT NOT NULL,
    to_session   TEXT NOT NULL,
    created_at   REAL NOT NULL,
    PRIMARY KEY (from_session, to_session)
);
CREATE INDEX session_links_to ON session_links(to_session);

CREATE TABLE votes (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    call_id         TEXT NOT NULL,
    kind            TEXT NOT NULL,                  -- prm | hint
    backend         TEXT NOT NULL,
    prompt_version  TEXT NOT NULL,
    score           INTEGER,                        -- NULL = failed vote
    hint            TEXT,
    raw             TEXT,
    error           TEXT,
    created_at      REAL NOT NULL
);
CREATE INDEX votes_call ON votes(call_id);

CREATE TABLE samples (
    call_id             TEXT PRIMARY KEY REFERENCES calls(call_id),
    state               TEXT NOT NULL,              -- pending_judge | ready | consumed | dropped
    reason              TEXT,                       -- why dropped
    revision            INTEGER NOT NULL DEFAULT 0, -- bumped by every new signal; a stale judge result is not written
    method              TEXT,                       -- binary | opd | combined
    reward              REAL,
    reward_source       TEXT,                       -- explicit | judge | none
    judge_score         INTEGER,
    hint                TEXT,
    hint_source         TEXT,                       -- correction | next_state | correction_raw
    correction          TEXT,                       -- the person's raw correction, kept beside the hint
    teacher             TEXT,                       -- self | base
    teacher_adapter     TEXT,
    teacher_messages    TEXT,                       -- json: the request with the hint appended
    teacher_prompt_ids  BLOB,
    teacher_logprobs    BLOB,
    consumed_version    TEXT,
    created_at          REAL NOT NULL,
    updated_at          REAL NOT NULL
);
CREATE INDEX samples_state ON samples(state, created_at);
