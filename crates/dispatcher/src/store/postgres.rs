//! The PostgreSQL run store, for a dispatcher whose `FORGEPOOL_DATABASE_URL` is a
//! `postgres://` URL. Connections come from a bounded pool; every operation, including waiting
//! for a connection, is bounded by [`OPERATION_TIMEOUT`].
//!
//! Events are inserted under a transaction-scoped advisory lock, so their positions commit in
//! order and a Server-Sent Events reader that asks for "everything after position N" never
//! skips one that committed late.

use std::future::Future;
use std::time::Duration;

use deadpool_postgres::{Pool, Runtime};
use proto::allotment::Spend;
use proto::{Event, EventKind, Job, RunState, RunSummary};
use uuid::Uuid;

use super::{
    Prune, Pruned, Recorded, RunFilter, RunRecord, RunStore, StoreError, PRUNE_EVENTS_BATCH,
    PRUNE_RUNS_BATCH, TERMINAL_STATES_SQL,
};

/// The longest any store operation may take, waiting for a connection included.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections kept open at most.
const POOL_SIZE: usize = 8;
/// The advisory lock that serialises creating the schema between dispatchers starting at once.
const SCHEMA_LOCK: i64 = 0x6670_7363_6865_6d61;
/// How long opening waits for a database that is still starting.
const OPEN_PATIENCE: Duration = Duration::from_secs(30);

/// The schema, as versioned migrations (`migrations/postgres`, refinery): a store made by an
/// earlier release is brought up to this one when it is opened, and its table
/// `refinery_schema_history` says which have run.
mod migrations {
    refinery::embed_migrations!("migrations/postgres");
}
mod counts;

/// How long the migrations of one start may take (an index on a big table takes a while).
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(600);

/// The PostgreSQL run store.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    target: String,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects to `url` and creates the tables when needed. A database that is still starting
    /// is waited for up to 30 s.
    pub async fn open(url: &str, schema: super::Schema) -> Result<PostgresStore, StoreError> {
        let target = proto::amqp::redact_url(url);
        let failed = |reason: String| StoreError::Open {
            target: target.clone(),
            reason,
        };
        let manager = super::tls::manager(url).map_err(&failed)?;
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(OPERATION_TIMEOUT))
            .create_timeout(Some(Duration::from_secs(5)))
            .recycle_timeout(Some(Duration::from_secs(5)))
            .build()
            .map_err(|e| failed(e.to_string()))?;
        let store = PostgresStore {
            pool,
            target: target.clone(),
        };
        let started = std::time::Instant::now();
        loop {
            let ready = match schema {
                super::Schema::Migrate => store.create_schema().await,
                super::Schema::Migrated => store.client().await.map(drop),
            };
            match ready {
                Ok(()) => return Ok(store),
                Err(error)
                    if started.elapsed() < OPEN_PATIENCE && super::tls::worth_waiting(&error) =>
                {
                    tracing::warn!(%error, target = %target, "PostgreSQL not ready yet; retrying");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(error) => return Err(failed(error.to_string())),
            }
        }
    }

    /// Brings the schema up to this release's, within [`MIGRATION_TIMEOUT`] (not the usual
    /// operation bound: a migration of a big store takes longer).
    async fn create_schema(&self) -> Result<(), StoreError> {
        {
            let mut client = self.client().await?;
            // Dispatchers starting at once migrate one after the other.
            client
                .execute("SELECT pg_advisory_lock($1)", &[&SCHEMA_LOCK])
                .await?;
            let migrated = tokio::time::timeout(
                MIGRATION_TIMEOUT,
                migrations::migrations::runner().run_async(&mut **client),
            )
            .await;
            let _ = client
                .execute("SELECT pg_advisory_unlock($1)", &[&SCHEMA_LOCK])
                .await;
            match migrated {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(error)) => Err(StoreError::Migration(error.to_string())),
                Err(_) => Err(StoreError::Migration(format!(
                    "not done within {MIGRATION_TIMEOUT:?}"
                ))),
            }
        }
    }

    pub(super) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| match e {
            // The server's own answer (a refused login, a certificate) keeps its cause.
            deadpool_postgres::PoolError::Backend(error) => StoreError::Postgres(error),
            other => StoreError::Unavailable(format!("no connection to {}: {other}", self.target)),
        })
    }

    /// Events as `query` selects them: `(position, body)` rows, decoded.
    async fn read_events(
        &self,
        query: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<(i64, Event)>, StoreError> {
        self.bounded(async {
            let rows = self.client().await?.query(query, params).await?;
            rows.iter()
                .map(|r| {
                    Ok((
                        r.get::<_, i64>(0),
                        serde_json::from_str(r.get::<_, &str>(1))?,
                    ))
                })
                .collect()
        })
        .await
    }

    pub(super) async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(OPERATION_TIMEOUT, work)
            .await
            .unwrap_or_else(|_| {
                Err(StoreError::Unavailable(format!(
                    "{} did not answer within {OPERATION_TIMEOUT:?}",
                    self.target
                )))
            })
    }
}

impl RunStore for PostgresStore {
    async fn insert_run_once(
        &self,
        job: &Job,
        key: Option<&str>,
    ) -> Result<Option<Uuid>, StoreError> {
        let body = serde_json::to_string(job)?;
        let run_id = job.run_id.to_string();
        let reason = super::accepted_reason(job);
        let cutoff = super::key_cutoff();
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            if let Some(key) = key {
                tx.execute(
                    "DELETE FROM submission_keys WHERE created_at < $1",
                    &[&cutoff],
                )
                .await?;
                // A concurrent submission with the same key waits here for the first to commit.
                let fresh = tx
                    .execute(
                        "INSERT INTO submission_keys (key, run_id, created_at) VALUES ($1, $2, $3)
                         ON CONFLICT (key) DO NOTHING",
                        &[&key, &run_id, &job.submitted_at],
                    )
                    .await?;
                if fresh == 0 {
                    let first: String = tx
                        .query_one("SELECT run_id FROM submission_keys WHERE key = $1", &[&key])
                        .await?
                        .get(0);
                    return Ok(Uuid::parse_str(&first).ok());
                }
            }
            let inserted = tx
                .execute(
                    "INSERT INTO runs (run_id, ticket, state, job, created_at, updated_at)
                     VALUES ($1, $2, 'queued', $3, $4, $4) ON CONFLICT (run_id) DO NOTHING",
                    &[&run_id, &job.ticket, &body, &job.submitted_at],
                )
                .await?;
            if inserted > 0 {
                tx.execute(
                    "INSERT INTO state_history (run_id, state, reason, time) VALUES ($1, 'queued', $2, $3)",
                    &[&run_id, &reason, &job.submitted_at],
                )
                .await?;
            }
            tx.commit().await?;
            Ok(None)
        })
        .await
    }

    async fn run_of_key(&self, key: &str) -> Result<Option<Uuid>, StoreError> {
        let cutoff = super::key_cutoff();
        self.bounded(async {
            let row = self
                .client()
                .await?
                .query_opt(
                    "SELECT run_id FROM submission_keys WHERE key = $1 AND created_at >= $2",
                    &[&key, &cutoff],
                )
                .await?;
            Ok(row.and_then(|r| Uuid::parse_str(r.get::<_, &str>(0)).ok()))
        })
        .await
    }

    async fn record(&self, event: &Event) -> Result<Recorded, StoreError> {
        let body = serde_json::to_string(event)?;
        let run_id = event.run_id.to_string();
        self.bounded(async {
            let mut client = self.client().await?;
            let tx = client.transaction().await?;
            // The run's row orders its events: taken before the event's position is drawn and
            // held to the commit, so a run's positions commit in order; other runs' events go
            // on at the same time.
            let row = tx
                .query_opt("SELECT state, execution FROM runs WHERE run_id = $1 FOR UPDATE", &[&run_id])
                .await?;
            let current = row.as_ref().map(|row| row.get::<_, String>(0));
            let execution = row.as_ref().and_then(|row| row.get::<_, Option<String>>(1));
            let prior = current.as_deref().and_then(RunState::parse);
            let position = tx
                .query_opt(
                    "INSERT INTO events (event_id, run_id, kind, time, body) VALUES ($1, $2, $3, $4, $5)
                     ON CONFLICT (event_id) DO NOTHING RETURNING position",
                    &[&event.event_id.to_string(), &run_id, &event.kind.name(), &event.time, &body],
                )
                .await?
                .map(|row| row.get::<_, i64>(0));
            let mut recorded = Recorded { new: false, prior, repeats: false, position };
            if position.is_none() {
                return Ok(recorded);
            }
            match super::fence(event, current.as_deref(), execution.as_deref()) {
                super::Fence::Superseded => {
                    tx.commit().await?;
                    return Ok(recorded);
                }
                super::Fence::TakesOver(execution) => {
                    tx.execute("UPDATE runs SET execution = $2 WHERE run_id = $1", &[&run_id, &execution])
                        .await?;
                }
                super::Fence::Current => {}
            }
            if super::shows_life(&event.kind) {
                tx.execute(
                    "UPDATE runs SET last_seen = $2 WHERE run_id = $1",
                    &[&run_id, &proto::timestamp_now()],
                )
                .await?;
            }
            match &event.kind {
                EventKind::State { state, reason }
                    if super::takes_state(current.as_deref(), *state) =>
                {
                        tx.execute(
                            "UPDATE runs SET state = $2, updated_at = $3 WHERE run_id = $1",
                            &[&run_id, &state.as_str(), &event.time],
                        )
                        .await?;
                        tx.execute(
                            "INSERT INTO state_history (run_id, state, reason, time) VALUES ($1, $2, $3, $4)",
                            &[&run_id, &state.as_str(), reason, &event.time],
                        )
                        .await?;
                }
                EventKind::Cycle { cycle } => {
                    let cycle_number = i32::try_from(cycle.cycle).unwrap_or(i32::MAX);
                    // `xmax` is 0 for a row inserted now, not for one updated in place.
                    let inserted: bool = tx
                        .query_one(
                            "INSERT INTO cycles (run_id, step, file, cycle, body) VALUES ($1, $2, $3, $4, $5)
                             ON CONFLICT (run_id, step, file) DO UPDATE SET cycle = excluded.cycle, body = excluded.body
                             RETURNING (xmax = 0)",
                            &[&run_id, &cycle.step, &cycle.file, &cycle_number, &serde_json::to_string(cycle)?],
                        )
                        .await?
                        .get(0);
                    recorded.repeats = !inserted;
                }
                // A finished run's result is final: a late execution's result is history.
                EventKind::Result { result } if super::takes_result(current.as_deref()) => {
                    tx.execute(
                        "UPDATE runs SET result = $2, updated_at = $3 WHERE run_id = $1",
                        &[&run_id, &serde_json::to_string(result)?, &event.time],
                    )
                    .await?;
                }
                _ => {}
            }
            tx.commit().await?;
            recorded.new = true;
            Ok(recorded)
        })
        .await
    }

    async fn job_of(&self, run_id: Uuid) -> Result<Option<Job>, StoreError> {
        let id = run_id.to_string();
        self.bounded(async {
            let row = self
                .client()
                .await?
                .query_opt("SELECT job FROM runs WHERE run_id = $1", &[&id])
                .await?;
            match row {
                Some(row) => Ok(Some(serde_json::from_str(row.get::<_, &str>(0))?)),
                None => Ok(None),
            }
        })
        .await
    }

    async fn get_run(&self, run_id: Uuid) -> Result<Option<RunRecord>, StoreError> {
        let id = run_id.to_string();
        self.bounded(async {
            let client = self.client().await?;
            let Some(row) = client
                .query_opt(
                    "SELECT job, state, result FROM runs WHERE run_id = $1",
                    &[&id],
                )
                .await?
            else {
                return Ok(None);
            };
            let (job, state, result): (String, String, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            let states = client
                .query(
                    "SELECT state, reason, time FROM state_history WHERE run_id = $1 ORDER BY id",
                    &[&id],
                )
                .await?
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2)))
                .collect();
            let cycles = client
                .query(
                    "SELECT body FROM cycles WHERE run_id = $1 ORDER BY step, cycle",
                    &[&id],
                )
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect();
            let row = super::RunRow {
                job,
                state,
                result,
                states,
                cycles,
            };
            row.into_record().map(Some)
        })
        .await
    }

    async fn silent_runs(&self, before: String) -> Result<Vec<Job>, StoreError> {
        self.bounded(async {
            self.client()
                .await?
                .query(
                    "SELECT job FROM runs WHERE state = 'running' AND COALESCE(last_seen, updated_at) < $1",
                    &[&before],
                )
                .await?
                .iter()
                .map(|r| Ok(serde_json::from_str(r.get::<_, &str>(0))?))
                .collect()
        })
        .await
    }

    async fn mark_unpublished(&self, run_id: Uuid) -> Result<(), StoreError> {
        self.bounded(async {
            self.client()
                .await?
                .execute(
                    "UPDATE runs SET published = FALSE WHERE run_id = $1",
                    &[&run_id.to_string()],
                )
                .await?;
            Ok(())
        })
        .await
    }

    async fn cancel_requested(&self, run_id: Uuid) -> Result<bool, StoreError> {
        self.bounded(async {
            let row = self
                .client()
                .await?
                .query_opt(
                    "SELECT 1 FROM events WHERE run_id = $1 AND kind = 'cancel_requested' LIMIT 1",
                    &[&run_id.to_string()],
                )
                .await?;
            Ok(row.is_some())
        })
        .await
    }

    async fn mark_published(&self, run_id: Uuid) -> Result<(), StoreError> {
        self.bounded(async {
            self.client()
                .await?
                .execute(
                    "UPDATE runs SET published = TRUE WHERE run_id = $1",
                    &[&run_id.to_string()],
                )
                .await?;
            Ok(())
        })
        .await
    }

    async fn unpublished_jobs(&self, accepted_before: String) -> Result<Vec<Job>, StoreError> {
        self.bounded(async {
            self.client()
                .await?
                .query(
                    "SELECT job FROM runs WHERE published = FALSE AND state = 'queued' AND created_at < $1
                     ORDER BY created_at",
                    &[&accepted_before],
                )
                .await?
                .iter()
                .map(|r| Ok(serde_json::from_str(r.get::<_, &str>(0))?))
                .collect()
        })
        .await
    }

    async fn list_runs(
        &self,
        filter: RunFilter,
    ) -> Result<(Vec<RunSummary>, Option<i64>), StoreError> {
        let limit = i64::from(filter.limit.clamp(1, 500));
        // The cursor is the sequence number of the last run of the previous page.
        let cursor: i64 = filter.cursor.unwrap_or(i64::MAX);
        let state = filter.state.map(RunState::as_str);
        self.bounded(async {
            let rows = self
                .client()
                .await?
                .query(
                    "SELECT seq, run_id, ticket, state, created_at, updated_at,
                            COALESCE(job::jsonb->>'skill', ''),
                            COALESCE(job::jsonb->'implementer'->>'name', ''),
                            COALESCE((result::jsonb->>'implementation_rounds')::BIGINT, 0),
                            (SELECT COUNT(*) FROM cycles WHERE cycles.run_id = runs.run_id)
                     FROM runs
                     WHERE seq < $1 AND ($2::TEXT IS NULL OR state = $2) AND ($3::TEXT IS NULL OR ticket = $3)
                       AND ($5::TEXT IS NULL OR job::jsonb->>'skill' = $5)
                     ORDER BY seq DESC LIMIT $4",
                    &[&cursor, &state, &filter.ticket, &(limit + 1), &filter.skill],
                )
                .await?;
            let more = rows.len() as i64 > limit;
            let rows = &rows[..rows.len().min(limit as usize)];
            let next = if more {
                rows.last().map(|r| r.get::<_, i64>(0))
            } else {
                None
            };
            let runs = rows
                .iter()
                .filter_map(|r| {
                    Some(RunSummary {
                        run_id: Uuid::parse_str(r.get(1)).ok()?,
                        ticket: r.get(2),
                        state: RunState::parse(r.get(3))?,
                        created_at: r.get(4),
                        updated_at: r.get(5),
                        skill: r.get(6),
                        profile: r.get(7),
                        rounds: u32::try_from(r.get::<_, i64>(8)).unwrap_or(0),
                        cycles: u32::try_from(r.get::<_, i64>(9)).unwrap_or(0),
                    })
                })
                .collect();
            Ok((runs, next))
        })
        .await
    }

    async fn prune(&self, prune: Prune) -> Result<Pruned, StoreError> {
        // In batches, each its own transaction within the usual operation bound: no lock is
        // held for long, and a big store is pruned over several calls' worth of batches.
        let mut pruned = Pruned::default();
        if let Some(before) = &prune.runs_before {
            loop {
                let batch = self
                    .bounded(async {
                        let mut client = self.client().await?;
                        let tx = client.transaction().await?;
                        let ids: Vec<String> = tx
                            .query(
                                &format!("SELECT run_id FROM runs WHERE state IN {TERMINAL_STATES_SQL} AND updated_at < $1 LIMIT {PRUNE_RUNS_BATCH}"),
                                &[before],
                            )
                            .await?
                            .iter()
                            .map(|row| row.get(0))
                            .collect();
                        for table in ["events", "state_history", "cycles", "submission_keys", "runs"] {
                            tx.execute(&format!("DELETE FROM {table} WHERE run_id = ANY($1)"), &[&ids])
                                .await?;
                        }
                        tx.commit().await?;
                        Ok(ids.len() as u64)
                    })
                    .await?;
                pruned.runs += batch;
                if batch < PRUNE_RUNS_BATCH {
                    break;
                }
            }
        }
        if let Some(before) = &prune.chatter_before {
            let chatter = format!(
                "DELETE FROM events WHERE position IN (
                   SELECT e.position FROM runs r JOIN events e ON e.run_id = r.run_id
                   WHERE r.state IN {TERMINAL_STATES_SQL} AND r.updated_at < $1
                     AND e.kind IN ('heartbeat', 'log')
                   LIMIT {PRUNE_EVENTS_BATCH})"
            );
            loop {
                let batch = self
                    .bounded(async { Ok(self.client().await?.execute(&chatter, &[before]).await?) })
                    .await?;
                pruned.chatter += batch;
                if batch < PRUNE_EVENTS_BATCH {
                    break;
                }
            }
        }
        Ok(pruned)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(async {
            self.client().await?.query_one("SELECT 1", &[]).await?;
            Ok(())
        })
        .await
    }

    async fn count_by_state(&self) -> Result<Vec<(RunState, u64)>, StoreError> {
        self.bounded(async {
            Ok(self
                .client()
                .await?
                .query("SELECT state, COUNT(*) FROM runs GROUP BY state", &[])
                .await?
                .iter()
                .filter_map(|r| {
                    let n: i64 = r.get(1);
                    Some((RunState::parse(r.get(0))?, n.max(0) as u64))
                })
                .collect())
        })
        .await
    }

    async fn queued_reasons(&self) -> Result<Vec<String>, StoreError> {
        self.bounded(async {
            Ok(self
                .client()
                .await?
                .query(super::QUEUED_REASONS, &[])
                .await?
                .iter()
                .filter_map(|r| r.get::<_, Option<String>>(0))
                .collect())
        })
        .await
    }

    async fn ended_with_webhooks(
        &self,
        since: String,
    ) -> Result<Vec<(Uuid, Option<String>)>, StoreError> {
        self.bounded(async {
            let query = format!("{}$1", super::ENDED_WITH_WEBHOOKS);
            Ok(self
                .client()
                .await?
                .query(&query, &[&since])
                .await?
                .iter()
                .filter_map(|r| {
                    let id: String = r.get(0);
                    Some((Uuid::parse_str(&id).ok()?, r.get::<_, Option<String>>(1)))
                })
                .collect())
        })
        .await
    }

    async fn events(&self, run_id: Uuid, after: i64) -> Result<Vec<(i64, Event)>, StoreError> {
        self.events_page(run_id, after, u32::MAX).await
    }

    async fn position_of(&self, event_id: Uuid) -> Result<Option<i64>, StoreError> {
        self.bounded(async {
            let row = self
                .client()
                .await?
                .query_opt(
                    "SELECT position FROM events WHERE event_id = $1",
                    &[&event_id.to_string()],
                )
                .await?;
            Ok(row.map(|r| r.get(0)))
        })
        .await
    }

    async fn events_of_kinds(
        &self,
        run_id: Uuid,
        kinds: &'static [&'static str],
        newest: bool,
        limit: u32,
    ) -> Result<Vec<(i64, Event)>, StoreError> {
        let order = if newest { "DESC" } else { "ASC" };
        let query = format!("SELECT position, body FROM events WHERE run_id = $1 AND kind = ANY($2) ORDER BY position {order} LIMIT $3");
        let mut events = self
            .read_events(&query, &[&run_id.to_string(), &kinds, &i64::from(limit)])
            .await?;
        events.sort_by_key(|(position, _)| *position);
        Ok(events)
    }

    async fn events_page(
        &self,
        run_id: Uuid,
        after: i64,
        limit: u32,
    ) -> Result<Vec<(i64, Event)>, StoreError> {
        self.read_events(
            "SELECT position, body FROM events WHERE run_id = $1 AND position > $2 ORDER BY position LIMIT $3",
            &[&run_id.to_string(), &after, &i64::from(limit)],
        )
        .await
    }

    async fn allot(&self, allot: super::Allot) -> Result<Result<Spend, String>, StoreError> {
        counts::allot(self, allot).await
    }

    async fn record_lost(&self, run_id: Uuid, lost: u32) -> Result<u32, StoreError> {
        counts::record_lost(self, run_id, lost).await
    }
}
