-- How much of each profile's daily budget the dispatcher has allotted to the pool's gateways
-- on each UTC day (SPEC 16, proto::allotment): a day past is never read again.
CREATE TABLE IF NOT EXISTS daily_allotments (
    profile TEXT NOT NULL,
    day TEXT NOT NULL,
    tokens INTEGER NOT NULL DEFAULT 0,
    cost_usd REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (profile, day)
);
