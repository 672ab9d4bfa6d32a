//! `forgepool dispatcher`: the HTTP API, the submission queue, and the events consumer.
//!
//! One process owns the run store. Submissions (HTTP or the submission queue) are frozen,
//! stored, then published to the jobs queue with a confirm; a run stored but not yet confirmed
//! is published again by a background task, so a broker outage loses no accepted run. Every
//! event workers publish is stored before it is acknowledged, and wakes the watchers.
//!
//! `run` serves HTTP at once, then declares the topology with retries, then starts the consumers,
//! the republisher and the gauges; `ready` is called last.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proto::amqp::{self, AmqpError, Publisher, Topology};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::amqp::{consume, Queue};
use crate::dispatcher::{Dispatcher, PUBLISH_DEADLINE};
use crate::store::{RunStore, Store, StoreError};
use crate::AgentBook;
use telemetry::Metrics;

/// How often stored-but-unpublished runs are retried.
const REPUBLISH_INTERVAL: Duration = Duration::from_secs(5);
/// How often queue depths and runs by state are read for the metrics.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// The dispatcher's settings, validated before it starts.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    /// RabbitMQ URL.
    pub amqp_url: String,
    /// Prefix of queue and exchange names.
    pub prefix: String,
    /// The run store: a SQLite path or `sqlite://` URL, or a `postgres://` URL.
    pub database_url: String,
    /// Whether the store's migrations run in this process or already ran in another.
    pub schema: crate::store::Schema,
    /// The skills directory, read at each submission.
    pub skills_dir: PathBuf,
    /// The agent profiles, loaded at start.
    pub agents: AgentBook,
    /// The bearer token; `None` turns authentication off.
    pub api_token: Option<String>,
    /// The key that signs every job (`FORGEPOOL_JOB_KEY`), shared with the workers.
    pub job_key: proto::JobKey,
    /// The repository URL schemes accepted at submission.
    pub allowed_schemes: Vec<String>,
    /// How long a running run may go unheard before its job is queued again
    /// (`FORGEPOOL_SILENT_RUN_SECONDS`).
    pub silent_after: Duration,
    /// How long a published job stays valid (`FORGEPOOL_JOB_TTL`).
    pub job_ttl: Duration,
    /// Whether paused runs resume by themselves when their profile's pause ends
    /// (`FORGEPOOL_AUTO_RESUME`).
    pub auto_resume: bool,
    /// Whether other dispatchers store events in the same store (`FORGEPOOL_SHARED_STORE`).
    pub shared_store: bool,
    /// The webhooks told of runs that end (`FORGEPOOL_WEBHOOKS_FILE`).
    pub webhooks: Option<crate::webhooks::Webhooks>,
    /// The trackers tickets come from (`FORGEPOOL_TRACKERS_FILE`).
    pub trackers: Option<std::sync::Arc<crate::trackers::set::Trackers>>,
    /// What the store keeps of runs that ended (`FORGEPOOL_RETAIN_LOGS`,
    /// `FORGEPOOL_RETAIN_RUNS`).
    pub retention: crate::retention::Retention,
}

/// Where the dispatcher listens: the API, and `/metrics` apart from it when the operator gives
/// it a port of its own (`FORGEPOOL_DISPATCHER_METRICS_ADDR`).
#[derive(Debug)]
pub struct Listeners {
    /// The API (and `/metrics`, without a port of its own).
    pub api: tokio::net::TcpListener,
    /// `/metrics`, `/healthz` and `/readyz`, apart from the API.
    pub metrics: Option<tokio::net::TcpListener>,
}

/// The queue of runs that ended, for the webhooks; none without webhooks.
type EndedRuns = Option<(
    Arc<crate::webhooks::Webhooks>,
    tokio::sync::mpsc::Receiver<uuid::Uuid>,
)>;

fn ended_queue(
    webhooks: Option<crate::webhooks::Webhooks>,
) -> (Option<crate::webhooks::Ended>, EndedRuns) {
    match webhooks {
        Some(webhooks) => {
            let (sender, receiver) = tokio::sync::mpsc::channel(crate::notifier::ENDED_QUEUE);
            let dropped = AtomicBool::new(false);
            let ended = crate::webhooks::Ended { sender, dropped };
            (Some(ended), Some((Arc::new(webhooks), receiver)))
        }
        None => (None, None),
    }
}

/// A failure that stops the dispatcher.
#[derive(Debug, thiserror::Error)]
pub enum DispatcherError {
    /// The store could not be opened.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The broker could not be set up.
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    /// The HTTP server failed.
    #[error("HTTP server failed: {0}")]
    Serve(std::io::Error),
}

/// Runs the dispatcher until `shutdown` is cancelled: HTTP on `listeners` (served at once), the
/// consumers, and the republisher. `ready` is called once the broker topology exists and the
/// consumers are started (the broker is waited for as long as it takes, with `/readyz` at 503
/// meanwhile). Shutdown stops accepting HTTP first, then the consumers.
pub async fn run(
    config: DispatcherConfig,
    listeners: Listeners,
    shutdown: CancellationToken,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<(), DispatcherError> {
    let store = Store::open_with(&config.database_url, config.schema).await?;
    let config_silent_after = config.silent_after;
    info!(store = store.kind(), "run store open");
    let topology = Topology::new(&config.prefix);
    let publisher = Publisher::new(&config.amqp_url, "forgepool-dispatcher-publish")?;
    let (events_stored, _) = tokio::sync::broadcast::channel(crate::dispatcher::LIVE_EVENTS);
    let (ended, ended_runs) = ended_queue(config.webhooks);
    let dispatcher = Arc::new(Dispatcher {
        store,
        publisher,
        topology,
        skills_dir: config.skills_dir,
        agents: config.agents,
        job_key: config.job_key,
        job_ttl: config.job_ttl,
        allowed_schemes: config.allowed_schemes,
        api_token: config.api_token,
        events_stored,
        pool: std::sync::Mutex::default(),
        roster: crate::roster::Roster::default(),
        event_order: (0..crate::amqp::EVENT_LANES)
            .map(|_| tokio::sync::Mutex::default())
            .collect(),
        jobs: crate::job_cache::JobCache::default(),
        shared_store: config.shared_store,
        broker_ready: AtomicBool::new(false),
        metrics_apart: listeners.metrics.is_some(),
        topology_ready: AtomicBool::new(false),
        stopping: shutdown.clone(),
        metrics: Metrics::new(telemetry::Role::Dispatcher),
        streams: Arc::default(),
        amqp_url: config.amqp_url,
        resumes: crate::schedule::Schedule::new(config.auto_resume),
        ended,
        trackers: config.trackers,
    });
    crate::trackers::start(Arc::clone(&dispatcher));
    // The API answers from the start, so that nobody waits on a bound socket while RabbitMQ is
    // set up: `/readyz` says 503 until the events consumer is connected, and a run submitted
    // before the topology exists is stored and published by the republisher afterwards.
    let Listeners {
        api: listener,
        metrics: metrics_listener,
    } = listeners;
    let address = listener.local_addr().map_err(DispatcherError::Serve)?;
    if let Some(metrics_listener) = metrics_listener {
        let (app, stop) = (
            crate::http::metrics_router(Arc::clone(&dispatcher)),
            shutdown.clone(),
        );
        tokio::spawn(async move { crate::serve::serve(metrics_listener, app, stop).await });
    }
    let app = crate::http::router(Arc::clone(&dispatcher));
    let serve_shutdown = shutdown.clone();
    let server =
        tokio::spawn(async move { crate::serve::serve(listener, app, serve_shutdown).await });
    let declared =
        amqp::declare_with_retry(&dispatcher.publisher, &dispatcher.topology, &shutdown).await;
    // Stopped while RabbitMQ was being set up: nothing else was started, so nothing is lost.
    if !declared {
        shutdown.cancel();
        return stop_server(server, &shutdown).await;
    }
    let declared_at = std::time::SystemTime::now();
    dispatcher.topology_ready.store(true, Ordering::SeqCst);
    let background = Background {
        retention: config.retention,
        ended_runs,
        auto_resume: config.auto_resume,
        silent_after: config_silent_after,
    };
    let tasks = start_background(&dispatcher, background, declared_at, &shutdown);

    info!(%address, "dispatcher listening");
    ready(address);
    // The server ends once shutdown is cancelled and its connections close.
    let served = stop_server(server, &shutdown).await;
    shutdown.cancel();
    if tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .is_err()
    {
        warn!("background tasks did not stop within 10 s");
    }
    dispatcher.publisher.close().await;
    info!("dispatcher stopped");
    served
}

/// What the dispatcher runs beside its API once the broker is set up.
struct Background {
    retention: crate::retention::Retention,
    ended_runs: EndedRuns,
    auto_resume: bool,
    silent_after: Duration,
}

/// Starts the consumers and the loops (republisher, gauges, retention, webhooks, automatic
/// resumes, silent runs); the tracker is closed, to be waited on at shutdown.
fn start_background(
    dispatcher: &Arc<Dispatcher>,
    background: Background,
    declared_at: std::time::SystemTime,
    shutdown: &CancellationToken,
) -> TaskTracker {
    let tasks = TaskTracker::new();
    for queue in [
        Queue::Events,
        Queue::Submissions,
        Queue::DeadLetters,
        Queue::Executions,
        Queue::Allotments,
        Queue::Roster,
    ] {
        tasks.spawn(consume(Arc::clone(dispatcher), queue, shutdown.clone()));
    }
    tasks.spawn(republish(
        Arc::clone(dispatcher),
        declared_at,
        shutdown.clone(),
    ));
    tasks.spawn(refresh_gauges(Arc::clone(dispatcher), shutdown.clone()));
    tasks.spawn(crate::retention::keep_pruning(
        Arc::clone(dispatcher),
        background.retention,
        shutdown.clone(),
    ));
    if let Some((webhooks, receiver)) = background.ended_runs {
        tasks.spawn(crate::notifier::notify_ended(
            Arc::clone(dispatcher),
            webhooks,
            receiver,
            shutdown.clone(),
        ));
    }
    if background.auto_resume {
        tasks.spawn(crate::resumer::resume_when_due(
            Arc::clone(dispatcher),
            shutdown.clone(),
        ));
    }
    tasks.spawn(requeue_silent_runs(
        Arc::clone(dispatcher),
        background.silent_after,
        shutdown.clone(),
    ));
    tasks.close();
    tasks
}

/// How long the HTTP server gets, after shutdown, for the requests in flight.
const SERVE_DRAIN: Duration = Duration::from_secs(15);

/// Waits for the HTTP server task to end. Once `shutdown` is cancelled it gets [`SERVE_DRAIN`]
/// for the requests in flight (event streams end on shutdown); then it is aborted.
async fn stop_server(
    mut server: tokio::task::JoinHandle<std::io::Result<()>>,
    shutdown: &CancellationToken,
) -> Result<(), DispatcherError> {
    let ended = tokio::select! {
        ended = &mut server => Some(ended),
        () = shutdown.cancelled() => tokio::time::timeout(SERVE_DRAIN, &mut server).await.ok(),
    };
    match ended {
        Some(Ok(result)) => result.map_err(DispatcherError::Serve),
        Some(Err(panicked)) => Err(DispatcherError::Serve(std::io::Error::other(panicked))),
        None => {
            server.abort();
            warn!("HTTP requests still open {SERVE_DRAIN:?} after shutdown were cut");
            Ok(())
        }
    }
}

/// Keeps `forge_queue_depth` and `forgepool_runs_by_state{state}` fresh.
async fn refresh_gauges(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    let queues = dispatcher.topology.watched_queues();
    let jobs = dispatcher.topology.jobs();
    loop {
        let mut pool = proto::PoolView::default();
        match dispatcher.publisher.queue_stats(&queues).await {
            Ok(stats) => {
                let depths: Vec<_> = stats
                    .iter()
                    .map(|(q, ready, _)| (q.clone(), *ready))
                    .collect();
                dispatcher.metrics.set_queue_depths(&depths);
                if let Some((_, ready, consumers)) = stats.iter().find(|(q, _, _)| *q == jobs) {
                    (pool.queue_depth, pool.workers) = (*ready, *consumers);
                }
            }
            Err(error) => warn!(%error, "cannot read queue depths"),
        }
        match dispatcher.store.count_by_state().await {
            Ok(counts) => {
                dispatcher.metrics.set_runs_by_state(&counts);
                pool.busy_slots = counts
                    .iter()
                    .find(|(s, _)| *s == proto::RunState::Running)
                    .map_or(0, |(_, n)| *n);
                pool.runs_by_state = counts
                    .iter()
                    .map(|(s, n)| (s.as_str().to_string(), *n))
                    .collect();
            }
            Err(error) => warn!(%error, "cannot count runs by state"),
        }
        match dispatcher.store.queued_reasons().await {
            Ok(reasons) => {
                let waiting = crate::store::waiting_by_profile(&reasons);
                dispatcher.metrics.set_runs_waiting(&waiting);
                pool.waiting_for_profile = waiting
                    .into_iter()
                    .map(|(p, n)| (p, n.max(0) as u64))
                    .collect();
            }
            Err(error) => warn!(%error, "cannot count runs waiting for profiles"),
        }
        pool.sampled_at = Some(proto::timestamp_now());
        *dispatcher.pool.lock().unwrap_or_else(|e| e.into_inner()) = pool;
        tokio::select! {
            () = tokio::time::sleep(GAUGE_INTERVAL) => {},
            () = shutdown.cancelled() => return,
        }
    }
}

/// Publishes stored jobs that are not published yet. The first pass takes every job stored
/// before `declared_at` (submissions while RabbitMQ was set up were only stored); later passes
/// take jobs older than the inline publish's own deadline, so that a job being published right
/// now is not published twice.
async fn republish(
    dispatcher: Arc<Dispatcher>,
    declared_at: std::time::SystemTime,
    shutdown: CancellationToken,
) {
    let mut first = Some(declared_at);
    loop {
        let cutoff = first.take().unwrap_or_else(|| {
            std::time::SystemTime::now() - PUBLISH_DEADLINE - Duration::from_secs(5)
        });
        match dispatcher
            .store
            .unpublished_jobs(proto::format_timestamp(cutoff))
            .await
        {
            Ok(jobs) => {
                for job in jobs {
                    // A job published late may follow an execution (a run queued again).
                    if let Err(error) = dispatcher.publish_job(&job, true).await {
                        warn!(run_id = %job.run_id, %error, "still cannot publish the job");
                        break;
                    }
                    info!(run_id = %job.run_id, "published a stored job");
                }
            }
            Err(error) => warn!(%error, "cannot read unpublished jobs"),
        }
        tokio::select! {
            () = tokio::time::sleep(REPUBLISH_INTERVAL) => {},
            () = shutdown.cancelled() => return,
        }
    }
}

/// How often the dispatcher looks for silent runs.
const SILENT_CHECK: Duration = Duration::from_secs(15);

/// Queues again the job of every running run nothing was heard of for `silent_after` (its
/// worker vanished, and its job may be gone with it): the run is `queued` again, with the
/// reason, and the next worker continues from its last completed stage. A run whose job is
/// still held somewhere is settled by the lease, the done marker and the branch.
async fn requeue_silent_runs(
    dispatcher: Arc<Dispatcher>,
    silent_after: Duration,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(SILENT_CHECK) => {},
            () = shutdown.cancelled() => return,
        }
        let before = proto::format_timestamp(std::time::SystemTime::now() - silent_after);
        let silent = match dispatcher.store.silent_runs(before).await {
            Ok(silent) => silent,
            Err(error) => {
                warn!(%error, "cannot look for silent runs");
                continue;
            }
        };
        for job in silent {
            if let Err(error) = dispatcher.requeue_silent(&job, silent_after).await {
                warn!(run_id = %job.run_id, %error, "cannot queue a silent run again");
            }
        }
    }
}
