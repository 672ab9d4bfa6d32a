-- The schema of forgepool 0.1 before migrations existed. Every statement is "IF NOT EXISTS",
-- so a store made by that release takes this migration as already applied in substance; the
-- two columns it added later by hand (execution, last_seen) are checked by the code that runs
-- the migrations, since SQLite has no ADD COLUMN IF NOT EXISTS.
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    ticket TEXT NOT NULL,
    state TEXT NOT NULL,
    job TEXT NOT NULL,
    result TEXT,
    published INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    execution TEXT,
    last_seen TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_state ON runs(state);
CREATE TABLE IF NOT EXISTS events (
    position INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    kind TEXT NOT NULL,
    time TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id, position);
CREATE TABLE IF NOT EXISTS state_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    time TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS submission_keys (
    key TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS state_history_by_run ON state_history(run_id, id);
CREATE INDEX IF NOT EXISTS submission_keys_by_age ON submission_keys(created_at);
CREATE TABLE IF NOT EXISTS cycles (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    step TEXT NOT NULL,
    file TEXT NOT NULL,
    cycle INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (run_id, step, file)
);
