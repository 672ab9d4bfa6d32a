//! The run store: every run, its state history, its cycle files, its result and every event.
//!
//! [`RunStore`] is the seam. [`SqliteStore`] is the default, used by `forgepool run` and by a
//! dispatcher whose `FORGEPOOL_DATABASE_URL` is a path or `sqlite://` URL; [`PostgresStore`] is
//! used when it is a `postgres://` URL. [`Store`] is whichever of the two the URL names.
//! In both, recording an event is idempotent (keyed by its `event_id`), a cycle file is stored
//! once per `(run, step, file)`, and a terminal state is never left, so a redelivered job never
//! produces duplicate records.
//!
//! `RunRow::into_record` builds every `RunRecord`, and a state is taken only when
//! `RunState::accepts` it. A `published` flag marks runs whose job the broker confirmed; the
//! republisher sends the others again. `tests/store.rs` holds both backends to one contract.
//!
//! The schema is versioned migrations per backend
//! (`crates/dispatcher/migrations/{sqlite,postgres}`), embedded and run by refinery. `V1` is
//! the schema of the release before migrations, all `IF NOT EXISTS`, so an old store takes it
//! as applied. `forgepool dispatcher` runs them in a short-lived child,
//! `forgepool migrate-store` (hidden; the store's URL in its environment, never on its command
//! line), and waits for it before it opens the store without migrating (`Schema::Migrated`):
//! refinery parses migration names with a Unicode regex whose 512 KiB automaton and tables
//! would otherwise stay in the long-lived process (docs/BENCHMARKS.md, "Memory"). The embedded
//! mode and `forgepool prune` migrate in-process.

use std::future::Future;

use proto::allotment::Spend;
use proto::{CycleRecord, Event, Job, RunResult, RunState, RunSummary};
use uuid::Uuid;

mod postgres;
mod sqlite;
pub mod tls;
pub mod trackers;

pub use postgres::PostgresStore;
pub use sqlite::{sqlite_path, SqliteStore};

/// A failed store operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be opened.
    #[error("cannot open the run store at {target}: {reason}; check FORGEPOOL_DATABASE_URL")]
    Open {
        /// The database file or URL, without its password.
        target: String,
        /// The cause.
        reason: String,
    },
    /// A SQLite query failed.
    #[error("run store query failed: {0}")]
    Query(#[from] rusqlite::Error),
    /// A PostgreSQL query failed (or the server refused a connection).
    #[error("run store query failed: {}", postgres_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// No PostgreSQL connection could be had, or an operation took too long.
    #[error("run store unavailable: {0}")]
    Unavailable(String),
    /// A stored document could not be decoded.
    #[error("run store holds an unreadable record: {0}")]
    Decode(#[from] serde_json::Error),
    /// The blocking task running the query panicked or was cancelled.
    #[error("run store task failed: {0}")]
    Task(String),
    /// The store's schema could not be brought up to this release's.
    #[error("run store migration failed: {0}")]
    Migration(String),
}

/// A PostgreSQL error with what the server or the connection said: tokio-postgres shows only
/// "db error" or "error performing TLS handshake", and keeps the reason in its source.
fn postgres_text(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{}: {} ({})", db.severity(), db.message(), db.code().code());
    }
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(current) = cause {
        text.push_str(&format!(": {current}"));
        cause = current.source();
    }
    text
}

/// A stored run, as read back from the store.
#[derive(Debug, Clone)]
pub struct RunRecord {
    /// The frozen job.
    pub job: Job,
    /// The current state.
    pub state: RunState,
    /// Every state change: state, reason, time.
    pub states: Vec<(RunState, String, String)>,
    /// Every collected cycle file, ordered by step and cycle.
    pub cycles: Vec<CycleRecord>,
    /// The result, once the run ended.
    pub result: Option<RunResult>,
}

/// A run as both stores read it: raw columns, then [`RunRow::into_record`] builds the
/// [`RunRecord`], in one place.
#[derive(Debug)]
pub(crate) struct RunRow {
    /// The frozen job, as stored JSON.
    pub job: String,
    /// The current state's name.
    pub state: String,
    /// The result, as stored JSON.
    pub result: Option<String>,
    /// Every state change: state name, reason, time.
    pub states: Vec<(String, String, String)>,
    /// Every cycle record, as stored JSON, ordered by step and cycle.
    pub cycles: Vec<String>,
}

impl RunRow {
    /// The record: a state the store does not know reads as `failed`, and a state change
    /// with an unknown state is left out.
    pub(crate) fn into_record(self) -> Result<RunRecord, StoreError> {
        Ok(RunRecord {
            job: serde_json::from_str(&self.job)?,
            state: RunState::parse(&self.state).unwrap_or(RunState::Failed),
            states: self
                .states
                .into_iter()
                .filter_map(|(state, reason, time)| {
                    RunState::parse(&state).map(|state| (state, reason, time))
                })
                .collect(),
            cycles: self
                .cycles
                .iter()
                .map(|body| serde_json::from_str(body))
                .collect::<Result<Vec<CycleRecord>, _>>()?,
            result: self.result.map(|r| serde_json::from_str(&r)).transpose()?,
        })
    }
}

/// Whether a run whose stored state is `current` takes the state `next` ([`RunState::accepts`];
/// a run with no stored state takes any).
pub(crate) fn takes_state(current: Option<&str>, next: RunState) -> bool {
    current
        .and_then(RunState::parse)
        .is_none_or(|current| current.accepts(next))
}

/// Whether a run whose stored state is `current` takes a result: only until it is finished
/// (the engine publishes the result just before the terminal state).
pub(crate) fn takes_result(current: Option<&str>) -> bool {
    !current
        .and_then(RunState::parse)
        .is_some_and(RunState::is_terminal)
}

/// Where an event stands among the executions of its run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fence {
    /// From the current execution, or from the dispatcher: it applies.
    Current,
    /// A new execution started the run (its `running` state): it becomes the current one, and
    /// the event applies.
    TakesOver(String),
    /// From an execution a newer one superseded: it is kept as history and changes nothing.
    Superseded,
}

/// The fencing rule of SPEC 11, both stores: an execution's `running` state makes it the
/// run's current execution (unless the run is finished); any other event of an execution
/// that is not the current one changes nothing.
pub(crate) fn fence(event: &Event, state: Option<&str>, current: Option<&str>) -> Fence {
    let Some(execution) = event.execution.map(|e| e.to_string()) else {
        return Fence::Current;
    };
    let starts = matches!(
        event.kind,
        proto::EventKind::State {
            state: RunState::Running,
            ..
        }
    );
    let finished = state
        .and_then(RunState::parse)
        .is_some_and(RunState::is_terminal);
    match current {
        Some(current) if current == execution => Fence::Current,
        _ if starts && !finished => Fence::TakesOver(execution),
        None => Fence::Current,
        Some(_) => Fence::Superseded,
    }
}

/// Whether an event says the run's worker is alive: a heartbeat, a state, a stage starting or
/// ending (log lines and cycle files come only with those).
pub(crate) fn shows_life(kind: &proto::EventKind) -> bool {
    matches!(
        kind,
        proto::EventKind::Heartbeat { .. }
            | proto::EventKind::State { .. }
            | proto::EventKind::StageStarted { .. }
            | proto::EventKind::StageFinished { .. }
    )
}

/// How long a submission key is remembered.
pub const SUBMISSION_KEY_TTL: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The oldest time (RFC 3339) a remembered submission key may have.
pub(crate) fn key_cutoff() -> String {
    proto::format_timestamp(std::time::SystemTime::now() - SUBMISSION_KEY_TTL)
}

/// What storing an event found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The event was new and applied (not a redelivery, nor an older execution's).
    pub new: bool,
    /// The run's state before the event (`None`: no such run).
    pub prior: Option<RunState>,
    /// A cycle file already stored (rewritten in place: the same review cycle).
    pub repeats: bool,
    /// The event's position in its run's stream, when it was stored now.
    pub position: Option<i64>,
}

/// Where runs and events are kept.
pub trait RunStore: Send + Sync + 'static {
    /// Stores a newly frozen job in state `queued`.
    fn insert_run(&self, job: &Job) -> impl Future<Output = Result<(), StoreError>> + Send {
        async move { self.insert_run_once(job, None).await.map(|_| ()) }
    }
    /// Stores a newly frozen job in state `queued`, unless its submission `key` (an
    /// `Idempotency-Key`, or a submission message's `message_id`) was seen in the last
    /// [`SUBMISSION_KEY_TTL`]: then nothing is stored and the first run's id is returned.
    fn insert_run_once(
        &self,
        job: &Job,
        key: Option<&str>,
    ) -> impl Future<Output = Result<Option<Uuid>, StoreError>> + Send;
    /// The run a submission key names, when it was seen in the last [`SUBMISSION_KEY_TTL`].
    fn run_of_key(
        &self,
        key: &str,
    ) -> impl Future<Output = Result<Option<Uuid>, StoreError>> + Send;
    /// Stores an event and applies it to the run (state, cycles, result). Returns `false` when the
    /// event was already stored.
    fn record_event(&self, event: &Event) -> impl Future<Output = Result<bool, StoreError>> + Send {
        async move { self.record(event).await.map(|r| r.new) }
    }
    /// Stores an event and applies it to the run, as [`RunStore::record_event`], saying what it
    /// found: the run's state before it, whether a cycle file was seen before, the event's
    /// position. Events of one run are ordered by the run's row (no lock across runs).
    fn record(&self, event: &Event) -> impl Future<Output = Result<Recorded, StoreError>> + Send;
    /// A run's frozen job alone (`None`: no such run): what an event needs of its run.
    fn job_of(&self, run_id: Uuid) -> impl Future<Output = Result<Option<Job>, StoreError>> + Send {
        async move { Ok(self.get_run(run_id).await?.map(|r| r.job)) }
    }
    /// Reads a run.
    fn get_run(
        &self,
        run_id: Uuid,
    ) -> impl Future<Output = Result<Option<RunRecord>, StoreError>> + Send;
    /// Running runs of which nothing was heard (a heartbeat, a state, a stage starting or
    /// ending) since `before` (RFC 3339, the dispatcher's clock).
    fn silent_runs(
        &self,
        before: String,
    ) -> impl Future<Output = Result<Vec<Job>, StoreError>> + Send;
    /// Notes that a run's job must be published again (the republisher does it if the
    /// dispatcher cannot now).
    fn mark_unpublished(&self, run_id: Uuid)
        -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Whether a user asked to cancel the run (a `cancel_requested` event is stored).
    fn cancel_requested(
        &self,
        run_id: Uuid,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
    /// Notes that a run's job reached the jobs queue.
    fn mark_published(&self, run_id: Uuid) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// Jobs accepted before `accepted_before` (RFC 3339) that were stored but never confirmed
    /// on the jobs queue (a crash or a broker outage in between).
    fn unpublished_jobs(
        &self,
        accepted_before: String,
    ) -> impl Future<Output = Result<Vec<Job>, StoreError>> + Send;
    /// Lists runs, newest first, optionally filtered, after a cursor from an earlier page.
    fn list_runs(
        &self,
        filter: RunFilter,
    ) -> impl Future<Output = Result<(Vec<RunSummary>, Option<i64>), StoreError>> + Send;
    /// Deletes what a retention policy no longer keeps (see [`Prune`]); returns how much.
    fn prune(&self, prune: Prune) -> impl Future<Output = Result<Pruned, StoreError>> + Send;
    /// Checks the store answers.
    fn ping(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
    /// How many runs are in each state (states with none are left out).
    fn count_by_state(
        &self,
    ) -> impl Future<Output = Result<Vec<(RunState, u64)>, StoreError>> + Send;
    /// The latest state reasons of the queued runs (at most 10,000): those of runs waiting for
    /// a profile's cap name the profile.
    fn queued_reasons(&self) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;
    /// The runs that ended (reached a terminal state) at `since` or later, each with the body
    /// of each of its `webhook` events (`None` for a run with none).
    fn ended_with_webhooks(
        &self,
        since: String,
    ) -> impl Future<Output = Result<Vec<(Uuid, Option<String>)>, StoreError>> + Send;
    /// Reads a run's events in the order they were stored, after position `after` (0 for all).
    /// Returns each event with its position.
    fn events(
        &self,
        run_id: Uuid,
        after: i64,
    ) -> impl Future<Output = Result<Vec<(i64, Event)>, StoreError>> + Send;
    /// Like [`RunStore::events`], at most `limit` of them: a page, so that a reader of a long
    /// history never holds all of it at once.
    fn events_page(
        &self,
        run_id: Uuid,
        after: i64,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<(i64, Event)>, StoreError>> + Send;
    /// The position of a stored event, by its id.
    fn position_of(
        &self,
        event_id: Uuid,
    ) -> impl Future<Output = Result<Option<i64>, StoreError>> + Send;
    /// A run's events of the given kinds, oldest first: the first `limit` of them, or with
    /// `newest` the last `limit` (a log's tail). Read through the `(run, kind, position)`
    /// index, so a run's long log costs nothing to skip.
    fn events_of_kinds(
        &self,
        run_id: Uuid,
        kinds: &'static [&'static str],
        newest: bool,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<(i64, Event)>, StoreError>> + Send;
    /// In one transaction: takes `allot.returned` back from what `allot.profile` was allotted
    /// on `allot.day`, then allots what [`proto::allotment::grant`] gives for `allot.want`
    /// (nothing, and why, once the day's limit is reached).
    fn allot(
        &self,
        allot: Allot,
    ) -> impl Future<Output = Result<Result<Spend, String>, StoreError>> + Send;
    /// Keeps the highest count of lost executions reported for `run_id` and returns it (0
    /// for a run the store does not hold).
    fn record_lost(
        &self,
        run_id: Uuid,
        lost: u32,
    ) -> impl Future<Output = Result<u32, StoreError>> + Send;
}

/// One allotment of a profile's daily budget (see [`RunStore::allot`]).
#[derive(Debug, Clone)]
pub struct Allot {
    /// The profile.
    pub profile: String,
    /// The dispatcher's UTC day.
    pub day: String,
    /// The profile's daily limits.
    pub limits: proto::Budget,
    /// What a gateway needs.
    pub want: Spend,
    /// What it hands back.
    pub returned: Spend,
}

impl Allot {
    /// The new total and the grant, from the total allotted so far.
    pub(crate) fn apply(&self, total: Spend) -> (Spend, Result<Spend, String>) {
        proto::allotment::allot(&self.profile, &self.limits, total, self.want, self.returned)
    }
}

/// The event kinds a run page's timeline is made of: everything but the log, the
/// heartbeats, the checkpoints and the result (which the run itself carries).
pub const TIMELINE_KINDS: &[&str] = &[
    "state",
    "stage_started",
    "stage_finished",
    "check",
    "cycle",
    "cancel_requested",
    "pull_request",
    "webhook",
];

/// What [`RunStore::prune`] deletes. Only runs in a terminal state are touched, and only by
/// the time of their last change as stored (`updated_at`, RFC 3339: the time of the event
/// that changed it, on its worker's clock; keep the clocks in sync).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prune {
    /// The `heartbeat` and `log` events of runs that ended before this time.
    pub chatter_before: Option<String>,
    /// Runs that ended before this time, with everything stored of them.
    pub runs_before: Option<String>,
}

/// What [`RunStore::prune`] deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Heartbeat and log events deleted (of runs that are kept).
    pub chatter: u64,
    /// Runs deleted, each with its events, states and cycle files.
    pub runs: u64,
}

/// How many runs one transaction of [`RunStore::prune`] deletes.
pub(crate) const PRUNE_RUNS_BATCH: u64 = 200;
/// How many heartbeat and log events one transaction of [`RunStore::prune`] deletes.
pub(crate) const PRUNE_EVENTS_BATCH: u64 = 5000;

/// The `state` values of runs that ended, as an SQL list.
pub(crate) const TERMINAL_STATES_SQL: &str =
    "('delivered', 'delivered_with_warnings', 'blocked', 'failed', 'cancelled')";

/// Which runs `list_runs` returns.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    /// Only runs in this state.
    pub state: Option<RunState>,
    /// Only runs of this ticket.
    pub ticket: Option<String>,
    /// Only runs of this skill.
    pub skill: Option<String>,
    /// At most this many (1..=500).
    pub limit: u32,
    /// Continue after this cursor (the `next_cursor` of the page before).
    pub cursor: Option<i64>,
}

/// The run store a `FORGEPOOL_DATABASE_URL` names: PostgreSQL for `postgres://` and
/// `postgresql://` URLs, SQLite for anything else (a path or a `sqlite://` URL).
#[derive(Debug, Clone)]
pub enum Store {
    /// A SQLite file.
    Sqlite(SqliteStore),
    /// A PostgreSQL database.
    Postgres(PostgresStore),
}

/// Whether opening a store brings its schema up to this release's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    /// Run the migrations in this process (refinery, and the regex engine it brings along).
    Migrate,
    /// They already ran, in a short-lived process of their own (`forgepool dispatcher` runs
    /// them in a child, so the regex engine's tables never live in the long-lived process).
    Migrated,
}

impl Store {
    /// Opens the store `url` names, creating its tables when needed.
    pub async fn open(url: &str) -> Result<Store, StoreError> {
        Store::open_with(url, Schema::Migrate).await
    }

    /// Opens the store `url` names; `schema` says whether its migrations run here.
    pub async fn open_with(url: &str, schema: Schema) -> Result<Store, StoreError> {
        if is_postgres_url(url) {
            return Ok(Store::Postgres(PostgresStore::open(url, schema).await?));
        }
        let url = url.to_string();
        tokio::task::spawn_blocking(move || SqliteStore::open_with(&url, schema))
            .await
            .map_err(|e| StoreError::Task(e.to_string()))?
            .map(Store::Sqlite)
    }

    /// `"sqlite"` or `"postgres"`, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Store::Sqlite(_) => "sqlite",
            Store::Postgres(_) => "postgres",
        }
    }
}

/// Whether a database URL names PostgreSQL.
pub fn is_postgres_url(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            Store::Sqlite($store) => $call,
            Store::Postgres($store) => $call,
        }
    };
}

impl RunStore for Store {
    async fn insert_run_once(
        &self,
        job: &Job,
        key: Option<&str>,
    ) -> Result<Option<Uuid>, StoreError> {
        delegate!(self, s => s.insert_run_once(job, key).await)
    }
    async fn run_of_key(&self, key: &str) -> Result<Option<Uuid>, StoreError> {
        delegate!(self, s => s.run_of_key(key).await)
    }
    async fn record(&self, event: &Event) -> Result<Recorded, StoreError> {
        delegate!(self, s => s.record(event).await)
    }
    async fn get_run(&self, run_id: Uuid) -> Result<Option<RunRecord>, StoreError> {
        delegate!(self, s => s.get_run(run_id).await)
    }
    async fn job_of(&self, run_id: Uuid) -> Result<Option<Job>, StoreError> {
        delegate!(self, s => s.job_of(run_id).await)
    }
    async fn cancel_requested(&self, run_id: Uuid) -> Result<bool, StoreError> {
        delegate!(self, s => s.cancel_requested(run_id).await)
    }
    async fn silent_runs(&self, before: String) -> Result<Vec<Job>, StoreError> {
        delegate!(self, s => s.silent_runs(before).await)
    }
    async fn mark_unpublished(&self, run_id: Uuid) -> Result<(), StoreError> {
        delegate!(self, s => s.mark_unpublished(run_id).await)
    }
    async fn mark_published(&self, run_id: Uuid) -> Result<(), StoreError> {
        delegate!(self, s => s.mark_published(run_id).await)
    }
    async fn unpublished_jobs(&self, accepted_before: String) -> Result<Vec<Job>, StoreError> {
        delegate!(self, s => s.unpublished_jobs(accepted_before).await)
    }
    async fn list_runs(
        &self,
        filter: RunFilter,
    ) -> Result<(Vec<RunSummary>, Option<i64>), StoreError> {
        delegate!(self, s => s.list_runs(filter).await)
    }
    async fn prune(&self, prune: Prune) -> Result<Pruned, StoreError> {
        delegate!(self, s => s.prune(prune).await)
    }
    async fn ping(&self) -> Result<(), StoreError> {
        delegate!(self, s => s.ping().await)
    }
    async fn count_by_state(&self) -> Result<Vec<(RunState, u64)>, StoreError> {
        delegate!(self, s => s.count_by_state().await)
    }
    async fn queued_reasons(&self) -> Result<Vec<String>, StoreError> {
        delegate!(self, s => s.queued_reasons().await)
    }
    async fn ended_with_webhooks(
        &self,
        since: String,
    ) -> Result<Vec<(Uuid, Option<String>)>, StoreError> {
        delegate!(self, s => s.ended_with_webhooks(since).await)
    }
    async fn events(&self, run_id: Uuid, after: i64) -> Result<Vec<(i64, Event)>, StoreError> {
        delegate!(self, s => s.events(run_id, after).await)
    }
    async fn events_page(
        &self,
        run_id: Uuid,
        after: i64,
        limit: u32,
    ) -> Result<Vec<(i64, Event)>, StoreError> {
        delegate!(self, s => s.events_page(run_id, after, limit).await)
    }
    async fn position_of(&self, event_id: Uuid) -> Result<Option<i64>, StoreError> {
        delegate!(self, s => s.position_of(event_id).await)
    }
    async fn events_of_kinds(
        &self,
        run_id: Uuid,
        kinds: &'static [&'static str],
        newest: bool,
        limit: u32,
    ) -> Result<Vec<(i64, Event)>, StoreError> {
        delegate!(self, s => s.events_of_kinds(run_id, kinds, newest, limit).await)
    }
    async fn allot(&self, allot: Allot) -> Result<Result<Spend, String>, StoreError> {
        delegate!(self, s => s.allot(allot).await)
    }
    async fn record_lost(&self, run_id: Uuid, lost: u32) -> Result<u32, StoreError> {
        delegate!(self, s => s.record_lost(run_id, lost).await)
    }
}

/// The reason recorded with the first state of a run.
/// The latest state reason of each queued run.
const QUEUED_REASONS: &str = "SELECT (SELECT h.reason FROM state_history h WHERE h.run_id = r.run_id ORDER BY h.id DESC LIMIT 1) FROM runs r WHERE r.state = 'queued' LIMIT 10000";

/// The runs that ended since `?1`, with their webhook events' bodies.
const ENDED_WITH_WEBHOOKS: &str = "SELECT r.run_id, e.body FROM runs r LEFT JOIN events e ON e.run_id = r.run_id AND e.kind = 'webhook' WHERE r.state IN ('delivered', 'delivered_with_warnings', 'blocked', 'failed', 'cancelled') AND r.updated_at >= ";

/// How many queued runs wait for each profile's cap, from their latest state reasons.
pub fn waiting_by_profile(reasons: &[String]) -> Vec<(String, i64)> {
    let mut counts = std::collections::BTreeMap::<String, i64>::new();
    for profile in reasons.iter().filter_map(|r| proto::waiting_profile(r)) {
        *counts.entry(profile.to_string()).or_default() += 1;
    }
    counts.into_iter().collect()
}

fn accepted_reason(job: &Job) -> String {
    if job.warnings.is_empty() {
        "accepted".to_string()
    } else {
        format!("accepted with {} warning(s)", job.warnings.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::EventKind;

    /// Catches: events of a superseded execution that change the run, or a new execution that
    /// cannot take over.
    #[test]
    fn a_newer_execution_fences_off_an_older_one() {
        let run = Uuid::new_v4();
        let (old, new) = (Uuid::new_v4(), Uuid::new_v4());
        let running = |by: Uuid| {
            Event::new(
                run,
                EventKind::State {
                    state: RunState::Running,
                    reason: String::new(),
                },
            )
            .by(by)
        };
        let beat = |by: Uuid| Event::new(run, EventKind::Heartbeat { worker: "w".into() }).by(by);
        let (old_id, new_id) = (old.to_string(), new.to_string());
        // The first execution takes the run.
        assert_eq!(
            fence(&running(old), Some("queued"), None),
            Fence::TakesOver(old_id.clone())
        );
        assert_eq!(
            fence(&beat(old), Some("running"), Some(&old_id)),
            Fence::Current
        );
        // A new one takes over; the old one's events change nothing from then on.
        assert_eq!(
            fence(&running(new), Some("running"), Some(&old_id)),
            Fence::TakesOver(new_id.clone())
        );
        assert_eq!(
            fence(&beat(old), Some("running"), Some(&new_id)),
            Fence::Superseded
        );
        // A finished run takes no new execution; the dispatcher's own events always apply.
        assert_eq!(
            fence(&running(old), Some("delivered"), Some(&new_id)),
            Fence::Superseded
        );
        let own = Event::new(
            run,
            EventKind::CancelRequested {
                reason: String::new(),
            },
        );
        assert_eq!(fence(&own, Some("running"), Some(&new_id)), Fence::Current);
        // An execution's events before any running state (none normally) apply.
        assert_eq!(fence(&beat(old), Some("queued"), None), Fence::Current);
    }
}
