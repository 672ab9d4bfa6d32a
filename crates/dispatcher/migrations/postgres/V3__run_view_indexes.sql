-- The run page reads a run's timeline and its log's tail by kind (GET /v1/runs/{id}/timeline),
-- whatever the length of its log; the run list filters by skill.
CREATE INDEX IF NOT EXISTS events_by_run_and_kind ON events(run_id, kind, position);
CREATE INDEX IF NOT EXISTS runs_by_skill ON runs((job::jsonb->>'skill'));
