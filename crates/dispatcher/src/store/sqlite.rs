//! The SQLite run store: one file, WAL mode, queries on the blocking pool.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use proto::allotment::Spend;
use proto::{Event, EventKind, Job, RunState, RunSummary};
use rusqlite::{params, Connection, OptionalExtension};
use uuid::Uuid;

use super::{
    Prune, Pruned, Recorded, RunFilter, RunRecord, RunStore, StoreError, PRUNE_EVENTS_BATCH,
    PRUNE_RUNS_BATCH, TERMINAL_STATES_SQL,
};

/// The SQLite run store. Queries run on the blocking pool, never on the async runtime.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    connection: Arc<Mutex<Connection>>,
}

impl SqliteStore {
    /// Opens (creating if needed) the store at a path or `sqlite://` URL.
    pub fn open(url: &str) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with(url, super::Schema::Migrate)
    }

    /// Opens the store at a path or `sqlite://` URL; `schema` says whether its migrations
    /// run here.
    pub fn open_with(url: &str, schema: super::Schema) -> Result<SqliteStore, StoreError> {
        let path = sqlite_path(url);
        let open = || -> Result<Connection, String> {
            let mut connection = Connection::open(&path).map_err(|e| e.to_string())?;
            set_up(&mut connection).map_err(|e| e.to_string())?;
            if schema == super::Schema::Migrate {
                migrations::migrations::runner()
                    .run(&mut connection)
                    .map_err(|e| format!("migrating the schema: {e}"))?;
                add_late_columns(&connection).map_err(|e| e.to_string())?;
            }
            Ok(connection)
        };
        let connection = open().map_err(|reason| StoreError::Open {
            target: path.display().to_string(),
            reason,
        })?;
        Ok(SqliteStore {
            connection: Arc::new(Mutex::new(connection)),
        })
    }
}

/// The connection's settings: WAL, a busy timeout, foreign keys.
fn set_up(connection: &mut Connection) -> Result<(), rusqlite::Error> {
    connection.busy_timeout(std::time::Duration::from_secs(5))?;
    connection.pragma_update(None, "journal_mode", "WAL")?;
    connection.pragma_update(None, "synchronous", "NORMAL")?;
    connection.pragma_update(None, "foreign_keys", "ON")
}

/// The columns stores of the release before migrations added by hand after their tables
/// existed (SQLite has no `ADD COLUMN IF NOT EXISTS`): a store made before them gains them.
fn add_late_columns(connection: &Connection) -> Result<(), rusqlite::Error> {
    for column in ["execution", "last_seen"] {
        let present: i64 = connection.query_row(
            "SELECT COUNT(*) FROM pragma_table_info('runs') WHERE name = ?1",
            [column],
            |r| r.get(0),
        )?;
        if present == 0 {
            connection.execute_batch(&format!("ALTER TABLE runs ADD COLUMN {column} TEXT"))?;
        }
    }
    Ok(())
}

impl SqliteStore {
    pub(super) async fn with<T: Send + 'static>(
        &self,
        work: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let connection = Arc::clone(&self.connection);
        tokio::task::spawn_blocking(move || {
            let mut guard = connection
                .lock()
                .map_err(|e| StoreError::Task(e.to_string()))?;
            work(&mut guard)
        })
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
    }
}

/// The schema, as versioned migrations (`migrations/sqlite`, refinery): a store made by an
/// earlier release is brought up to this one when it is opened, and its table
/// `refinery_schema_history` says which have run.
mod migrations {
    refinery::embed_migrations!("migrations/sqlite");
}

impl RunStore for SqliteStore {
    async fn insert_run_once(
        &self,
        job: &Job,
        key: Option<&str>,
    ) -> Result<Option<Uuid>, StoreError> {
        let body = serde_json::to_string(job)?;
        let (run_id, ticket, time) = (
            job.run_id.to_string(),
            job.ticket.clone(),
            job.submitted_at.clone(),
        );
        let reason = super::accepted_reason(job);
        let key = key.map(str::to_string);
        let cutoff = super::key_cutoff();
        self.with(move |c| {
            let tx = c.transaction()?;
            if let Some(key) = &key {
                tx.execute(
                    "DELETE FROM submission_keys WHERE created_at < ?1",
                    params![cutoff],
                )?;
                let fresh = tx.execute(
                    "INSERT OR IGNORE INTO submission_keys (key, run_id, created_at) VALUES (?1, ?2, ?3)",
                    params![key, run_id, time],
                )?;
                if fresh == 0 {
                    let first: String = tx.query_row(
                        "SELECT run_id FROM submission_keys WHERE key = ?1",
                        params![key],
                        |r| r.get(0),
                    )?;
                    return Ok(Uuid::parse_str(&first).ok());
                }
            }
            let inserted = tx.execute(
                "INSERT OR IGNORE INTO runs (run_id, ticket, state, job, created_at, updated_at) VALUES (?1, ?2, 'queued', ?3, ?4, ?4)",
                params![run_id, ticket, body, time],
            )?;
            if inserted > 0 {
                tx.execute(
                    "INSERT INTO state_history (run_id, state, reason, time) VALUES (?1, 'queued', ?2, ?3)",
                    params![run_id, reason, time],
                )?;
            }
            tx.commit()?;
            Ok(None)
        })
        .await
    }

    async fn run_of_key(&self, key: &str) -> Result<Option<Uuid>, StoreError> {
        let (key, cutoff) = (key.to_string(), super::key_cutoff());
        self.with(move |c| {
            let found: Option<String> = c
                .query_row(
                    "SELECT run_id FROM submission_keys WHERE key = ?1 AND created_at >= ?2",
                    params![key, cutoff],
                    |r| r.get(0),
                )
                .optional()?;
            Ok(found.and_then(|id| Uuid::parse_str(&id).ok()))
        })
        .await
    }

    async fn record(&self, event: &Event) -> Result<Recorded, StoreError> {
        let event = event.clone();
        self.with(move |c| {
            let tx = c.transaction()?;
            let run_id = event.run_id.to_string();
            let (current, execution): (Option<String>, Option<String>) = tx
                .query_row("SELECT state, execution FROM runs WHERE run_id = ?1", params![run_id], |r| Ok((r.get(0)?, r.get(1)?)))
                .optional()?
                .unwrap_or((None, None));
            let prior = current.as_deref().and_then(RunState::parse);
            let inserted = tx.execute(
                "INSERT OR IGNORE INTO events (event_id, run_id, kind, time, body) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![event.event_id.to_string(), run_id, event.kind.name(), event.time, serde_json::to_string(&event)?],
            )?;
            let position = (inserted > 0).then(|| tx.last_insert_rowid());
            let mut recorded = Recorded { new: false, prior, repeats: false, position };
            if inserted == 0 {
                return Ok(recorded);
            }
            match super::fence(&event, current.as_deref(), execution.as_deref()) {
                super::Fence::Superseded => {
                    tx.commit()?;
                    return Ok(recorded);
                }
                super::Fence::TakesOver(execution) => {
                    tx.execute("UPDATE runs SET execution = ?2 WHERE run_id = ?1", params![run_id, execution])?;
                }
                super::Fence::Current => {}
            }
            if super::shows_life(&event.kind) {
                tx.execute("UPDATE runs SET last_seen = ?2 WHERE run_id = ?1", params![run_id, proto::timestamp_now()])?;
            }
            match &event.kind {
                EventKind::State { state, reason }
                    if super::takes_state(current.as_deref(), *state) =>
                {
                        tx.execute(
                            "UPDATE runs SET state = ?2, updated_at = ?3 WHERE run_id = ?1",
                            params![run_id, state.as_str(), event.time],
                        )?;
                        tx.execute(
                            "INSERT INTO state_history (run_id, state, reason, time) VALUES (?1, ?2, ?3, ?4)",
                            params![run_id, state.as_str(), reason, event.time],
                        )?;
                }
                EventKind::Cycle { cycle } => {
                    recorded.repeats = tx
                        .query_row(
                            "SELECT 1 FROM cycles WHERE run_id = ?1 AND step = ?2 AND file = ?3",
                            params![run_id, cycle.step, cycle.file],
                            |_| Ok(()),
                        )
                        .optional()?
                        .is_some();
                    tx.execute(
                        "INSERT INTO cycles (run_id, step, file, cycle, body) VALUES (?1, ?2, ?3, ?4, ?5)
                         ON CONFLICT (run_id, step, file) DO UPDATE SET cycle = excluded.cycle, body = excluded.body",
                        params![run_id, cycle.step, cycle.file, cycle.cycle, serde_json::to_string(cycle)?],
                    )?;
                }
                // A finished run's result is final: a late execution's result is history.
                EventKind::Result { result } if super::takes_result(current.as_deref()) => {
                    tx.execute(
                        "UPDATE runs SET result = ?2, updated_at = ?3 WHERE run_id = ?1",
                        params![run_id, serde_json::to_string(result)?, event.time],
                    )?;
                }
                _ => {}
            }
            tx.commit()?;
            recorded.new = true;
            Ok(recorded)
        })
        .await
    }

    async fn job_of(&self, run_id: Uuid) -> Result<Option<Job>, StoreError> {
        self.with(move |c| {
            let job: Option<String> = c
                .query_row(
                    "SELECT job FROM runs WHERE run_id = ?1",
                    params![run_id.to_string()],
                    |r| r.get(0),
                )
                .optional()?;
            Ok(match job {
                Some(job) => Some(serde_json::from_str(&job)?),
                None => None,
            })
        })
        .await
    }

    async fn get_run(&self, run_id: Uuid) -> Result<Option<RunRecord>, StoreError> {
        self.with(move |c| {
            let id = run_id.to_string();
            let row: Option<(String, String, Option<String>)> = c
                .query_row(
                    "SELECT job, state, result FROM runs WHERE run_id = ?1",
                    params![id],
                    |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
                )
                .optional()?;
            let Some((job, state, result)) = row else {
                return Ok(None);
            };
            let mut statement = c.prepare(
                "SELECT state, reason, time FROM state_history WHERE run_id = ?1 ORDER BY id",
            )?;
            let states = statement
                .query_map(params![id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            let mut statement =
                c.prepare("SELECT body FROM cycles WHERE run_id = ?1 ORDER BY step, cycle")?;
            let cycles = statement
                .query_map(params![id], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
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
        self.with(move |c| {
            let mut statement = c.prepare(
                "SELECT job FROM runs WHERE state = 'running' AND COALESCE(last_seen, updated_at) < ?1",
            )?;
            let jobs = statement
                .query_map(params![before], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            jobs.iter()
                .map(|job| Ok(serde_json::from_str(job)?))
                .collect()
        })
        .await
    }

    async fn mark_unpublished(&self, run_id: Uuid) -> Result<(), StoreError> {
        self.with(move |c| {
            c.execute(
                "UPDATE runs SET published = 0 WHERE run_id = ?1",
                params![run_id.to_string()],
            )?;
            Ok(())
        })
        .await
    }

    async fn cancel_requested(&self, run_id: Uuid) -> Result<bool, StoreError> {
        self.with(move |c| {
            let found: Option<i64> = c
                .query_row(
                    "SELECT 1 FROM events WHERE run_id = ?1 AND kind = 'cancel_requested' LIMIT 1",
                    params![run_id.to_string()],
                    |r| r.get(0),
                )
                .optional()?;
            Ok(found.is_some())
        })
        .await
    }

    async fn mark_published(&self, run_id: Uuid) -> Result<(), StoreError> {
        self.with(move |c| {
            c.execute(
                "UPDATE runs SET published = 1 WHERE run_id = ?1",
                params![run_id.to_string()],
            )?;
            Ok(())
        })
        .await
    }

    async fn unpublished_jobs(&self, accepted_before: String) -> Result<Vec<Job>, StoreError> {
        self.with(move |c| {
            let mut statement = c.prepare(
                "SELECT job FROM runs WHERE published = 0 AND state = 'queued' AND created_at < ?1
                 ORDER BY created_at",
            )?;
            let rows = statement
                .query_map(params![accepted_before], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            rows.iter()
                .map(|body| Ok(serde_json::from_str(body)?))
                .collect()
        })
        .await
    }

    async fn list_runs(
        &self,
        filter: RunFilter,
    ) -> Result<(Vec<RunSummary>, Option<i64>), StoreError> {
        self.with(move |c| {
            let limit = filter.limit.clamp(1, 500);
            // The cursor is the rowid of the last run of the previous page.
            let cursor: i64 = filter.cursor.unwrap_or(i64::MAX);
            // Skill, profile and rounds are read from the stored job and result; the cycles
            // are counted through the cycles table's key.
            let mut statement = c.prepare(
                "SELECT rowid, run_id, ticket, state, created_at, updated_at,
                        COALESCE(json_extract(job, '$.skill'), ''),
                        COALESCE(json_extract(job, '$.implementer.name'), ''),
                        COALESCE(json_extract(result, '$.implementation_rounds'), 0),
                        (SELECT COUNT(*) FROM cycles WHERE cycles.run_id = runs.run_id)
                 FROM runs
                 WHERE rowid < ?1 AND (?2 IS NULL OR state = ?2) AND (?3 IS NULL OR ticket = ?3)
                   AND (?5 IS NULL OR json_extract(job, '$.skill') = ?5)
                 ORDER BY rowid DESC LIMIT ?4",
            )?;
            let rows = statement
                .query_map(
                    params![
                        cursor,
                        filter.state.map(RunState::as_str),
                        filter.ticket,
                        limit + 1,
                        filter.skill
                    ],
                    |r| {
                        let id: String = r.get(1)?;
                        let state: String = r.get(3)?;
                        let summary = match (Uuid::parse_str(&id), RunState::parse(&state)) {
                            (Ok(run_id), Some(state)) => Some(RunSummary {
                                run_id,
                                ticket: r.get(2)?,
                                state,
                                created_at: r.get(4)?,
                                updated_at: r.get(5)?,
                                skill: r.get(6)?,
                                profile: r.get(7)?,
                                rounds: u32::try_from(r.get::<_, i64>(8)?).unwrap_or(0),
                                cycles: u32::try_from(r.get::<_, i64>(9)?).unwrap_or(0),
                            }),
                            _ => None,
                        };
                        Ok((r.get::<_, i64>(0)?, summary))
                    },
                )?
                .collect::<Result<Vec<_>, _>>()?;
            let more = rows.len() > limit as usize;
            let rows: Vec<_> = rows.into_iter().take(limit as usize).collect();
            let next = if more { rows.last().map(|r| r.0) } else { None };
            let runs = rows
                .into_iter()
                .filter_map(|(_, summary)| summary)
                .collect();
            Ok((runs, next))
        })
        .await
    }

    async fn prune(&self, prune: Prune) -> Result<Pruned, StoreError> {
        // In batches, each its own transaction: the store's one connection is never held for
        // long, so the API and the events consumer go on while a big store is pruned.
        let mut pruned = Pruned::default();
        if let Some(before) = prune.runs_before {
            loop {
                let before = before.clone();
                let batch = self
                    .with(move |c| {
                        let tx = c.transaction()?;
                        let ids: Vec<String> = tx
                            .prepare(&format!("SELECT run_id FROM runs WHERE state IN {TERMINAL_STATES_SQL} AND updated_at < ?1 LIMIT {PRUNE_RUNS_BATCH}"))?
                            .query_map([&before], |r| r.get(0))?
                            .collect::<Result<_, _>>()?;
                        for id in &ids {
                            for table in ["events", "state_history", "cycles", "submission_keys", "runs"] {
                                tx.prepare_cached(&format!("DELETE FROM {table} WHERE run_id = ?1"))?
                                    .execute([id])?;
                            }
                        }
                        tx.commit()?;
                        Ok(ids.len() as u64)
                    })
                    .await?;
                pruned.runs += batch;
                if batch < PRUNE_RUNS_BATCH {
                    break;
                }
            }
        }
        if let Some(before) = prune.chatter_before {
            loop {
                let before = before.clone();
                let batch = self
                    .with(move |c| {
                        let chatter = format!(
                            "DELETE FROM events WHERE position IN (
                               SELECT e.position FROM runs r JOIN events e ON e.run_id = r.run_id
                               WHERE r.state IN {TERMINAL_STATES_SQL} AND r.updated_at < ?1
                                 AND e.kind IN ('heartbeat', 'log')
                               LIMIT {PRUNE_EVENTS_BATCH})"
                        );
                        Ok(c.execute(&chatter, [&before])? as u64)
                    })
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
        self.with(|c| {
            Ok(c.query_row("SELECT 1", [], |r| r.get::<_, i64>(0))
                .map(|_| ())?)
        })
        .await
    }

    async fn count_by_state(&self) -> Result<Vec<(RunState, u64)>, StoreError> {
        self.with(|c| {
            let mut statement = c.prepare("SELECT state, COUNT(*) FROM runs GROUP BY state")?;
            let rows = statement
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows
                .into_iter()
                .filter_map(|(state, n)| Some((RunState::parse(&state)?, n.max(0) as u64)))
                .collect())
        })
        .await
    }

    async fn queued_reasons(&self) -> Result<Vec<String>, StoreError> {
        self.with(|c| {
            let mut statement = c.prepare(super::QUEUED_REASONS)?;
            let rows = statement
                .query_map([], |r| r.get::<_, Option<String>>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows.into_iter().flatten().collect())
        })
        .await
    }

    async fn ended_with_webhooks(
        &self,
        since: String,
    ) -> Result<Vec<(Uuid, Option<String>)>, StoreError> {
        self.with(move |c| {
            let mut statement = c.prepare(&format!("{}?1", super::ENDED_WITH_WEBHOOKS))?;
            let rows = statement
                .query_map([since], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, Option<String>>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows
                .into_iter()
                .filter_map(|(id, body)| Some((Uuid::parse_str(&id).ok()?, body)))
                .collect())
        })
        .await
    }

    async fn events(&self, run_id: Uuid, after: i64) -> Result<Vec<(i64, Event)>, StoreError> {
        self.events_page(run_id, after, u32::MAX).await
    }

    async fn position_of(&self, event_id: Uuid) -> Result<Option<i64>, StoreError> {
        self.with(move |c| {
            Ok(c.query_row(
                "SELECT position FROM events WHERE event_id = ?1",
                [event_id.to_string()],
                |r| r.get(0),
            )
            .optional()?)
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
        let kinds = serde_json::to_string(kinds)?;
        self.with(move |c| {
            let order = if newest { "DESC" } else { "ASC" };
            let mut statement = c.prepare(&format!(
                "SELECT position, body FROM events
                 WHERE run_id = ?1 AND kind IN (SELECT value FROM json_each(?2))
                 ORDER BY position {order} LIMIT ?3"
            ))?;
            let mut rows = statement
                .query_map(params![run_id.to_string(), kinds, i64::from(limit)], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
                })?
                .collect::<Result<Vec<_>, _>>()?;
            rows.sort_by_key(|(position, _)| *position);
            rows.into_iter()
                .map(|(position, body)| Ok((position, serde_json::from_str(&body)?)))
                .collect()
        })
        .await
    }

    async fn events_page(
        &self,
        run_id: Uuid,
        after: i64,
        limit: u32,
    ) -> Result<Vec<(i64, Event)>, StoreError> {
        self.with(move |c| {
            let mut statement =
                c.prepare("SELECT position, body FROM events WHERE run_id = ?1 AND position > ?2 ORDER BY position LIMIT ?3")?;
            let rows = statement
                .query_map(params![run_id.to_string(), after, i64::from(limit)], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            rows.into_iter()
                .map(|(position, body)| Ok((position, serde_json::from_str(&body)?)))
                .collect()
        })
        .await
    }

    async fn allot(&self, allot: super::Allot) -> Result<Result<Spend, String>, StoreError> {
        self.with(move |c| {
            let tx = c.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let total = tx
                .query_row(
                    "SELECT tokens, cost_usd FROM daily_allotments WHERE profile = ?1 AND day = ?2",
                    params![allot.profile, allot.day],
                    |r| {
                        Ok(Spend {
                            tokens: r.get::<_, i64>(0)?.max(0) as u64,
                            cost_usd: r.get(1)?,
                        })
                    },
                )
                .optional()?
                .unwrap_or_default();
            let (total, granted) = allot.apply(total);
            tx.execute(
                "INSERT INTO daily_allotments (profile, day, tokens, cost_usd) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (profile, day) DO UPDATE SET tokens = excluded.tokens, cost_usd = excluded.cost_usd",
                params![allot.profile, allot.day, total.tokens.min(i64::MAX as u64) as i64, total.cost_usd],
            )?;
            tx.commit()?;
            Ok(granted)
        })
        .await
    }

    async fn record_lost(&self, run_id: Uuid, lost: u32) -> Result<u32, StoreError> {
        self.with(move |c| {
            let kept = c
                .query_row(
                    "UPDATE runs SET lost_executions = MAX(lost_executions, ?2) WHERE run_id = ?1
                     RETURNING lost_executions",
                    params![run_id.to_string(), i64::from(lost)],
                    |r| r.get::<_, i64>(0),
                )
                .optional()?;
            Ok(kept.map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)))
        })
        .await
    }
}

/// The file path of a `sqlite://PATH`, `sqlite:PATH` or plain-path URL.
pub fn sqlite_path(url: &str) -> PathBuf {
    let path = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .unwrap_or(url);
    Path::new(path).to_path_buf()
}
