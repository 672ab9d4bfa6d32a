//! `forgepool worker`: takes jobs from RabbitMQ and runs them with the engine.
//!
//! A job is acknowledged only after its final event is confirmed by the broker. Three broker
//! facts make runs safe across crashes and long runs:
//! - a **lease** (an exclusive queue per run) is held while a run executes, so a job that the
//!   broker redelivers while its worker still lives (after a consumer-acknowledgement timeout)
//!   waits in the wait queue instead of running twice;
//! - a **done marker** (a durable queue per run, expiring after an hour) is declared after the
//!   final events are confirmed, so a redelivered finished job is acknowledged without running;
//! - a **presence** queue per worker instance lets the other workers find and remove the
//!   containers of a worker that died.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use proto::amqp::{self, ack, reject, requeue, AmqpError, Publisher, Topology, DONE_MARKER_TTL_MS};
use proto::{Control, Event, EventKind, Job};
use tokio::sync::{Mutex, Semaphore};
use tokio_util::sync::CancellationToken;

use telemetry::Metrics;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, info_span, warn, Instrument};
use uuid::Uuid;

use crate::docker::DockerRuntime;
use crate::engine::Engine;
use crate::ledger::{Entry, LedgerError, Receipt, ReviewLedger};
use crate::sink::{EventSink, PublishEvent};

/// The worker's settings, validated before it starts.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// RabbitMQ URL.
    pub amqp_url: String,
    /// Prefix of queue and exchange names.
    pub prefix: String,
    /// Run slots.
    pub concurrency: usize,
    /// This worker's stable name.
    pub worker_id: String,
    /// How long in-flight runs may finish after SIGTERM before they are handed back.
    pub drain: Duration,
    /// How often a running run reports a heartbeat.
    pub heartbeat: Duration,
    /// How long publishing one event may keep retrying (a broker restart in between).
    pub publish_deadline: Duration,
    /// The key every job must be signed with (`FORGEPOOL_JOB_KEY`).
    pub job_key: proto::JobKey,
    /// The worker's own agent profiles: a job's frozen profiles must be the same.
    pub profiles: std::collections::BTreeMap<String, proto::AgentProfile>,
    /// The repository URL schemes accepted (`FORGEPOOL_ALLOWED_URL_SCHEMES`).
    pub allowed_schemes: Vec<String>,
}

/// A failure that stops the worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The broker could not be set up.
    #[error(transparent)]
    Amqp(#[from] AmqpError),
}

/// Publishes a run's events to the events exchange with confirms, retrying through a broker
/// restart for up to the publish deadline.
#[derive(Debug)]
pub struct AmqpSink {
    publisher: Arc<Publisher>,
    topology: Topology,
    deadline: Duration,
}

impl EventSink for AmqpSink {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        self.send(&event, true).await
    }
}

impl AmqpSink {
    /// Publishes `event` to the events exchange: `reliably` retries through a broker restart
    /// for up to the publish deadline; otherwise there is one attempt (a heartbeat, which the
    /// next one replaces).
    async fn send(&self, event: &Event, reliably: bool) -> Result<(), PublishEvent> {
        let payload = serde_json::to_vec(event).map_err(|e| PublishEvent(e.to_string()))?;
        let (exchange, key) = (self.topology.events(), event.routing_key());
        let sent = if reliably {
            self.publisher
                .publish_reliably(&exchange, &key, &payload, None, self.deadline)
                .await
        } else {
            self.publisher
                .publish(&exchange, &key, &payload, None)
                .await
        };
        sent.map_err(|e| PublishEvent(e.to_string()))
    }
}

/// A run's view of the worker's sink: events are published, then counted in the metrics under
/// the job's (validated) skill and step.
struct ObservedSink<'a> {
    sink: &'a AmqpSink,
    metrics: &'a Metrics,
    job: &'a Job,
    /// Cycle files already counted: a file rewritten in place is one review cycle.
    cycles: std::sync::Mutex<std::collections::HashSet<(String, String)>>,
}

impl EventSink for ObservedSink<'_> {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        // Log lines and heartbeats count for nothing: they are not copied.
        let counted = match &event.kind {
            EventKind::Log { .. } | EventKind::Heartbeat { .. } => None,
            kind => Some(kind.clone()),
        };
        self.sink.publish(event).await?;
        let Some(kind) = counted else {
            return Ok(());
        };
        let repeat = match &kind {
            EventKind::Cycle { cycle } => self
                .cycles
                .lock()
                .is_ok_and(|mut seen| !seen.insert((cycle.step.clone(), cycle.file.clone()))),
            _ => false,
        };
        if !repeat {
            self.metrics.observe(self.job, &kind);
        }
        Ok(())
    }
}

/// How long the final review's intent and receipt are kept: long after any redelivery.
const LEDGER_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// The final review ledger on the broker, shared by every worker of the cluster: the intent
/// and the receipt of a run are each one persistent message in a durable queue of their own
/// (`{prefix}.review.intent.{run_id}`, `{prefix}.review.receipt.{run_id}`), kept seven days.
#[derive(Debug, Clone)]
pub struct AmqpLedger {
    amqp_url: String,
    topology: Topology,
    publisher: Arc<Publisher>,
}

impl AmqpLedger {
    /// A ledger on the broker at `amqp_url`, publishing through `publisher`.
    pub fn new(amqp_url: &str, topology: Topology, publisher: Arc<Publisher>) -> AmqpLedger {
        AmqpLedger {
            amqp_url: amqp_url.to_string(),
            topology,
            publisher,
        }
    }

    async fn session<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        tokio::time::timeout(amqp::SESSION_TIMEOUT, work)
            .await
            .unwrap_or_else(|_| Err(LedgerError("the broker did not answer in time".into())))
    }

    async fn channel(&self, connection: &Connection) -> Result<Channel, LedgerError> {
        connection
            .create_channel()
            .await
            .map_err(|e| LedgerError(e.to_string()))
    }

    /// The one message kept in `queue`, left in place; `None` when the queue does not exist.
    async fn peek(
        &self,
        connection: &Connection,
        queue: &str,
    ) -> Result<Option<Vec<u8>>, LedgerError> {
        let channel = self.channel(connection).await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match channel
            .queue_declare(queue, passive, FieldTable::default())
            .await
        {
            Ok(_) => {}
            Err(lapin::Error::ProtocolError(error)) if error.get_id() == 404 => return Ok(None),
            Err(error) => return Err(LedgerError(error.to_string())),
        }
        let message = channel
            .basic_get(queue, lapin::options::BasicGetOptions { no_ack: false })
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        let body = match message {
            Some(message) => {
                let body = message.delivery.data.clone();
                message
                    .delivery
                    .nack(lapin::options::BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await
                    .map_err(|e| LedgerError(e.to_string()))?;
                Some(body)
            }
            None => None,
        };
        let _ = channel.close(200, "read").await;
        Ok(body)
    }

    /// Replaces what `queue` holds with `body`, confirmed by the broker.
    async fn keep(
        &self,
        connection: &Connection,
        queue: &str,
        body: &[u8],
    ) -> Result<(), LedgerError> {
        let channel = self.channel(connection).await?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongLongInt(LEDGER_TTL_MS));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue, durable, arguments)
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        channel
            .queue_purge(queue, Default::default())
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        let _ = channel.close(200, "declared").await;
        self.publisher
            .publish("", queue, body, None)
            .await
            .map_err(|e| LedgerError(e.to_string()))
    }

    async fn delete(&self, connection: &Connection, queue: &str) -> Result<(), LedgerError> {
        let channel = self.channel(connection).await?;
        match channel
            .queue_delete(queue, QueueDeleteOptions::default())
            .await
        {
            Ok(_) => {
                let _ = channel.close(200, "deleted").await;
                Ok(())
            }
            Err(lapin::Error::ProtocolError(error)) if error.get_id() == 404 => Ok(()),
            Err(error) => Err(LedgerError(error.to_string())),
        }
    }

    async fn connect(&self) -> Result<Connection, LedgerError> {
        amqp::connect(&self.amqp_url, "forgepool-worker-ledger")
            .await
            .map_err(|e| LedgerError(e.to_string()))
    }
}

impl ReviewLedger for AmqpLedger {
    async fn lookup(&self, run_id: &str) -> Result<Entry, LedgerError> {
        self.session(async {
            let connection = self.connect().await?;
            let intent = self
                .peek(&connection, &self.topology.review_intent(run_id))
                .await?;
            let receipt = self
                .peek(&connection, &self.topology.review_receipt(run_id))
                .await?;
            let _ = connection.close(200, "bye").await;
            Ok(Entry {
                intent: intent.map(|tree| String::from_utf8_lossy(&tree).to_string()),
                receipt: receipt.and_then(|body| serde_json::from_slice(&body).ok()),
            })
        })
        .await
    }

    async fn intent(&self, run_id: &str, tree: &str) -> Result<(), LedgerError> {
        self.session(async {
            let connection = self.connect().await?;
            let kept = self
                .keep(
                    &connection,
                    &self.topology.review_intent(run_id),
                    tree.as_bytes(),
                )
                .await;
            let _ = connection.close(200, "bye").await;
            kept
        })
        .await
    }

    async fn receipt(&self, run_id: &str, receipt: &Receipt) -> Result<(), LedgerError> {
        let body = serde_json::to_vec(receipt).map_err(|e| LedgerError(e.to_string()))?;
        self.session(async {
            let connection = self.connect().await?;
            let kept = async {
                self.keep(&connection, &self.topology.review_receipt(run_id), &body)
                    .await?;
                self.delete(&connection, &self.topology.review_intent(run_id))
                    .await
            }
            .await;
            let _ = connection.close(200, "bye").await;
            kept
        })
        .await
    }

    async fn clear(&self, run_id: &str) -> Result<(), LedgerError> {
        self.session(async {
            let connection = self.connect().await?;
            let deleted = self
                .delete(&connection, &self.topology.review_intent(run_id))
                .await;
            let _ = connection.close(200, "bye").await;
            deleted
        })
        .await
    }
}

struct Shared {
    config: WorkerConfig,
    ledger: AmqpLedger,
    metrics: Arc<Metrics>,
    topology: Topology,
    engine: Engine<DockerRuntime>,
    sink: AmqpSink,
    publisher: Arc<Publisher>,
    /// The connection that holds leases and the presence queue; replaced after a loss.
    leases: Mutex<Option<Connection>>,
    /// Bumped each time the lease connection is opened (again): the sweep restarts its
    /// grace period after any reconnection, whoever made it.
    lease_generation: std::sync::atomic::AtomicU64,
    /// Cancel tokens of the runs in flight, for cancel requests.
    running: Mutex<HashMap<Uuid, CancellationToken>>,
    slots: Arc<Semaphore>,
    /// Fired when in-flight runs must stop and be handed back.
    interrupt: CancellationToken,
    /// Fired when the worker stops taking work (SIGTERM): jobs not started yet go back.
    draining: CancellationToken,
}

/// Runs the worker until `shutdown` is cancelled, then drains: no new jobs, in-flight runs get
/// `drain` to finish, then they are interrupted and handed back to the queue.
pub async fn run(
    config: WorkerConfig,
    engine: Engine<DockerRuntime>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let topology = Topology::new(&config.prefix);
    let publisher = Arc::new(Publisher::new(
        &config.amqp_url,
        "forgepool-worker-publish",
    )?);
    declare(&publisher, &topology).await?;
    let shared = Arc::new(Shared {
        sink: AmqpSink {
            publisher: Arc::clone(&publisher),
            topology: topology.clone(),
            deadline: config.publish_deadline,
        },
        slots: Arc::new(Semaphore::new(config.concurrency)),
        ledger: AmqpLedger::new(&config.amqp_url, topology.clone(), Arc::clone(&publisher)),
        metrics,
        config,
        topology,
        engine,
        publisher,
        leases: Mutex::new(None),
        lease_generation: std::sync::atomic::AtomicU64::new(0),
        running: Mutex::new(HashMap::new()),
        interrupt: CancellationToken::new(),
        draining: CancellationToken::new(),
    });
    if let Err(error) = shared.engine.runtime().remove_orphans_now().await {
        warn!(%error, "orphan cleanup failed");
    }
    let runs = TaskTracker::new();
    let background = TaskTracker::new();
    background.spawn(control_loop(Arc::clone(&shared), shutdown.clone()));
    background.spawn(sweep_loop(Arc::clone(&shared), shutdown.clone()));
    background.spawn(watch_queues(Arc::clone(&shared), shutdown.clone()));
    shared.metrics.set_run_slots(shared.config.concurrency);
    info!(worker = %shared.config.worker_id, slots = shared.config.concurrency, "worker started");
    let consuming = consume_jobs(Arc::clone(&shared), &runs, shutdown.clone()).await;
    shared.draining.cancel();

    info!(in_flight = runs.len(), "draining");
    runs.close();
    if tokio::time::timeout(shared.config.drain, runs.wait())
        .await
        .is_err()
    {
        warn!("drain time is over; handing in-flight runs back");
        shared.interrupt.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(60), runs.wait()).await;
    }
    if let Some((connection, channel)) = consuming {
        let _ = tokio::time::timeout(Duration::from_secs(5), channel.close(200, "bye")).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye")).await;
    }
    background.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), background.wait()).await;
    // Goodbyes to the broker, rather than sockets dropped with the runtime.
    if let Some(connection) = shared.leases.lock().await.take() {
        let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye")).await;
    }
    shared.publisher.close().await;
    info!("worker stopped");
    Ok(())
}

async fn declare(publisher: &Publisher, topology: &Topology) -> Result<(), AmqpError> {
    let mut attempts = 0;
    loop {
        let declared = async { topology.declare(&publisher.channel().await?).await };
        let declared = tokio::time::timeout(amqp::SESSION_TIMEOUT, declared)
            .await
            .unwrap_or_else(|_| Err(AmqpError::Pool("the broker did not answer in time".into())));
        match declared {
            Ok(()) => return Ok(()),
            Err(error) if attempts < 30 => {
                attempts += 1;
                warn!(%error, "cannot set up RabbitMQ yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

impl Shared {
    /// A fresh channel on the lease connection, reconnecting (and re-announcing presence) when
    /// the connection was lost.
    async fn lease_channel(&self) -> Result<Channel, AmqpError> {
        let mut slot = self.leases.lock().await;
        let healthy = slot.as_ref().is_some_and(|c| c.status().connected());
        if !healthy {
            let connection =
                amqp::connect(&self.config.amqp_url, "forgepool-worker-leases").await?;
            let channel =
                connection
                    .create_channel()
                    .await
                    .map_err(|source| AmqpError::Broker {
                        operation: "open channel",
                        source,
                    })?;
            let exclusive = QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            };
            let presence = self.topology.presence(self.engine.runtime().instance());
            channel
                .queue_declare(&presence, exclusive, FieldTable::default())
                .await
                .map_err(|source| AmqpError::Broker {
                    operation: "declare presence",
                    source,
                })?;
            // Leases die with their connection: take them again for the runs still in flight,
            // each on a channel of its own (a lease another worker took closes its channel).
            let held = QueueDeclareOptions {
                exclusive: true,
                ..Default::default()
            };
            for run_id in self.running.lock().await.keys() {
                let lease = self.topology.lease(&run_id.to_string());
                let taken = match connection.create_channel().await {
                    Ok(lease_channel) => {
                        let taken = lease_channel
                            .queue_declare(&lease, held, FieldTable::default())
                            .await;
                        let _ = lease_channel.close(200, "leased").await;
                        taken.map(|_| ())
                    }
                    Err(error) => Err(error),
                };
                if let Err(error) = taken {
                    warn!(%run_id, %error, "cannot take the lease of a run in flight again");
                }
            }
            self.lease_generation
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            *slot = Some(connection);
        }
        let connection = slot.as_ref().expect("connected above");
        connection
            .create_channel()
            .await
            .map_err(|source| AmqpError::Broker {
                operation: "open channel",
                source,
            })
    }

    /// Whether a queue exists (a passive declare; a missing queue closes only its own channel).
    /// Runs one operation on the lease connection within [`amqp::SESSION_TIMEOUT`]. A broker
    /// that stops answering (a restart the connection has not noticed yet) costs the
    /// connection: the next operation opens a new one, and takes the leases again.
    async fn on_leases<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, AmqpError>>,
    ) -> Result<T, AmqpError> {
        match tokio::time::timeout(amqp::SESSION_TIMEOUT, work).await {
            Ok(outcome) => outcome,
            Err(_) => {
                *self.leases.lock().await = None;
                Err(AmqpError::Pool(format!(
                    "the broker did not answer within {:?}; reconnecting",
                    amqp::SESSION_TIMEOUT
                )))
            }
        }
    }

    async fn queue_exists(&self, name: &str) -> Result<bool, AmqpError> {
        self.on_leases(self.queue_exists_now(name)).await
    }

    async fn queue_exists_now(&self, name: &str) -> Result<bool, AmqpError> {
        let channel = self.lease_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        match channel
            .queue_declare(name, passive, FieldTable::default())
            .await
        {
            Ok(_) => {
                let _ = channel.close(200, "checked").await;
                Ok(true)
            }
            Err(lapin::Error::ProtocolError(error)) if error.get_id() == 404 => Ok(false),
            // An exclusive queue of another connection exists, and is locked to us.
            Err(lapin::Error::ProtocolError(error)) if error.get_id() == 405 => Ok(true),
            Err(source) => Err(AmqpError::Broker {
                operation: "check queue",
                source,
            }),
        }
    }
}

/// Consumes jobs until shutdown; returns the consuming connection so that the runs in flight
/// can still settle their deliveries on it.
async fn consume_jobs(
    shared: Arc<Shared>,
    runs: &TaskTracker,
    shutdown: CancellationToken,
) -> Option<(Connection, Channel)> {
    let mut backoff = Duration::from_millis(200);
    let mut connected_before = false;
    while !shutdown.is_cancelled() {
        let prefetch = u16::try_from(shared.config.concurrency).unwrap_or(u16::MAX);
        let tag = format!("worker-{}", shared.config.worker_id);
        let jobs = shared.topology.jobs();
        let session = amqp::open_consumer(
            &shared.config.amqp_url,
            &tag,
            &shared.topology,
            &jobs,
            prefetch,
        );
        // After a lost connection, take the leases of the runs still in flight again before
        // any job arrives: the broker has just offered those jobs to every worker.
        if connected_before {
            if let Ok(channel) = shared.on_leases(shared.lease_channel()).await {
                let _ = channel.close(200, "leases").await;
            }
        }
        let (connection, channel, mut consumer) = match session.await {
            Ok(session) => session,
            Err(error) => {
                warn!(%error, "cannot consume jobs; retrying");
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
            shared.metrics.broker_reconnected("worker-jobs");
        }
        connected_before = true;
        info!("consuming jobs");
        loop {
            tokio::select! {
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => take_delivery(&shared, runs, delivery).await,
                    Some(Err(error)) => { warn!(%error, "job consumer failed; reconnecting"); break; }
                    None => { warn!("job consumer closed; reconnecting"); break; }
                },
                () = shutdown.cancelled() => break,
            }
        }
        // Stop taking work first; deliveries in flight keep their channel until they settle.
        let _ = channel.basic_cancel(&tag, Default::default()).await;
        if shutdown.is_cancelled() {
            // Deliveries in flight are settled on this channel: keep it until they are.
            return Some((connection, channel));
        }
    }
    None
}

async fn take_delivery(
    shared: &Arc<Shared>,
    runs: &TaskTracker,
    delivery: lapin::message::Delivery,
) {
    let job = match trusted_job(&shared.config, &delivery) {
        Ok(job) => job,
        Err(reason) => {
            warn!(%reason, "dead-lettering a job message");
            shared.metrics.dead_lettered(&shared.topology.jobs());
            match shared
                .publisher
                .dead_letter(
                    &shared.topology,
                    &shared.topology.jobs(),
                    &delivery.data,
                    &reason,
                    Some(&delivery.properties),
                )
                .await
            {
                Ok(()) => {
                    let _ = ack(&delivery).await;
                }
                Err(_) => {
                    let _ = reject(&delivery).await;
                }
            }
            return;
        }
    };
    // The prefetch keeps deliveries within our slots, but the next delivery can arrive just
    // before the slot of the run that was acknowledged is released: it waits for that slot
    // instead of bouncing back to the queue (which would count against the delivery limit).
    let shared = Arc::clone(shared);
    let span = info_span!("job", run_id = %job.run_id, ticket = %job.ticket);
    runs.spawn(
        async move {
            // A job offered again may still run on a worker that lost its broker connection
            // (a broker restart drops every lease at once): give that worker time to take its
            // lease again before this one tries.
            if delivery.redelivered && !shared.running.lock().await.contains_key(&job.run_id) {
                tokio::select! {
                    () = tokio::time::sleep(REDELIVERY_GRACE) => {}
                    () = shared.draining.cancelled() => {
                        let _ = requeue(&delivery).await;
                        return;
                    }
                }
            }
            let Ok(permit) = Arc::clone(&shared.slots).acquire_owned().await else {
                let _ = requeue(&delivery).await;
                return;
            };
            run_job(&shared, job, delivery).await;
            drop(permit);
        }
        .instrument(span),
    );
}

/// How long a redelivered job waits before its lease is tried: two sweeps, in which a live
/// worker that still runs it declares its lease again.
const REDELIVERY_GRACE: Duration = Duration::from_secs(2 * SWEEP_INTERVAL.as_secs());

/// The largest job message a worker reads (the wire's limit).
pub use proto::MAX_JOB_BYTES;

/// A job message checked as untrusted input: its signature first (nothing of an unsigned
/// message is parsed beyond that), then its schema, its fields, its repository URL, and each of
/// its profiles against the worker's own agents file. The error is the dead letter's reason.
pub fn trusted_job(
    config: &WorkerConfig,
    delivery: &lapin::message::Delivery,
) -> Result<Job, String> {
    if delivery.data.len() > MAX_JOB_BYTES {
        return Err(format!(
            "oversized message: {} bytes, over the limit of {MAX_JOB_BYTES}",
            delivery.data.len()
        ));
    }
    let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
    config
        .job_key
        .verify(&delivery.data, signature.as_deref())?;
    let job = decode_job(&delivery.data)?;
    check_job(&job, &config.profiles, &config.allowed_schemes)?;
    Ok(job)
}

/// Checks a decoded job's fields, its repository URL, and each profile against the worker's
/// own profiles (image, command, env names, network, user and limits must be the same).
pub fn check_job(
    job: &Job,
    profiles: &std::collections::BTreeMap<String, proto::AgentProfile>,
    allowed_schemes: &[String],
) -> Result<(), String> {
    job.check()
        .map_err(|e| format!("the job is invalid: {e}"))?;
    proto::names::check_url(&job.repository.url, allowed_schemes)
        .map_err(|e| format!("the job's repository.url {e}"))?;
    for profile in [
        Some(&job.implementer),
        job.reviewer.as_ref(),
        job.final_reviewer.as_ref(),
    ]
    .into_iter()
    .flatten()
    {
        let Some(own) = profiles.get(&profile.name) else {
            return Err(format!(
                "the job names the agent profile `{}`, which this worker's agents file does not have",
                profile.name
            ));
        };
        let differences = profile.differences(own);
        if !differences.is_empty() {
            return Err(format!(
                "the job's profile `{}` differs from this worker's agents file in: {}; give dispatcher and workers the same agents file",
                profile.name,
                differences.join(", ")
            ));
        }
    }
    Ok(())
}

/// Decodes a job, refusing oversized messages and a missing or unknown `schema_version` first.
pub fn decode_job(data: &[u8]) -> Result<Job, String> {
    proto::decode_message(data, MAX_JOB_BYTES)
}

async fn run_job(shared: &Shared, job: Job, delivery: lapin::message::Delivery) {
    let run_id = job.run_id;
    // A finished run that is delivered again is acknowledged without running.
    match shared
        .queue_exists(&shared.topology.done(&job.execution_key()))
        .await
    {
        Ok(true) => {
            info!("run already finished; acknowledging the redelivered job");
            let _ = ack(&delivery).await;
            return;
        }
        Ok(false) => {}
        Err(error) => {
            warn!(%error, "cannot check the done marker; handing the job back");
            let _ = requeue(&delivery).await;
            return;
        }
    }
    // Claim the run in this process first: the lease is exclusive per connection, so it cannot
    // tell two deliveries to this same worker apart.
    let cancel = CancellationToken::new();
    let claimed = {
        let mut running = shared.running.lock().await;
        match running.entry(run_id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(cancel.clone());
                true
            }
        }
    };
    let leased = if claimed {
        let leased = acquire_lease(shared, run_id).await;
        if !matches!(leased, Ok(true)) {
            shared.running.lock().await.remove(&run_id);
        }
        leased
    } else {
        // This worker runs it already (the broker redelivered it after a lost connection).
        Ok(false)
    };
    match leased {
        Ok(true) => {}
        Ok(false) => {
            // Another live worker holds the run (the broker redelivered it after a consumer
            // timeout): park it in the wait queue; it comes back until that worker is done.
            let parked = shared
                .publisher
                .publish(
                    "",
                    &shared.topology.jobs_wait(),
                    &delivery.data,
                    amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER)
                        .map(amqp::signature_headers),
                )
                .await;
            let _ = match parked {
                Ok(()) => ack(&delivery).await,
                Err(_) => requeue(&delivery).await,
            };
            return;
        }
        Err(error) => {
            warn!(%error, "cannot lease the run; handing the job back");
            let _ = requeue(&delivery).await;
            return;
        }
    }
    let sink = ObservedSink {
        sink: &shared.sink,
        metrics: &shared.metrics,
        job: &job,
        cycles: Default::default(),
    };
    shared.metrics.runs_in_progress().inc();
    let execution = shared.engine.execute(
        &job,
        &sink,
        &shared.ledger,
        cancel,
        shared.interrupt.clone(),
    );
    // Heartbeats go out beside the run, never in its way: one attempt each (a later one
    // replaces a lost one), so a broker outage never holds the run up.
    let heartbeats = async {
        let mut heartbeat = tokio::time::interval(shared.config.heartbeat);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        loop {
            heartbeat.tick().await;
            let beat = Event::new(
                run_id,
                EventKind::Heartbeat {
                    worker: shared.config.worker_id.clone(),
                },
            );
            if let Err(error) = shared.sink.send(&beat, false).await {
                warn!(%error, "heartbeat not published");
            }
        }
    };
    let outcome = tokio::select! {
        outcome = execution => outcome,
        () = heartbeats => unreachable!("heartbeats go on until the run ends"),
    };
    shared.metrics.runs_in_progress().dec();
    shared.running.lock().await.remove(&run_id);
    match outcome {
        Ok(Some(result)) => {
            mark_done(shared, &job.execution_key()).await;
            if let Err(error) = ack(&delivery).await {
                // The channel was closed under us (a consumer timeout or a lost connection): the
                // broker offers the job again, and the done marker settles it then.
                warn!(%error, "cannot acknowledge the job; the done marker will settle it");
            }
            info!(state = %result.state, "job done");
        }
        Ok(None) => {
            let _ = requeue(&delivery).await;
        }
        Err(error) => {
            warn!(%error, "final events not confirmed; handing the job back");
            let _ = requeue(&delivery).await;
        }
    }
    release_lease(shared, run_id).await;
}

/// Deletes the run's lease queue through a fresh channel (the one that took it may be gone).
async fn release_lease(shared: &Shared, run_id: Uuid) {
    let _ = shared
        .on_leases(async {
            release_lease_now(shared, run_id).await;
            Ok(())
        })
        .await;
}

async fn release_lease_now(shared: &Shared, run_id: Uuid) {
    if let Ok(channel) = shared.lease_channel().await {
        let lease = shared.topology.lease(&run_id.to_string());
        let _ = channel
            .queue_delete(&lease, QueueDeleteOptions::default())
            .await;
        let _ = channel.close(200, "released").await;
    }
}

/// Declares the run's exclusive lease queue; `false` when another live worker holds it.
async fn acquire_lease(shared: &Shared, run_id: Uuid) -> Result<bool, AmqpError> {
    shared.on_leases(acquire_lease_now(shared, run_id)).await
}

async fn acquire_lease_now(shared: &Shared, run_id: Uuid) -> Result<bool, AmqpError> {
    let channel = shared.lease_channel().await?;
    let exclusive = QueueDeclareOptions {
        exclusive: true,
        auto_delete: false,
        ..Default::default()
    };
    match channel
        .queue_declare(
            &shared.topology.lease(&run_id.to_string()),
            exclusive,
            FieldTable::default(),
        )
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "leased").await;
            Ok(true)
        }
        Err(lapin::Error::ProtocolError(error)) if error.get_id() == 405 => Ok(false),
        Err(source) => Err(AmqpError::Broker {
            operation: "lease run",
            source,
        }),
    }
}

/// Declares the done marker of one execution of a run (`{run_id}` or, for a resumed run,
/// `{run_id}.{checkpoint}`), so a paused run's marker never settles its resumed job.
async fn mark_done(shared: &Shared, execution: &str) {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-expires".into(),
        AMQPValue::LongLongInt(DONE_MARKER_TTL_MS),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let declared = async {
        let channel = shared.lease_channel().await?;
        channel
            .queue_declare(&shared.topology.done(execution), durable, arguments)
            .await
            .map_err(|source| AmqpError::Broker {
                operation: "mark run done",
                source,
            })?;
        let _ = channel.close(200, "done").await;
        Ok::<(), AmqpError>(())
    };
    if let Err(error) = shared.on_leases(declared).await {
        warn!(%error, "cannot mark the run done");
    }
}

/// Receives cancel requests for the runs this worker holds.
async fn control_loop(shared: Arc<Shared>, shutdown: CancellationToken) {
    while !shutdown.is_cancelled() {
        let session = async {
            let connection =
                amqp::connect(&shared.config.amqp_url, "forgepool-worker-control").await?;
            let channel =
                connection
                    .create_channel()
                    .await
                    .map_err(|source| AmqpError::Broker {
                        operation: "open channel",
                        source,
                    })?;
            let exclusive = QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            };
            let queue = channel
                .queue_declare("", exclusive, FieldTable::default())
                .await
                .map_err(|source| AmqpError::Broker {
                    operation: "declare control queue",
                    source,
                })?;
            channel
                .queue_bind(
                    queue.name().as_str(),
                    &shared.topology.control(),
                    "cancel.*",
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|source| AmqpError::Broker {
                    operation: "bind control queue",
                    source,
                })?;
            let consumer = channel
                .basic_consume(
                    queue.name().as_str(),
                    "control",
                    BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|source| AmqpError::Broker {
                    operation: "consume control",
                    source,
                })?;
            Ok::<_, AmqpError>((connection, consumer))
        };
        let (connection, mut consumer) = match session.await {
            Ok(session) => session,
            Err(error) => {
                warn!(%error, "cannot receive cancel requests; retrying");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    () = shutdown.cancelled() => return,
                }
            }
        };
        loop {
            tokio::select! {
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        if let Ok(control) = serde_json::from_slice::<Control>(&delivery.data) {
                            if control.action == proto::ControlAction::Cancel {
                                if let Some(token) = shared.running.lock().await.get(&control.run_id) {
                                    info!(run_id = %control.run_id, "cancel requested");
                                    token.cancel();
                                }
                            }
                        }
                    }
                    _ => break,
                },
                () = shutdown.cancelled() => {
                    let _ = tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye")).await;
                    return;
                }
            }
        }
    }
}

/// Every 10 s: removes the containers of worker instances whose presence queue is gone.
/// Keeps `forge_queue_depth` fresh, as this worker's broker connection sees it.
async fn watch_queues(shared: Arc<Shared>, shutdown: CancellationToken) {
    let queues = shared.topology.watched_queues();
    loop {
        match shared.publisher.queue_depths(&queues).await {
            Ok(depths) => shared.metrics.set_queue_depths(&depths),
            Err(error) => debug!(%error, "cannot read queue depths"),
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(5)) => {},
            () = shutdown.cancelled() => return,
        }
    }
}

/// How often the sweep runs, and how long another instance's presence must stay missing
/// before its containers are removed. A broker restart drops every presence queue at once;
/// live workers declare theirs again within one sweep, so only a dead worker stays missing.
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
const PRESENCE_GRACE: Duration = Duration::from_secs(30);

/// Every sweep: keeps this worker's presence declared (after a broker restart too), removes
/// its overdue containers, and removes the containers of instances of the same cluster whose
/// presence has been missing for [`PRESENCE_GRACE`] while this worker's own was steady.
async fn sweep_loop(shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut missing_since: HashMap<String, std::time::Instant> = HashMap::new();
    let mut steady_since = std::time::Instant::now();
    let mut generation = shared
        .lease_generation
        .load(std::sync::atomic::Ordering::SeqCst);
    loop {
        tokio::select! {
            () = tokio::time::sleep(SWEEP_INTERVAL) => {},
            () = shutdown.cancelled() => return,
        }
        let runtime = shared.engine.runtime();
        let _ = runtime.remove_orphans_now().await;
        // Declares our presence again when the lease connection was lost.
        match shared.on_leases(shared.lease_channel()).await {
            Ok(channel) => {
                let _ = channel.close(200, "presence").await;
            }
            Err(error) => {
                debug!(%error, "cannot declare presence; no sweep this time");
                missing_since.clear();
                continue;
            }
        }
        let now = shared
            .lease_generation
            .load(std::sync::atomic::Ordering::SeqCst);
        if now != generation {
            generation = now;
            // Everyone else may be reconnecting too: start counting again.
            steady_since = std::time::Instant::now();
            missing_since.clear();
        }
        let Ok(instances) = runtime.other_instances().await else {
            continue;
        };
        missing_since.retain(|instance, _| instances.contains(instance));
        for instance in instances {
            match shared
                .queue_exists(&shared.topology.presence(&instance))
                .await
            {
                Ok(false) => {
                    let since = *missing_since
                        .entry(instance.clone())
                        .or_insert_with(std::time::Instant::now);
                    let overdue = since.elapsed() >= PRESENCE_GRACE
                        && steady_since.elapsed() >= PRESENCE_GRACE;
                    if overdue {
                        info!(%instance, "removing the containers of a dead worker");
                        let _ = runtime.remove_instance(&instance).await;
                        missing_since.remove(&instance);
                    }
                }
                Ok(true) => {
                    missing_since.remove(&instance);
                }
                Err(_) => {}
            }
        }
    }
}
