//! What the store keeps for the trackers (SPEC 17, migration `V6__trackers.sql`): the
//! deliveries of the last 24 hours, and the claims (one per issue and trigger, naming its run
//! and the run's live comment). Each change is one statement, so two dispatcher replicas
//! racing for the same claim or delivery get one winner.

use rusqlite::{params, OptionalExtension};
use uuid::Uuid;

use super::{Store, StoreError};

/// How long a delivery id is remembered.
pub const DELIVERY_MEMORY_SECONDS: i64 = 24 * 3600;

/// One claim: a trigger on an issue, and what it started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The tracker's name.
    pub tracker: String,
    /// `{issue}#label` or `{issue}#comment:{id}`.
    pub claim: String,
    /// The issue (`owner/name#number`).
    pub issue: String,
    /// The run it started.
    pub run_id: Uuid,
    /// The run's live comment, once written.
    pub comment_id: Option<u64>,
    /// Whether the comment holds the run's final state.
    pub finished: bool,
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

const COLUMNS: &str = "tracker, claim, issue, run_id, comment_id, finished";

fn sqlite_claim(row: &rusqlite::Row<'_>) -> rusqlite::Result<Claim> {
    Ok(Claim {
        tracker: row.get(0)?,
        claim: row.get(1)?,
        issue: row.get(2)?,
        run_id: row
            .get::<_, String>(3)?
            .parse()
            .unwrap_or_else(|_| Uuid::nil()),
        comment_id: row.get::<_, Option<i64>>(4)?.map(|id| id as u64),
        finished: row.get(5)?,
    })
}

fn postgres_claim(row: &tokio_postgres::Row) -> Claim {
    Claim {
        tracker: row.get(0),
        claim: row.get(1),
        issue: row.get(2),
        run_id: row
            .get::<_, String>(3)
            .parse()
            .unwrap_or_else(|_| Uuid::nil()),
        comment_id: row.get::<_, Option<i64>>(4).map(|id| id as u64),
        finished: row.get(5),
    }
}

impl Store {
    /// Records a delivery; `true` when it was already seen in the last 24 hours.
    pub async fn tracker_delivery_seen(
        &self,
        tracker: &str,
        delivery: &str,
    ) -> Result<bool, StoreError> {
        let (tracker, delivery, at) = (tracker.to_string(), delivery.to_string(), now());
        let cutoff = at - DELIVERY_MEMORY_SECONDS;
        // A delivery older than the memory counts as new (its row is taken over).
        const SQL: &str =
            "INSERT INTO tracker_deliveries (tracker, delivery, seen_at) VALUES ($1, $2, $3)
             ON CONFLICT (tracker, delivery) DO UPDATE SET seen_at = excluded.seen_at
             WHERE tracker_deliveries.seen_at < $4";
        const PRUNE: &str = "DELETE FROM tracker_deliveries WHERE seen_at < $1";
        let prune = at % 64 == 0;
        let changed = match self {
            Store::Sqlite(s) => {
                s.with(move |c| {
                    if prune {
                        c.execute(&PRUNE.replace('$', "?"), params![cutoff])?;
                    }
                    Ok(c.execute(
                        &SQL.replace('$', "?"),
                        params![tracker, delivery, at, cutoff],
                    )? as u64)
                })
                .await?
            }
            Store::Postgres(s) => {
                s.bounded(async {
                    let client = s.client().await?;
                    if prune {
                        client.execute(PRUNE, &[&cutoff]).await?;
                    }
                    Ok(client
                        .execute(SQL, &[&tracker, &delivery, &at, &cutoff])
                        .await?)
                })
                .await?
            }
        };
        Ok(changed == 0)
    }

    /// Forgets a delivery that was not taken (the queue was full), so that its redelivery is
    /// worked on.
    pub async fn tracker_delivery_forget(
        &self,
        tracker: &str,
        delivery: &str,
    ) -> Result<(), StoreError> {
        const SQL: &str = "DELETE FROM tracker_deliveries WHERE tracker = $1 AND delivery = $2";
        let (tracker, delivery) = (tracker.to_string(), delivery.to_string());
        match self {
            Store::Sqlite(s) => {
                s.with(move |c| {
                    c.execute(&SQL.replace('$', "?"), params![tracker, delivery])?;
                    Ok(())
                })
                .await
            }
            Store::Postgres(s) => {
                s.bounded(async {
                    let client = s.client().await?;
                    client.execute(SQL, &[&tracker, &delivery]).await?;
                    Ok(())
                })
                .await
            }
        }
    }

    /// Stores a claim unless one for the same trigger exists; whether this one was stored.
    pub async fn tracker_claim(&self, claim: &Claim) -> Result<bool, StoreError> {
        const SQL: &str = "INSERT INTO tracker_claims (tracker, claim, issue, run_id, created_at)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT (tracker, claim) DO NOTHING";
        let (tracker, key, issue, run) = (
            claim.tracker.clone(),
            claim.claim.clone(),
            claim.issue.clone(),
            claim.run_id.to_string(),
        );
        let at = now();
        let changed = match self {
            Store::Sqlite(s) => {
                s.with(move |c| {
                    Ok(c.execute(
                        &SQL.replace('$', "?"),
                        params![tracker, key, issue, run, at],
                    )? as u64)
                })
                .await?
            }
            Store::Postgres(s) => {
                s.bounded(async {
                    let client = s.client().await?;
                    Ok(client
                        .execute(SQL, &[&tracker, &key, &issue, &run, &at])
                        .await?)
                })
                .await?
            }
        };
        Ok(changed == 1)
    }

    /// The claim of a trigger, if any.
    pub async fn tracker_claim_of(
        &self,
        tracker: &str,
        claim: &str,
    ) -> Result<Option<Claim>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM tracker_claims WHERE tracker = $1 AND claim = $2");
        let (tracker, claim) = (tracker.to_string(), claim.to_string());
        match self {
            Store::Sqlite(s) => {
                s.with(move |c| {
                    Ok(c.query_row(
                        &sql.replace('$', "?"),
                        params![tracker, claim],
                        sqlite_claim,
                    )
                    .optional()?)
                })
                .await
            }
            Store::Postgres(s) => {
                s.bounded(async {
                    let client = s.client().await?;
                    let row = client.query_opt(&sql, &[&tracker, &claim]).await?;
                    Ok(row.as_ref().map(postgres_claim))
                })
                .await
            }
        }
    }

    /// The claims of an issue, oldest first; or, with `issue` `None`, every claim whose
    /// comment is not final yet.
    pub async fn tracker_claims(
        &self,
        tracker: Option<&str>,
        issue: Option<&str>,
    ) -> Result<Vec<Claim>, StoreError> {
        let sql = match issue {
            Some(_) => format!(
                "SELECT {COLUMNS} FROM tracker_claims WHERE tracker = $1 AND issue = $2 ORDER BY created_at, claim"
            ),
            None => format!(
                "SELECT {COLUMNS} FROM tracker_claims WHERE finished = FALSE ORDER BY created_at LIMIT 10000"
            ),
        };
        let (tracker, issue) = (tracker.unwrap_or("").to_string(), issue.map(str::to_string));
        match self {
            Store::Sqlite(s) => {
                s.with(move |c| {
                    let mut statement = c.prepare(&sql.replace('$', "?"))?;
                    let rows = match &issue {
                        Some(issue) => statement
                            .query_map(params![tracker, issue], sqlite_claim)?
                            .collect::<Result<Vec<_>, _>>()?,
                        None => statement
                            .query_map([], sqlite_claim)?
                            .collect::<Result<Vec<_>, _>>()?,
                    };
                    Ok(rows)
                })
                .await
            }
            Store::Postgres(s) => {
                s.bounded(async {
                    let client = s.client().await?;
                    let rows = match &issue {
                        Some(issue) => client.query(&sql, &[&tracker, issue]).await?,
                        None => client.query(&sql, &[]).await?,
                    };
                    Ok(rows.iter().map(postgres_claim).collect())
                })
                .await
            }
        }
    }

    /// Records a claim's live comment, and whether it now holds the run's final state.
    pub async fn tracker_comment(
        &self,
        claim: &Claim,
        comment_id: u64,
        finished: bool,
    ) -> Result<(), StoreError> {
        const SQL: &str =
            "UPDATE tracker_claims SET comment_id = $3, finished = $4 WHERE tracker = $1 AND claim = $2";
        let (tracker, key, id) = (
            claim.tracker.clone(),
            claim.claim.clone(),
            comment_id as i64,
        );
        match self {
            Store::Sqlite(s) => {
                s.with(move |c| {
                    c.execute(&SQL.replace('$', "?"), params![tracker, key, id, finished])?;
                    Ok(())
                })
                .await
            }
            Store::Postgres(s) => {
                s.bounded(async {
                    let client = s.client().await?;
                    client
                        .execute(SQL, &[&tracker, &key, &id, &finished])
                        .await?;
                    Ok(())
                })
                .await
            }
        }
    }
}
