//! The pool's profile gate on the broker: cap slots and profile pauses shared by every
//! worker.
//!
//! - a **cap slot** of a profile with `max_concurrent = N` is one of the exclusive queues
//!   `{prefix}.cap.{profile}.{0..N}`: a worker declares one to start a stage and deletes it
//!   when the stage ends; one held by a worker that dies goes with its connection;
//! - a **pause** is published, signed, to the control exchange as `pause.{profile}`, which
//!   reaches every worker's control queue and the stream `{prefix}.pauses`; a worker reads the
//!   stream from the start of its retention (two days; a pause lasts at most one) only to catch
//!   up each time its control consumer connects, so a worker that starts later knows the
//!   pauses in force too.
//!
//! A cap slot is taken on the lease connection (`Leases::acquire_slot`, which also refuses a
//! slot this process holds, since exclusivity is per connection; slots are declared again after
//! a reconnection) and deleted when its `Ticket` is released, awaited before the run's next
//! stage asks. `PauseBook` takes pauses into `Pauses` from the control consumer
//! (`super::control`) and keeps `forgepool_profile_paused` true. A job that waits for a cap is
//! parked with `x-forgepool-waits-for`; its next delivery takes a slot (`AmqpGate::reserve`)
//! before the run starts, and goes back silently while none is free.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use proto::amqp::{self, AmqpError, Delivery, Publisher, Topology};
use proto::{AgentProfile, JobKey, PauseRequest, ProfilePause, SCHEMA_VERSION};
use telemetry::Metrics;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use super::lease::Leases;
use super::ledger::bound;
use crate::ports::gate::{Admission, GateFuture, Pauses, ProfileGate, Role, Slot, Ticket};

/// The largest pause message read from the stream.
const MAX_PAUSE_BYTES: usize = 4096;

/// The worker's gate: cap slots and pauses on the broker.
#[derive(Debug)]
pub struct AmqpGate {
    leases: Arc<Leases>,
    publisher: Arc<Publisher>,
    topology: Topology,
    pauses: Arc<Pauses>,
    /// Signs pauses (over the stream's name and the body), as workers sign what they keep
    /// on the broker for each other.
    key: JobKey,
    /// Slots taken for a run before its execution started (its job waited for them).
    reserved: Mutex<HashMap<Uuid, (String, Ticket)>>,
}

/// A cap slot on the broker; dropping it deletes its queue.
struct BrokerSlot {
    leases: Arc<Leases>,
    name: String,
}

impl Slot for BrokerSlot {
    fn release(mut self: Box<Self>) -> GateFuture<'static, ()> {
        let (leases, name) = (Arc::clone(&self.leases), std::mem::take(&mut self.name));
        Box::pin(async move { leases.release_slot(&name).await })
    }
}

/// A slot dropped without [`Ticket::release`] (a run that ended by an error) is given back
/// by a task.
impl Drop for BrokerSlot {
    fn drop(&mut self) {
        if self.name.is_empty() {
            return;
        }
        let (leases, name) = (Arc::clone(&self.leases), std::mem::take(&mut self.name));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { leases.release_slot(&name).await });
        }
    }
}

impl AmqpGate {
    /// A gate over the worker's leases connection and publisher; `pauses` is what
    /// [`PauseBook`] keeps.
    pub fn new(
        leases: Arc<Leases>,
        publisher: Arc<Publisher>,
        topology: Topology,
        pauses: Arc<Pauses>,
        key: JobKey,
    ) -> AmqpGate {
        AmqpGate {
            leases,
            publisher,
            topology,
            pauses,
            key,
            reserved: Mutex::new(HashMap::new()),
        }
    }

    /// Takes a free cap slot of `profile`: `Ok(None)` when every slot is taken.
    async fn take_slot(
        &self,
        profile: &AgentProfile,
        max: u32,
    ) -> Result<Option<Ticket>, AmqpError> {
        for slot in 0..max {
            let name = self.topology.cap(&profile.name, slot);
            if self.leases.acquire_slot(&name).await? {
                let leases = Arc::clone(&self.leases);
                return Ok(Some(Ticket::holding(BrokerSlot { leases, name })));
            }
        }
        Ok(None)
    }

    /// For a job that waits for the cap of the profile in `role`: takes a slot for the run
    /// before it starts (its first stage of that profile uses it). `false` while every slot is
    /// taken, or the broker cannot say.
    pub async fn reserve(&self, run_id: Uuid, role: Role, job: &proto::Job) -> bool {
        let Some(profile) = role.profile(job) else {
            return true;
        };
        let Some(max) = profile.max_concurrent else {
            return true;
        };
        match self.take_slot(profile, max).await {
            Ok(Some(ticket)) => {
                let reserved = (profile.name.clone(), ticket);
                self.reserved.lock().await.insert(run_id, reserved);
                true
            }
            Ok(None) => false,
            Err(error) => {
                warn!(%error, "cannot take a cap slot; the job waits again");
                false
            }
        }
    }

    /// Gives back a slot reserved for a run that did not use it.
    pub async fn forget(&self, run_id: Uuid) {
        let reserved = self.reserved.lock().await.remove(&run_id);
        if let Some((_, ticket)) = reserved {
            ticket.release().await;
        }
    }
}

impl ProfileGate for AmqpGate {
    fn admit<'a>(&'a self, run_id: Uuid, profile: &'a AgentProfile) -> GateFuture<'a, Admission> {
        Box::pin(async move {
            // A slot reserved for the run serves its first gated stage, if that stage is of
            // the reserved profile; otherwise it goes back at once.
            let reserved = self.reserved.lock().await.remove(&run_id);
            let (reserved, other) = match reserved {
                Some((name, ticket)) if name == profile.name => (Some(ticket), None),
                Some((_, ticket)) => (None, Some(ticket)),
                None => (None, None),
            };
            if let Some(ticket) = other {
                ticket.release().await;
            }
            if let Some(pause) = self.pauses.current(&profile.name, SystemTime::now()) {
                if let Some(ticket) = reserved {
                    ticket.release().await;
                }
                return Admission::Paused(pause);
            }
            let Some(max) = profile.max_concurrent else {
                return Admission::Go(Ticket::free());
            };
            if let Some(ticket) = reserved {
                return Admission::Go(ticket);
            }
            match self.take_slot(profile, max).await {
                Ok(Some(ticket)) => Admission::Go(ticket),
                Ok(None) => Admission::Busy { max },
                Err(error) => {
                    warn!(%error, profile = %profile.name, "cannot take a cap slot; the run waits");
                    Admission::Busy { max }
                }
            }
        })
    }

    fn pause<'a>(
        &'a self,
        run_id: Uuid,
        profile: &'a str,
        pause: &'a PauseRequest,
    ) -> GateFuture<'a, ()> {
        Box::pin(async move {
            // Known here at once; the stream tells every worker, this one included.
            self.pauses.note(profile, pause.clone());
            let message = ProfilePause {
                schema_version: SCHEMA_VERSION,
                profile: profile.to_string(),
                until: pause.until.clone(),
                reason: pause.reason.clone(),
                run_id,
            };
            let payload = serde_json::to_vec(&message).unwrap_or_default();
            let stream = self.topology.pauses();
            let signature = self.key.sign(&bound(&stream, &payload));
            // Through the control exchange: every worker's control queue gets it at once, and
            // the stream keeps it for workers that start later (one word after `pause.`).
            let routing_key = format!("pause.{}", profile.replace('.', "_"));
            if let Err(error) = self
                .publisher
                .publish(
                    &self.topology.control(),
                    &routing_key,
                    &payload,
                    Some(amqp::signature_headers(signature)),
                )
                .await
            {
                warn!(%error, profile, "cannot tell the pool of the profile's pause; other workers learn it from their own stages");
            }
        })
    }
}

/// The pauses this worker knows, as the broker tells them: live through the control
/// exchange (`pause.{profile}`, on the control consumer's queue), and, whenever that consumer
/// connects, caught up from the stream `{prefix}.pauses` (kept two days; a pause lasts at most
/// one), so a worker that starts later knows every pause in force. Keeps
/// `forgepool_profile_paused` true.
#[derive(Debug)]
pub struct PauseBook {
    topology: Topology,
    pauses: Arc<Pauses>,
    metrics: Arc<Metrics>,
    /// Only pauses signed with the cluster's key are taken.
    key: JobKey,
    /// The profiles of this worker's agents file: a pause of another name is ignored.
    profiles: BTreeSet<String>,
}

/// How long the catch-up waits for the stream's next message before it takes it as read.
const CATCH_UP_IDLE: Duration = Duration::from_millis(300);
/// The longest catch-up.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(10);

impl PauseBook {
    /// A book of `pauses`, checked with `key` against this worker's `profiles`.
    pub fn new(
        topology: Topology,
        pauses: Arc<Pauses>,
        metrics: Arc<Metrics>,
        (key, profiles): (JobKey, BTreeSet<String>),
    ) -> PauseBook {
        PauseBook {
            topology,
            pauses,
            metrics,
            key,
            profiles,
        }
    }

    /// Takes one pause message: signed by the cluster (over the stream's name and the body),
    /// well formed, at most a day ahead, of a profile of this worker.
    pub fn take(&self, delivery: &Delivery) {
        let now = SystemTime::now();
        let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
        let signed = self
            .key
            .verify(
                &bound(&self.topology.pauses(), &delivery.data),
                signature.as_deref(),
            )
            .map_err(|reason| format!("not signed by the cluster: {reason}"));
        let taken = signed
            .and_then(|()| proto::decode_message::<ProfilePause>(&delivery.data, MAX_PAUSE_BYTES))
            .and_then(|pause| pause.check(now).map(|()| pause))
            .and_then(|pause| match self.profiles.contains(&pause.profile) {
                true => Ok(pause),
                false => Err(format!(
                    "profile `{}` is not in this worker's agents file",
                    pause.profile
                )),
            });
        match taken {
            Ok(pause) if pause.ends().is_some_and(|ends| ends > now) => {
                let request = PauseRequest {
                    reason: pause.reason.clone(),
                    until: pause.until.clone(),
                };
                if self.pauses.note(&pause.profile, request) {
                    info!(profile = %pause.profile, until = %pause.until, reason = %pause.reason, run_id = %pause.run_id, "the profile is paused across the pool");
                }
                self.metrics.set_profile_paused(&pause.profile, true);
            }
            Ok(_) => {}
            Err(reason) => warn!(%reason, "a pause message is ignored"),
        }
    }

    /// Reads the stream from the start of its retention on a channel of `connection`, until
    /// it has nothing more to say (bounded).
    pub async fn catch_up(&self, connection: &lapin::Connection) -> Result<(), AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let read = async {
            let channel = connection
                .create_channel()
                .await
                .map_err(broker("open channel"))?;
            channel
                .basic_qos(64, BasicQosOptions::default())
                .await
                .map_err(broker("set prefetch"))?;
            let mut arguments = FieldTable::default();
            arguments.insert(
                "x-stream-offset".into(),
                AMQPValue::LongString(LongString::from("first")),
            );
            let mut consumer = channel
                .basic_consume(
                    self.topology.pauses().into(),
                    "pauses-catch-up".into(),
                    BasicConsumeOptions::default(),
                    arguments,
                )
                .await
                .map_err(broker("read the pause stream"))?;
            while let Ok(Some(Ok(delivery))) =
                tokio::time::timeout(CATCH_UP_IDLE, consumer.next()).await
            {
                self.take(&delivery);
                // A stream keeps its messages: the ack only lets the next ones come.
                let _ = delivery.acker.ack(BasicAckOptions::default()).await;
            }
            let _ = channel.close(200, "caught up".into()).await;
            Ok(())
        };
        tokio::time::timeout(CATCH_UP_LIMIT, read)
            .await
            .map_err(|_| AmqpError::Pool("the pause stream was not read in time".into()))?
    }

    /// Ends pauses in the metrics when their time comes, until `shutdown`.
    pub async fn expire(self: Arc<Self>, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                () = shutdown.cancelled() => return,
            }
            for profile in self.pauses.expire(SystemTime::now()) {
                info!(profile, "the profile's pause ended");
                self.metrics.set_profile_paused(&profile, false);
            }
        }
    }
}
