//! `forgepool dispatcher`: the HTTP API, the submission queue, and the events consumer.
//!
//! One process owns the run store. Submissions (HTTP or the submission queue) are frozen,
//! stored, then published to the jobs queue with a confirm; a run stored but not yet confirmed
//! is published again by a background task, so a broker outage loses no accepted run. Every
//! event workers publish is stored before it is acknowledged, and wakes the watchers.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use proto::amqp::{self, AmqpError, Publisher, Topology};
use proto::{Control, Event, EventKind, Job, RunRequest, RunState, SCHEMA_VERSION};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use tokio_util::task::TaskTracker;
use tracing::{info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::store::{RunStore, Store, StoreError};
use crate::{AgentBook, Freezer, Frozen, SubmitError};
use telemetry::Metrics;

/// How long publishing a job or a control message may keep retrying.
const PUBLISH_DEADLINE: Duration = Duration::from_secs(30);
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

/// Why a submission did not go through.
#[derive(Debug, thiserror::Error)]
pub enum SubmitFailure {
    /// The caller's mistake.
    #[error(transparent)]
    Invalid(#[from] SubmitError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Why a paused run could not be resumed.
#[derive(Debug, thiserror::Error)]
pub enum ResumeFailure {
    /// The run paused without a saved checkpoint.
    #[error("run {0} has no saved progress to resume from (its checkpoint could not be saved when it paused); submit a new run")]
    NoCheckpoint(Uuid),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The job could not be queued; the run stays paused.
    #[error("the resumed job could not be queued ({0}); the run stays paused, try again")]
    Broker(AmqpError),
}

/// The shared state of the dispatcher's tasks and handlers.
#[derive(Debug)]
pub struct Dispatcher {
    /// The run store.
    pub store: Store,
    /// The confirming publisher (jobs, control messages, dead letters).
    pub publisher: Publisher,
    /// Queue and exchange names.
    pub topology: Topology,
    skills_dir: PathBuf,
    agents: AgentBook,
    job_key: proto::JobKey,
    allowed_schemes: Vec<String>,
    /// The bearer token, when authentication is on.
    pub api_token: Option<String>,
    /// Bumped after every stored event; watchers wait on it.
    pub events_stored: watch::Sender<u64>,
    /// Whether the events consumer is connected (for `/readyz`).
    pub broker_ready: AtomicBool,
    /// Whether the broker topology is declared; before, a submission is only stored, and the
    /// republisher publishes it once the topology exists.
    topology_ready: AtomicBool,
    /// Cancelled at shutdown: event streams end, so that the HTTP server can stop.
    pub stopping: CancellationToken,
    /// What `/metrics` serves.
    pub metrics: Metrics,
    /// The event streams open per run, capped.
    pub streams: crate::http::StreamCounts,
    amqp_url: String,
}

impl Dispatcher {
    /// Validates, freezes, stores and publishes a request. A run that is stored but cannot be
    /// published yet is published later by the republisher; it is never lost.
    pub async fn submit(&self, request: RunRequest) -> Result<Frozen, SubmitFailure> {
        let freezer = Freezer::from_process_env(&self.skills_dir, self.agents.clone())
            .with_allowed_schemes(self.allowed_schemes.clone());
        // Freezing reads the skill's files: on a blocking thread, never the runtime's.
        let frozen = tokio::task::spawn_blocking(move || freezer.freeze(request))
            .await
            .unwrap_or_else(|panicked| std::panic::resume_unwind(panicked.into_panic()))?;
        self.store.insert_run(&frozen.job).await?;
        info!(run_id = %frozen.job.run_id, ticket = %frozen.job.ticket, "run accepted");
        if !self.topology_ready.load(Ordering::SeqCst) {
            // Publishing could only wait for the broker: the republisher publishes it as soon
            // as the queues exist.
            info!(run_id = %frozen.job.run_id, "job stored; it is published once RabbitMQ is set up");
        } else if let Err(error) = self.publish_job(&frozen.job).await {
            warn!(run_id = %frozen.job.run_id, %error, "job stored but not yet published; it will be retried");
        }
        Ok(frozen)
    }

    async fn publish_job(&self, job: &Job) -> Result<(), AmqpError> {
        let payload = serde_json::to_vec(job).unwrap_or_default();
        let headers = amqp::signature_headers(self.job_key.sign(&payload));
        self.publisher
            .publish_reliably(
                "",
                &self.topology.jobs(),
                &payload,
                Some(headers),
                PUBLISH_DEADLINE,
            )
            .await?;
        if let Err(error) = self.store.mark_published(job.run_id).await {
            warn!(run_id = %job.run_id, %error, "cannot mark the job published; it may be published twice");
        }
        Ok(())
    }

    /// Stores an event of `job`'s run; when it is new, counts it in the metrics and wakes the
    /// watchers. Returns whether it was new.
    pub async fn store_event(&self, job: &Job, event: &Event) -> Result<bool, StoreError> {
        self.store_event_after(RunState::Queued, job, event, false)
            .await
    }

    /// Like [`Dispatcher::store_event`] for a run whose state was `prior`: the outcome of a run
    /// that had already ended (a late duplicate), or an event that `repeats` one already
    /// counted, is stored but not counted again.
    async fn store_event_after(
        &self,
        prior: RunState,
        job: &Job,
        event: &Event,
        repeats: bool,
    ) -> Result<bool, StoreError> {
        let new = self.store.record_event(event).await?;
        let late_outcome = prior.is_terminal()
            && matches!(
                event.kind,
                EventKind::State { .. } | EventKind::Result { .. }
            );
        if new {
            if !late_outcome && !repeats {
                self.metrics.observe(job, &event.kind);
            }
            self.events_stored.send_modify(|n| *n += 1);
        }
        Ok(new)
    }

    /// Queues a paused run again with its latest checkpoint and its original frozen job, so
    /// it continues where it stopped with the same budget, limits and profiles. Returns the
    /// checkpoint's sequence number.
    pub async fn resume(&self, record: &crate::store::RunRecord) -> Result<u32, ResumeFailure> {
        let run_id = record.job.run_id;
        let events = self.store.events(run_id, 0).await?;
        let checkpoint = proto::latest_checkpoint(events.iter().map(|(_, event)| event))
            .ok_or(ResumeFailure::NoCheckpoint(run_id))?;
        let sequence = checkpoint.sequence;
        let queued = proto::resumed_event(run_id, &checkpoint);
        let mut job = record.job.clone();
        job.resume = Some(checkpoint);
        self.store_event(&record.job, &queued).await?;
        if let Err(error) = self.publish_job(&job).await {
            let paused = Event::new(
                run_id,
                EventKind::State {
                    state: RunState::Paused,
                    reason: format!("the resume could not be queued ({error}); try again"),
                },
            );
            self.store_event(&record.job, &paused).await?;
            return Err(ResumeFailure::Broker(error));
        }
        info!(%run_id, sequence, "run resumed");
        Ok(sequence)
    }

    /// Asks the workers to cancel a run; a queued run is cancelled in the store at once.
    pub async fn cancel(&self, job: &Job, state: RunState) -> Result<(), AmqpError> {
        if state == RunState::Queued {
            let event = Event::new(
                job.run_id,
                EventKind::State {
                    state: RunState::Cancelled,
                    reason: "cancelled by request before it started".into(),
                },
            );
            if let Err(error) = self.store_event(job, &event).await {
                warn!(run_id = %job.run_id, %error, "cannot store the cancellation");
            }
        }
        self.publish_cancel(job.run_id).await
    }

    async fn publish_cancel(&self, run_id: Uuid) -> Result<(), AmqpError> {
        let control = Control {
            schema_version: SCHEMA_VERSION,
            run_id,
            action: proto::ControlAction::Cancel,
        };
        let payload = serde_json::to_vec(&control).unwrap_or_default();
        // Control messages are not mandatory: no worker may hold the run right now.
        let send = async {
            let channel = self.publisher.channel().await?;
            let options = lapin::options::BasicPublishOptions::default();
            let properties = lapin::BasicProperties::default().with_delivery_mode(2);
            channel
                .basic_publish(
                    &self.topology.control(),
                    &format!("cancel.{run_id}"),
                    options,
                    &payload,
                    properties,
                )
                .await
                .map_err(|source| AmqpError::Broker {
                    operation: "publish cancel",
                    source,
                })?;
            Ok(())
        };
        tokio::time::timeout(amqp::PUBLISH_ATTEMPT_TIMEOUT, send)
            .await
            .unwrap_or_else(|_| {
                Err(AmqpError::Pool(
                    "the broker did not take the cancel request in time".into(),
                ))
            })
    }
}

/// Runs the dispatcher until `shutdown` is cancelled: HTTP on `listener` (served at once), the
/// consumers, and the republisher. `ready` is called once the broker topology exists and the
/// consumers are started. Shutdown stops accepting HTTP first, then the consumers.
pub async fn run(
    config: DispatcherConfig,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<(), DispatcherError> {
    let store = Store::open(&config.database_url).await?;
    info!(store = store.kind(), "run store open");
    let topology = Topology::new(&config.prefix);
    let publisher = Publisher::new(&config.amqp_url, "forgepool-dispatcher-publish")?;
    let (events_stored, _) = watch::channel(0);
    let dispatcher = Arc::new(Dispatcher {
        store,
        publisher,
        topology,
        skills_dir: config.skills_dir,
        agents: config.agents,
        job_key: config.job_key,
        allowed_schemes: config.allowed_schemes,
        api_token: config.api_token,
        events_stored,
        broker_ready: AtomicBool::new(false),
        topology_ready: AtomicBool::new(false),
        stopping: shutdown.clone(),
        metrics: Metrics::new(telemetry::Role::Dispatcher),
        streams: crate::http::StreamCounts::default(),
        amqp_url: config.amqp_url,
    });
    // The API answers from the start, so that nobody waits on a bound socket while RabbitMQ is
    // set up: `/readyz` says 503 until the events consumer is connected, and a run submitted
    // before the topology exists is stored and published by the republisher afterwards.
    let address = listener.local_addr().map_err(DispatcherError::Serve)?;
    let app = crate::http::router(Arc::clone(&dispatcher));
    let serve_shutdown = shutdown.clone();
    let server =
        tokio::spawn(async move { crate::serve::serve(listener, app, serve_shutdown).await });
    let declared = declare_with_retry(&dispatcher.publisher, &dispatcher.topology, &shutdown).await;
    // Stopped while RabbitMQ was being set up: nothing else was started, so nothing is lost.
    let stopped = shutdown.is_cancelled();
    if stopped || declared.is_err() {
        shutdown.cancel();
        let served = stop_server(server, &shutdown).await;
        return match declared {
            Err(error) if !stopped => Err(error.into()),
            _ => served,
        };
    }
    let declared_at = std::time::SystemTime::now();
    dispatcher.topology_ready.store(true, Ordering::SeqCst);
    let tasks = TaskTracker::new();
    tasks.spawn(consume_events(Arc::clone(&dispatcher), shutdown.clone()));
    tasks.spawn(consume_submissions(
        Arc::clone(&dispatcher),
        shutdown.clone(),
    ));
    tasks.spawn(consume_dead_letters(
        Arc::clone(&dispatcher),
        shutdown.clone(),
    ));
    tasks.spawn(republish(
        Arc::clone(&dispatcher),
        declared_at,
        shutdown.clone(),
    ));
    tasks.spawn(refresh_gauges(Arc::clone(&dispatcher), shutdown.clone()));
    tasks.close();

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

/// Declares the topology, retrying a broker that refuses or does not answer (30 attempts of up
/// to [`amqp::SESSION_TIMEOUT`]). Returns `Ok` as soon as `shutdown` is cancelled.
async fn declare_with_retry(
    publisher: &Publisher,
    topology: &Topology,
    shutdown: &CancellationToken,
) -> Result<(), AmqpError> {
    let mut attempts = 0;
    loop {
        let declare = async { topology.declare(&publisher.channel().await?).await };
        let result = tokio::select! {
            result = tokio::time::timeout(amqp::SESSION_TIMEOUT, declare) => result
                .unwrap_or_else(|_| Err(AmqpError::Pool("the broker did not answer in time".into()))),
            () = shutdown.cancelled() => return Ok(()),
        };
        match result {
            Ok(()) => return Ok(()),
            Err(error) if attempts < 30 && !shutdown.is_cancelled() => {
                attempts += 1;
                warn!(%error, "cannot set up RabbitMQ yet; retrying");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {},
                    () = shutdown.cancelled() => return Ok(()),
                }
            }
            Err(error) => return Err(error),
        }
    }
}

/// Consumes a queue until shutdown, reconnecting with backoff after a lost connection.
async fn consume_forever<F, Fut>(
    dispatcher: Arc<Dispatcher>,
    queue: String,
    name: &'static str,
    shutdown: CancellationToken,
    handle: F,
) where
    F: Fn(Arc<Dispatcher>, lapin::message::Delivery) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut backoff = Duration::from_millis(200);
    let mut connected_before = false;
    while !shutdown.is_cancelled() {
        let session =
            amqp::open_consumer(&dispatcher.amqp_url, name, &dispatcher.topology, &queue, 64);
        let (connection, channel, mut consumer) = match session.await {
            Ok(session) => session,
            Err(error) => {
                warn!(%error, queue = %queue, "consumer cannot connect; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {},
                    () = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        if connected_before {
            dispatcher.metrics.broker_reconnected(name);
        }
        connected_before = true;
        info!(queue = %queue, "consuming");
        if name == "forgepool-dispatcher-events" {
            dispatcher.broker_ready.store(true, Ordering::SeqCst);
        }
        loop {
            tokio::select! {
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => handle(Arc::clone(&dispatcher), delivery).await,
                    Some(Err(error)) => { warn!(%error, queue = %queue, "consumer failed; reconnecting"); break; }
                    None => { warn!(queue = %queue, "consumer closed; reconnecting"); break; }
                },
                () = shutdown.cancelled() => break,
            }
        }
        if name == "forgepool-dispatcher-events" {
            dispatcher.broker_ready.store(false, Ordering::SeqCst);
        }
        let _ = channel.close(200, "bye").await;
        let _ = connection.close(200, "bye").await;
    }
}

async fn consume_events(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    let queue = dispatcher.topology.dispatcher_events();
    consume_forever(
        dispatcher,
        queue,
        "forgepool-dispatcher-events",
        shutdown,
        handle_event,
    )
    .await;
}

async fn handle_event(dispatcher: Arc<Dispatcher>, delivery: lapin::message::Delivery) {
    let event = match decode::<Event>(&delivery.data) {
        Ok(event) => event,
        Err(reason) => {
            return dead_letter(
                &dispatcher,
                &dispatcher.topology.dispatcher_events(),
                delivery,
                &format!("not a valid event: {reason}"),
            )
            .await
        }
    };
    let span = info_span!("event", run_id = %event.run_id, kind = event.kind.name());
    async {
        let record = dispatcher.store.get_run(event.run_id).await.ok().flatten();
        let Some(record) = record else {
            return dead_letter(
                &dispatcher,
                &dispatcher.topology.dispatcher_events(),
                delivery,
                &format!("event for unknown run {}", event.run_id),
            )
            .await;
        };
        // A cycle file rewritten in place is one review cycle.
        let repeats = match &event.kind {
            EventKind::Cycle { cycle } => record
                .cycles
                .iter()
                .any(|c| c.step == cycle.step && c.file == cycle.file),
            _ => false,
        };
        match dispatcher
            .store_event_after(record.state, &record.job, &event, repeats)
            .await
        {
            Ok(_) => {
                // A worker picked up a run that was cancelled while queued: tell it again.
                if record.state == RunState::Cancelled
                    && matches!(
                        event.kind,
                        EventKind::State {
                            state: RunState::Running,
                            ..
                        }
                    )
                {
                    let _ = dispatcher.publish_cancel(event.run_id).await;
                }
                let _ = amqp::ack(&delivery).await;
            }
            Err(error) => {
                warn!(%error, "cannot store event; it will be delivered again");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = amqp::requeue(&delivery).await;
            }
        }
    }
    .instrument(span)
    .await
}

async fn consume_submissions(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    let queue = dispatcher.topology.submissions();
    consume_forever(
        dispatcher,
        queue,
        "forgepool-dispatcher-submissions",
        shutdown,
        handle_submission,
    )
    .await;
}

async fn handle_submission(dispatcher: Arc<Dispatcher>, delivery: lapin::message::Delivery) {
    if delivery.data.len() > crate::freeze::MAX_REQUEST_BYTES {
        let reason = format!(
            "oversized message: {} bytes, over the request limit of {}",
            delivery.data.len(),
            crate::freeze::MAX_REQUEST_BYTES
        );
        return dead_letter(
            &dispatcher,
            &dispatcher.topology.submissions(),
            delivery,
            &reason,
        )
        .await;
    }
    let request = match decode::<RunRequest>(&delivery.data) {
        Ok(request) => request,
        Err(reason) => {
            return dead_letter(
                &dispatcher,
                &dispatcher.topology.submissions(),
                delivery,
                &format!("not a valid run request: {reason}"),
            )
            .await
        }
    };
    let reply_to = delivery
        .properties
        .reply_to()
        .as_ref()
        .map(|r| r.to_string());
    let reply = match dispatcher.submit(request).await {
        Ok(frozen) => {
            let _ = amqp::ack(&delivery).await;
            serde_json::json!({"run_id": frozen.job.run_id, "state": "queued", "warnings": frozen.warnings})
        }
        Err(SubmitFailure::Invalid(error)) => {
            let reason = format!("refused: {error}");
            let body = serde_json::json!({"error": {"code": error.code(), "message": error.to_string(), "field": error.field()}});
            dead_letter(
                &dispatcher,
                &dispatcher.topology.submissions(),
                delivery,
                &reason,
            )
            .await;
            body
        }
        Err(SubmitFailure::Store(error)) => {
            warn!(%error, "cannot store a submission; it will be delivered again");
            let _ = amqp::requeue(&delivery).await;
            return;
        }
    };
    if let Some(reply_to) = reply_to {
        let payload = serde_json::to_vec(&reply).unwrap_or_default();
        if let Err(error) = dispatcher
            .publisher
            .publish("", &reply_to, &payload, None)
            .await
        {
            warn!(%error, "cannot reply to the submitter");
        }
    }
}

/// The largest message the dispatcher reads from a queue.
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Decodes a message, refusing oversized ones and a missing or unknown `schema_version` first.
pub fn decode<T: serde::de::DeserializeOwned>(data: &[u8]) -> Result<T, String> {
    proto::decode_message(data, MAX_MESSAGE_BYTES)
}

async fn dead_letter(
    dispatcher: &Dispatcher,
    source: &str,
    delivery: lapin::message::Delivery,
    reason: &str,
) {
    warn!(%reason, "dead-lettering a message");
    dispatcher.metrics.dead_lettered(source);
    match dispatcher
        .publisher
        .dead_letter(&dispatcher.topology, source, &delivery.data, reason, None)
        .await
    {
        Ok(()) => {
            let _ = amqp::ack(&delivery).await;
        }
        Err(error) => {
            warn!(%error, "cannot dead-letter; rejecting instead");
            let _ = amqp::reject(&delivery).await;
        }
    }
}

async fn consume_dead_letters(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    let queue = dispatcher.topology.dispatcher_dead();
    consume_forever(
        dispatcher,
        queue,
        "forgepool-dispatcher-dead",
        shutdown,
        handle_dead_letter,
    )
    .await;
}

/// A job taken off the jobs queue for good (refused by a worker, or given up on by the broker
/// after its delivery limit) fails its run, which would otherwise stay `queued` for ever. Other
/// dead letters are only kept in `{prefix}.dead` for operators.
async fn handle_dead_letter(dispatcher: Arc<Dispatcher>, delivery: lapin::message::Delivery) {
    let (source, reason) = amqp::dead_letter_origin(&delivery.properties);
    let from_jobs = source.is_some_and(|queue| {
        queue == dispatcher.topology.jobs() || queue == dispatcher.topology.jobs_wait()
    });
    // Only a job this dispatcher signed may fail its run: a forged message naming a real run
    // (refused by a worker) must not end that run.
    let signed = dispatcher
        .job_key
        .verify(
            &delivery.data,
            amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER).as_deref(),
        )
        .is_ok();
    let run_id = serde_json::from_slice::<serde_json::Value>(&delivery.data)
        .ok()
        .filter(|_| signed)
        .and_then(|message| Uuid::parse_str(message.get("run_id")?.as_str()?).ok());
    if let (true, Some(run_id)) = (from_jobs, run_id) {
        match dispatcher.store.get_run(run_id).await {
            Ok(Some(record)) if !record.state.is_terminal() => {
                let event = Event::new(
                    run_id,
                    EventKind::State {
                        state: RunState::Failed,
                        reason: format!(
                            "the job was dead-lettered: {reason}; it stays in the dead-letter queue for inspection, and the ticket can be submitted again"
                        ),
                    },
                );
                match dispatcher.store_event(&record.job, &event).await {
                    Ok(_) => warn!(%run_id, %reason, "a dead-lettered job failed its run"),
                    Err(error) => {
                        warn!(%error, "cannot fail a dead-lettered run; it will be retried");
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        let _ = amqp::requeue(&delivery).await;
                        return;
                    }
                }
            }
            Ok(_) => {}
            Err(error) => {
                warn!(%error, "cannot read a dead-lettered run; it will be retried");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = amqp::requeue(&delivery).await;
                return;
            }
        }
    }
    let _ = amqp::ack(&delivery).await;
}

/// Keeps `forge_queue_depth` and `forgepool_runs{state}` fresh.
async fn refresh_gauges(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    let queues = dispatcher.topology.watched_queues();
    loop {
        match dispatcher.publisher.queue_depths(&queues).await {
            Ok(depths) => dispatcher.metrics.set_queue_depths(&depths),
            Err(error) => warn!(%error, "cannot read queue depths"),
        }
        match dispatcher.store.count_by_state().await {
            Ok(counts) => dispatcher.metrics.set_runs_by_state(&counts),
            Err(error) => warn!(%error, "cannot count runs by state"),
        }
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
                    if let Err(error) = dispatcher.publish_job(&job).await {
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
