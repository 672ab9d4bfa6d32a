-- How many times a run's execution was lost (its worker died, or lost the broker, while it
-- held the job), the highest count a worker reported (proto::ExecutionQuery::lost): the
-- dispatcher fails the run at proto::MAX_LOST_EXECUTIONS.
ALTER TABLE runs ADD COLUMN lost_executions INTEGER NOT NULL DEFAULT 0;
