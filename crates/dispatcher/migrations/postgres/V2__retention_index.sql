-- Retention reads runs that ended by their last change (forgepool prune, FORGEPOOL_RETAIN_*).
CREATE INDEX IF NOT EXISTS runs_by_state_and_change ON runs(state, updated_at);
