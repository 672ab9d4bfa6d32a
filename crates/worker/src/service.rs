//! `forgepool worker`: takes jobs from RabbitMQ and runs them with the engine.
//!
//! This file is wiring: it builds the worker's parts ([`crate::amqp`]), starts its loops
//! (jobs, cancel requests, the sweep, queue depths), and drains on shutdown: no new jobs,
//! in-flight runs get the drain time to finish, then they are interrupted and handed back.
//!
//! It is generic over the runtime. At SIGTERM it stops consuming, and each run finishes the stage
//! it is in and is handed back at that boundary (`RunControl`'s `handover`, checked by the
//! engine's loop before each stage; a run with only its delivery left delivers); runs still in a
//! stage when the drain time is over are interrupted and handed back.

use std::sync::Arc;
use std::time::Duration;

use proto::amqp::{self, AmqpError, Publisher, Topology};
use telemetry::Metrics;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::amqp::{
    sweep, AmqpGate, AmqpLedger, AmqpSink, Cancels, InFlight, JobFeed, Jobs, Leases, PauseBook,
};
pub use crate::config::WorkerConfig;
use crate::engine::Engine;
use crate::ports::gate::Pauses;
use crate::runtime::ContainerRuntime;

/// A failure that stops the worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The broker could not be set up.
    #[error(transparent)]
    Amqp(#[from] AmqpError),
}

/// Runs the worker until `shutdown` is cancelled, then drains: no new jobs, in-flight runs get
/// `drain` to finish, then they are interrupted and handed back to the queue.
pub async fn run<R: ContainerRuntime>(
    config: WorkerConfig,
    engine: Engine<R>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let topology = Topology::new(&config.prefix);
    let publisher = Arc::new(Publisher::new(
        &config.amqp_url,
        "forgepool-worker-publish",
    )?);
    // The broker is waited for as long as it takes (`/readyz` answers 503 meanwhile).
    if !amqp::declare_with_retry(&publisher, &topology, &shutdown).await {
        return Ok(());
    }
    let in_flight = Arc::new(InFlight::default());
    let instance = engine.runtime().instance().to_string();
    let leases = Arc::new(Leases::new(
        &config.amqp_url,
        topology.clone(),
        &instance,
        Arc::clone(&in_flight),
    ));
    let (gate, pause_book) = gate(&config, &topology, &leases, &publisher, &metrics);
    let engine = engine.with_gate(Arc::clone(&gate) as Arc<dyn crate::ports::gate::ProfileGate>);
    let jobs = Arc::new(Jobs {
        sink: AmqpSink::new(
            Arc::clone(&publisher),
            topology.clone(),
            config.publish_deadline,
        ),
        slots: Arc::new(Semaphore::new(config.concurrency)),
        ledger: AmqpLedger::new(
            &config.amqp_url,
            topology.clone(),
            Arc::clone(&publisher),
            config.job_key.clone(),
        ),
        leases,
        gate,
        in_flight,
        metrics,
        config,
        topology,
        engine,
        publisher,
        interrupt: CancellationToken::new(),
        draining: CancellationToken::new(),
    });
    if let Err(error) = jobs.engine.runtime().remove_orphans().await {
        warn!(%error, "orphan cleanup failed");
    }
    let background = TaskTracker::new();
    let cancels = Cancels::new(
        &jobs.config.amqp_url,
        jobs.topology.clone(),
        Arc::clone(&jobs.in_flight),
    );
    background.spawn(Arc::clone(&pause_book).expire(shutdown.clone()));
    background.spawn(cancels.with_pauses(pause_book).listen(shutdown.clone()));
    let swept = Arc::clone(&jobs);
    let sweep_shutdown = shutdown.clone();
    background.spawn(async move {
        sweep(
            &swept.leases,
            swept.engine.runtime().as_ref(),
            sweep_shutdown,
        )
        .await;
    });
    background.spawn(watch_queues(Arc::clone(&jobs), shutdown.clone()));
    background.spawn(remove_left_run_folders(Arc::clone(&jobs), shutdown.clone()));
    background.spawn(crate::amqp::roster::announce(
        Arc::clone(&jobs),
        shutdown.clone(),
    ));
    jobs.metrics.set_run_slots(jobs.config.concurrency);
    info!(worker = %jobs.config.worker_id, slots = jobs.config.concurrency, "worker started");

    let feed = JobFeed {
        jobs: Arc::clone(&jobs),
        runs: TaskTracker::new(),
    };
    let consuming = amqp::consume(&feed, &shutdown).await;
    jobs.draining.cancel();
    drain(&jobs, &feed.runs).await;
    // Deliveries in flight were settled on the consuming session: it can go now.
    if let Some(session) = consuming {
        session.close().await;
    }
    background.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), background.wait()).await;
    // Goodbyes to the broker, rather than sockets dropped with the runtime.
    jobs.leases.close().await;
    jobs.ledger.close().await;
    jobs.publisher.close().await;
    info!("worker stopped");
    Ok(())
}

/// The pool's profile gate on the broker, and the book of profile pauses it reads.
fn gate(
    config: &WorkerConfig,
    topology: &Topology,
    leases: &Arc<Leases>,
    publisher: &Arc<Publisher>,
    metrics: &Arc<Metrics>,
) -> (Arc<AmqpGate>, Arc<PauseBook>) {
    let pauses = Arc::new(Pauses::default());
    let gate = Arc::new(AmqpGate::new(
        Arc::clone(leases),
        Arc::clone(publisher),
        topology.clone(),
        Arc::clone(&pauses),
        config.job_key.clone(),
    ));
    let profiles = config.profiles.keys().cloned().collect();
    let book = PauseBook::new(
        topology.clone(),
        pauses,
        Arc::clone(metrics),
        (config.job_key.clone(), profiles),
    );
    (gate, Arc::new(book))
}

/// Waits for the runs in flight for the drain time, then interrupts them (they are handed
/// back) and waits up to a minute more.
async fn drain<R: ContainerRuntime>(jobs: &Jobs<R>, runs: &TaskTracker) {
    info!(in_flight = runs.len(), "draining");
    runs.close();
    if tokio::time::timeout(jobs.config.drain, runs.wait())
        .await
        .is_err()
    {
        warn!("drain time is over; handing in-flight runs back");
        jobs.interrupt.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(60), runs.wait()).await;
    }
}

/// Removes the run folders killed workers left in this worker's workspace root (at start,
/// then every 30 s: a predecessor killed just before this process started may still be
/// dying).
async fn remove_left_run_folders<R: ContainerRuntime>(
    jobs: Arc<Jobs<R>>,
    shutdown: CancellationToken,
) {
    let root = jobs.engine.workspace_root().to_path_buf();
    loop {
        crate::workspace::leftovers::remove_left_behind(&root).await;
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(30)) => {},
            () = shutdown.cancelled() => return,
        }
    }
}

/// Keeps `forge_queue_depth` fresh, as this worker's broker connection sees it.
async fn watch_queues<R: ContainerRuntime>(jobs: Arc<Jobs<R>>, shutdown: CancellationToken) {
    let queues = jobs.topology.watched_queues();
    loop {
        match jobs.publisher.queue_depths(&queues).await {
            Ok(depths) => jobs.metrics.set_queue_depths(&depths),
            Err(error) => debug!(%error, "cannot read queue depths"),
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {},
            () = shutdown.cancelled() => return,
        }
    }
}
