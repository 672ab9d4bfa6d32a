//! Leases, done markers and presence: the broker facts that keep one execution of a run at a
//! time, settle finished jobs, and let workers find the containers of a worker that died.
//!
//! - a **lease** (an exclusive queue per run) is held while a run executes, so a job that the
//!   broker redelivers while its worker still lives (after a consumer-acknowledgement timeout)
//!   waits in the wait queue instead of running twice;
//! - a **done marker** (a durable queue per run, expiring after an hour) is declared after the
//!   final events are confirmed, so a redelivered finished job is acknowledged without running;
//! - a **presence** queue per worker instance lets the other workers find and remove the
//!   containers of a worker that died.
//!
//! `Leases` owns the lease connection (leases, done markers, presence). A lost connection is
//! opened again and the leases of the runs `InFlight` are taken again before the worker consumes:
//! a broker restart drops every lease at once and offers every unacknowledged job again. A run
//! whose lease another worker took, or every run when the broker stays out of reach for
//! `CLAIM_GRACE`, is abandoned: its `Claim`'s `lost` token stops it. `sweep` removes dead
//! workers' containers. Cap slots are taken on this connection too (`acquire_slot`, see
//! `super::gate`).
//!
//! Why on the broker, not in the dispatcher: RabbitMQ 3.10 cannot raise the consumer timeout per
//! queue, so a long run loses its delivery when the broker closes its channel. Exclusive queues
//! give a lock that dies with its holder, and a durable marker queue settles every copy of a
//! finished job, with no extra service.
//!
//! The sweep removes another instance's containers only after its presence queue has been missing
//! for 30 s while this worker's own connection was steady: a broker restart drops every presence
//! at once, and live workers declare theirs again within one 5-second sweep, so a restart never
//! kills a live worker's stages.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use proto::amqp::{self, refusal_code, AmqpError, Topology, DONE_MARKER_TTL_MS};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use uuid::Uuid;

use crate::runtime::ContainerRuntime;

/// A run this worker executes: the token a user's cancel fires, and the one fired when the
/// worker loses its claim on the run (the run stops and publishes nothing more).
#[derive(Debug, Clone)]
pub struct Claim {
    /// Fired by a cancel request.
    pub cancel: CancellationToken,
    /// Fired when the claim is lost; a child of the worker's interrupt.
    pub lost: CancellationToken,
}

/// The runs this worker executes.
#[derive(Debug, Default)]
pub struct InFlight(Mutex<HashMap<Uuid, Claim>>);

impl InFlight {
    /// Claims `run_id` in this process, under the worker's `interrupt`: its tokens, or `None`
    /// when this process runs it already (the lease is exclusive per connection, so it cannot
    /// tell two deliveries to this same worker apart).
    pub async fn claim(&self, run_id: Uuid, interrupt: &CancellationToken) -> Option<Claim> {
        let mut runs = self.0.lock().await;
        match runs.entry(run_id) {
            std::collections::hash_map::Entry::Occupied(_) => None,
            std::collections::hash_map::Entry::Vacant(slot) => {
                let claim = Claim {
                    cancel: CancellationToken::new(),
                    lost: interrupt.child_token(),
                };
                Some(slot.insert(claim).clone())
            }
        }
    }

    /// Forgets a run that ended or was never started.
    pub async fn release(&self, run_id: Uuid) {
        self.0.lock().await.remove(&run_id);
    }

    /// Whether this process runs `run_id`.
    pub async fn contains(&self, run_id: Uuid) -> bool {
        self.0.lock().await.contains_key(&run_id)
    }

    /// Cancels `run_id` if this process runs it; returns whether it did.
    pub async fn cancel(&self, run_id: Uuid) -> bool {
        match self.0.lock().await.get(&run_id) {
            Some(claim) => {
                claim.cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// Gives up `run_id` (another worker holds it now): its containers stop at once and it
    /// publishes nothing more.
    pub async fn abandon(&self, run_id: Uuid) {
        if let Some(claim) = self.0.lock().await.get(&run_id) {
            lose(run_id, claim);
        }
    }

    /// Gives up every run (the broker has been out of reach too long to hold any claim).
    pub async fn abandon_all(&self) {
        for (run_id, claim) in self.0.lock().await.iter() {
            lose(*run_id, claim);
        }
    }

    async fn ids(&self) -> Vec<Uuid> {
        self.0.lock().await.keys().copied().collect()
    }
}

/// Stops a run whose claim is lost; said once, however often the loss is seen again while
/// the run winds down.
fn lose(run_id: Uuid, claim: &Claim) {
    if !claim.lost.is_cancelled() {
        warn!(%run_id, "the claim on the run is lost; stopping it");
        claim.lost.cancel();
    }
}

/// The connection that holds this worker's leases and its presence queue; replaced after a
/// loss, and then the leases of the runs in flight are taken again.
#[derive(Debug)]
pub struct Leases {
    amqp_url: String,
    topology: Topology,
    /// This process's instance id: its presence queue's name.
    instance: String,
    /// The runs whose leases are taken again after a reconnection.
    in_flight: Arc<InFlight>,
    connection: Mutex<Option<Connection>>,
    /// The cap slots held (their queue names), taken again after a reconnection.
    slots: Mutex<std::collections::HashSet<String>>,
    /// Bumped each time the connection is opened (again): the sweep restarts its grace period
    /// after any reconnection, whoever made it.
    generation: AtomicU64,
}

impl Leases {
    /// Leases on the broker at `amqp_url` for the runs `in_flight` of the worker instance
    /// `instance`.
    pub fn new(
        amqp_url: &str,
        topology: Topology,
        instance: &str,
        in_flight: Arc<InFlight>,
    ) -> Leases {
        Leases {
            amqp_url: amqp_url.to_string(),
            topology,
            instance: instance.to_string(),
            in_flight,
            connection: Mutex::new(None),
            slots: Mutex::new(Default::default()),
            generation: AtomicU64::new(0),
        }
    }

    /// How many times the connection was opened.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Makes sure the connection is open, the presence queue declared and the leases of the
    /// runs in flight held (after a broker restart too).
    pub async fn refresh(&self) -> Result<(), AmqpError> {
        self.bounded(async {
            let channel = self.channel().await?;
            let _ = channel.close(200, "presence".into()).await;
            Ok(())
        })
        .await
    }

    /// Whether a queue exists (a passive declare; a missing queue closes only its own channel).
    pub async fn exists(&self, name: &str) -> Result<bool, AmqpError> {
        self.bounded(async { amqp::queue_exists(self.channel().await?, name).await })
            .await
    }

    /// Declares the run's exclusive lease queue; `false` when another live worker holds it.
    pub async fn acquire(&self, run_id: Uuid) -> Result<bool, AmqpError> {
        self.acquire_named(&self.topology.lease(&run_id.to_string()))
            .await
    }

    /// Takes a cap slot (its exclusive queue `name`); `false` when another live worker holds
    /// it. A slot held is taken again after a reconnection.
    ///
    /// An exclusive queue is exclusive per connection, and every run of this worker shares
    /// one: a slot this process holds already is never taken twice.
    pub async fn acquire_slot(&self, name: &str) -> Result<bool, AmqpError> {
        if !self.slots.lock().await.insert(name.to_string()) {
            return Ok(false);
        }
        let taken = self.acquire_named(name).await;
        if !matches!(taken, Ok(true)) {
            self.slots.lock().await.remove(name);
        }
        taken
    }

    /// Gives a cap slot back: its queue is deleted before this process may take it again
    /// (a declare meanwhile would succeed on this same connection, then be deleted).
    pub async fn release_slot(&self, name: &str) {
        self.release_named(name).await;
        self.slots.lock().await.remove(name);
    }

    /// Declares the exclusive queue `name`; `false` when another live connection holds it.
    async fn acquire_named(&self, lease: &str) -> Result<bool, AmqpError> {
        self.bounded(async {
            let channel = self.channel().await?;
            let exclusive = QueueDeclareOptions {
                exclusive: true,
                auto_delete: false,
                ..Default::default()
            };
            match channel
                .queue_declare(lease.into(), exclusive, FieldTable::default())
                .await
            {
                Ok(_) => {
                    let _ = channel.close(200, "leased".into()).await;
                    Ok(true)
                }
                Err(error) if refusal_code(&error) == Some(405) => Ok(false),
                Err(source) => Err(AmqpError::Broker {
                    operation: "lease run",
                    source,
                }),
            }
        })
        .await
    }

    /// Deletes the run's lease queue through a fresh channel (the one that took it may be
    /// gone).
    pub async fn release(&self, run_id: Uuid) {
        self.release_named(&self.topology.lease(&run_id.to_string()))
            .await;
    }

    async fn release_named(&self, lease: &str) {
        let _ = self
            .bounded(async {
                let channel = self.channel().await?;
                let _ = channel
                    .queue_delete(lease.into(), QueueDeleteOptions::default())
                    .await;
                let _ = channel.close(200, "released".into()).await;
                Ok(())
            })
            .await;
    }

    /// Declares the done marker of one execution of a run (`{run_id}` or, for a resumed run,
    /// `{run_id}.{checkpoint}`), so a paused run's marker never settles its resumed job.
    pub async fn mark_done(&self, execution: &str) {
        let mut arguments = FieldTable::default();
        arguments.insert(
            "x-expires".into(),
            AMQPValue::LongLongInt(DONE_MARKER_TTL_MS),
        );
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let declared = self.bounded(async {
            let channel = self.channel().await?;
            channel
                .queue_declare(self.topology.done(execution).into(), durable, arguments)
                .await
                .map_err(|source| AmqpError::Broker {
                    operation: "mark run done",
                    source,
                })?;
            let _ = channel.close(200, "done".into()).await;
            Ok(())
        });
        if let Err(error) = declared.await {
            warn!(%error, "cannot mark the run done");
        }
    }

    /// Closes the connection with a goodbye (the leases and the presence go with it).
    pub async fn close(&self) {
        if let Some(connection) = self.connection.lock().await.take() {
            let _ =
                tokio::time::timeout(Duration::from_secs(5), connection.close(200, "bye".into()))
                    .await;
        }
    }

    /// Runs one operation within [`amqp::SESSION_TIMEOUT`]. A broker that stops answering (a
    /// restart the connection has not noticed yet) costs the connection: the next operation
    /// opens a new one, and takes the leases again.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, AmqpError>>,
    ) -> Result<T, AmqpError> {
        match tokio::time::timeout(amqp::SESSION_TIMEOUT, work).await {
            Ok(outcome) => outcome,
            Err(_) => {
                *self.connection.lock().await = None;
                Err(AmqpError::Pool(format!(
                    "the broker did not answer within {:?}; reconnecting",
                    amqp::SESSION_TIMEOUT
                )))
            }
        }
    }

    /// A fresh channel, reconnecting (announcing presence, and taking the leases of the runs in
    /// flight again) when the connection was lost.
    /// A new channel on the lease connection (connected first if it is not).
    pub(super) async fn channel(&self) -> Result<Channel, AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let mut slot = self.connection.lock().await;
        if !slot.as_ref().is_some_and(|c| c.status().connected()) {
            let (connection, channel) =
                amqp::connect_channel(&self.amqp_url, "forgepool-worker-leases").await?;
            channel
                .queue_declare(
                    self.topology.presence(&self.instance).into(),
                    amqp::exclusive_queue(),
                    FieldTable::default(),
                )
                .await
                .map_err(broker("declare presence"))?;
            self.take_again(&connection).await;
            self.generation.fetch_add(1, Ordering::SeqCst);
            *slot = Some(connection);
        }
        let connection = slot.as_ref().expect("connected above");
        connection
            .create_channel()
            .await
            .map_err(broker("open channel"))
    }

    /// Leases die with their connection: takes them again for the runs in flight, each on a
    /// channel of its own (a lease another worker took closes its channel).
    async fn take_again(&self, connection: &Connection) {
        let held = QueueDeclareOptions {
            exclusive: true,
            ..Default::default()
        };
        // A cap slot another worker took meanwhile stays theirs: the cap is exceeded by one
        // until one of the two stages ends.
        for slot in self.slots.lock().await.iter() {
            if let Ok(channel) = connection.create_channel().await {
                let _ = channel
                    .queue_declare(slot.as_str().into(), held, FieldTable::default())
                    .await;
                let _ = channel.close(200, "slot".into()).await;
            }
        }
        for run_id in self.in_flight.ids().await {
            let lease = self.topology.lease(&run_id.to_string());
            let taken = match connection.create_channel().await {
                Ok(channel) => {
                    let taken = channel
                        .queue_declare(lease.as_str().into(), held, FieldTable::default())
                        .await;
                    let _ = channel.close(200, "leased".into()).await;
                    taken.map(|_| ())
                }
                Err(error) => Err(error),
            };
            match taken {
                Ok(()) => {}
                // Another worker holds the lease now: this execution is superseded.
                Err(error) if refusal_code(&error) == Some(405) => {
                    self.in_flight.abandon(run_id).await;
                }
                Err(error) => {
                    warn!(%run_id, %error, "cannot take the lease of a run in flight again");
                }
            }
        }
    }
}

/// How often the sweep runs, and how long another instance's presence must stay missing
/// before its containers are removed. A broker restart drops every presence queue at once;
/// live workers declare theirs again within one sweep, so only a dead worker stays missing.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
const PRESENCE_GRACE: Duration = Duration::from_secs(30);

/// How long a worker keeps running its runs while it cannot reach the broker to hold their
/// leases. Another worker can take a run only after the broker drops this worker's
/// connection (a missed heartbeat, 60 s by default) plus `REDELIVERY_GRACE` (10 s); a
/// partition is noticed within one sweep and one bounded broker call (about 35 s), so runs
/// stop before anyone else starts them. A broker restart shorter than this costs nothing.
pub const CLAIM_GRACE: Duration = Duration::from_secs(30);

/// Every sweep: keeps this worker's presence declared (after a broker restart too), removes
/// its overdue containers, and removes the containers of instances of the same cluster whose
/// presence has been missing for [`PRESENCE_GRACE`] while this worker's own was steady.
pub async fn sweep<R: ContainerRuntime>(leases: &Leases, runtime: &R, shutdown: CancellationToken) {
    let mut missing_since: HashMap<String, Instant> = HashMap::new();
    let mut steady_since = Instant::now();
    let mut generation = leases.generation();
    let mut held_at = Instant::now();
    loop {
        tokio::select! {
            () = tokio::time::sleep(SWEEP_INTERVAL) => {},
            () = shutdown.cancelled() => return,
        }
        let _ = runtime.remove_orphans().await;
        // Declares our presence again when the lease connection was lost.
        if let Err(error) = leases.refresh().await {
            debug!(%error, "cannot declare presence; no sweep this time");
            missing_since.clear();
            if claim_lost(held_at, Instant::now()) {
                leases.in_flight.abandon_all().await;
            }
            continue;
        }
        held_at = Instant::now();
        if leases.generation() != generation {
            generation = leases.generation();
            // Everyone else may be reconnecting too: start counting again.
            steady_since = Instant::now();
            missing_since.clear();
        }
        let Ok(instances) = runtime.other_instances().await else {
            continue;
        };
        missing_since.retain(|instance, _| instances.contains(instance));
        for instance in instances {
            match leases.exists(&leases.topology.presence(&instance)).await {
                Ok(false) => {
                    let since = *missing_since
                        .entry(instance.clone())
                        .or_insert_with(Instant::now);
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

/// Whether the claims on this worker's runs are lost: the lease connection was last known to
/// hold them at `held_at`, longer than [`CLAIM_GRACE`] before `now`.
pub fn claim_lost(held_at: Instant, now: Instant) -> bool {
    now.saturating_duration_since(held_at) > CLAIM_GRACE
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a worker cut off from the broker that keeps running (and later publishing)
    /// runs another worker may have taken, or one that gives them up at the first hiccup.
    #[test]
    fn claims_are_lost_after_the_grace_and_not_before() {
        let held = Instant::now();
        assert!(!claim_lost(held, held + Duration::from_secs(10)));
        assert!(!claim_lost(held, held + CLAIM_GRACE));
        assert!(claim_lost(
            held,
            held + CLAIM_GRACE + Duration::from_secs(1)
        ));
    }

    /// Catches: a lost claim that does not stop the run, or that stops a run of another
    /// worker process.
    #[tokio::test]
    async fn abandoning_a_run_fires_its_lost_token_only() {
        let in_flight = InFlight::default();
        let interrupt = CancellationToken::new();
        let (one, two) = (Uuid::new_v4(), Uuid::new_v4());
        let first = in_flight.claim(one, &interrupt).await.expect("claimed");
        let second = in_flight.claim(two, &interrupt).await.expect("claimed");
        assert!(
            in_flight.claim(one, &interrupt).await.is_none(),
            "claimed once"
        );
        in_flight.abandon(one).await;
        assert!(first.lost.is_cancelled() && !first.cancel.is_cancelled());
        assert!(!second.lost.is_cancelled());
        in_flight.abandon_all().await;
        assert!(second.lost.is_cancelled());
        // The worker's interrupt (a drain) reaches every claim.
        let third = in_flight.claim(Uuid::new_v4(), &interrupt).await.unwrap();
        interrupt.cancel();
        assert!(third.lost.is_cancelled());
    }
}
