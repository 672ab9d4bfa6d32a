-- Trackers (SPEC 17). The deliveries seen in the last 24 hours, so that a redelivery does
-- nothing; and the claims, one per issue and trigger ("label", "comment:{id}"), each naming
-- the run it started and the run's live comment, so that webhook, redelivery and poll start
-- one run, also across dispatcher restarts and replicas.
CREATE TABLE IF NOT EXISTS tracker_deliveries (
    tracker TEXT NOT NULL,
    delivery TEXT NOT NULL,
    seen_at BIGINT NOT NULL,
    PRIMARY KEY (tracker, delivery)
);
CREATE TABLE IF NOT EXISTS tracker_claims (
    tracker TEXT NOT NULL,
    claim TEXT NOT NULL,
    issue TEXT NOT NULL,
    run_id TEXT NOT NULL,
    comment_id BIGINT,
    finished BOOLEAN NOT NULL DEFAULT FALSE,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tracker, claim)
);
CREATE INDEX IF NOT EXISTS tracker_claims_issue ON tracker_claims (tracker, issue);
CREATE INDEX IF NOT EXISTS tracker_claims_unfinished ON tracker_claims (finished);
