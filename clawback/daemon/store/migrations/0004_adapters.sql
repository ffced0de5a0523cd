-- Adapter versions and training steps.
CREATE TABLE adapters (
    version     INTEGER PRIMARY KEY,                -- served as "v{version}"
    parent      INTEGER,                            -- NULL = trained from the base model
    path        TEXT NOT NULL,
    state       TEXT NOT NULL,                      -- committed | live | retired | failed | pruned
    reason      TEXT,                               -- why failed
    pinned      INTEGER NOT NULL DEFAULT 0,         -- kept by retention whatever its age
    method      TEXT,
    samples     INTEGER NOT NULL DEFAULT 0,
    metrics     TEXT NOT NULL DEFAULT '{}',         -- loss, clip fraction, drift, timings, ...
    created_at  REAL NOT NULL,
    live_at     REAL,
    updated_at  REAL NOT NULL
);

CREATE TABLE train_steps (
    step         INTEGER PRIMARY KEY AUTOINCREMENT,
    version      INTEGER,                           -- the version it produced (NULL if it failed)
    parent       INTEGER,
    started_at   REAL NOT NULL,
    finished_at  REAL NOT NULL,
    samples      INTEGER NOT NULL,
    outcome      TEXT NOT NULL,                     -- committed | failed
    error        TEXT,
    metrics      TEXT NOT NULL DEFAULT '{}'
);
