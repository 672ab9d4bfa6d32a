-- The schema of forgepool 0.1 before migrations existed: every statement is idempotent, so a
-- store made by that release takes it as applied in substance.
CREATE TABLE IF NOT EXISTS runs (
    seq BIGSERIAL UNIQUE,
    run_id TEXT PRIMARY KEY,
    ticket TEXT NOT NULL,
    state TEXT NOT NULL,
    job TEXT NOT NULL,
    result TEXT,
    published BOOLEAN NOT NULL DEFAULT FALSE,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
ALTER TABLE runs ADD COLUMN IF NOT EXISTS execution TEXT;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS last_seen TEXT;
CREATE INDEX IF NOT EXISTS runs_by_state ON runs(state);
CREATE INDEX IF NOT EXISTS runs_by_ticket ON runs(ticket);
CREATE TABLE IF NOT EXISTS events (
    position BIGSERIAL PRIMARY KEY,
    event_id TEXT NOT NULL UNIQUE,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    kind TEXT NOT NULL,
    time TEXT NOT NULL,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events(run_id, position);
CREATE TABLE IF NOT EXISTS state_history (
    id BIGSERIAL PRIMARY KEY,
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    time TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS state_history_by_run ON state_history(run_id, id);
CREATE TABLE IF NOT EXISTS submission_keys (
    key TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS submission_keys_by_age ON submission_keys(created_at);
CREATE TABLE IF NOT EXISTS cycles (
    run_id TEXT NOT NULL REFERENCES runs(run_id),
    step TEXT NOT NULL,
    file TEXT NOT NULL,
    cycle INTEGER NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (run_id, step, file)
);
