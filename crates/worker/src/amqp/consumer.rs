//! Jobs in: the jobs queue's consumer, the checks every job message passes, and one run's
//! life from its delivery to its settlement (done marker, claim, lease, execution, heartbeats).
//!
//! A job is acknowledged only after its final event is confirmed by the broker.
//!
//! The prefetch is the worker's slots. A job message passes `trusted_job` (size, signature,
//! schema version, fields, repository URL, profiles equal to the worker's own, the
//! publication's expiry). Then, in order: the run's done marker is checked (a durable queue
//! `{prefix}.done.{key}`, kept an hour; the key is the run id, plus `.{checkpoint}` for a
//! resumed run, so a paused execution's marker never settles the resumed one); the run is
//! claimed in the process; its lease is taken; `execution::ask` asks the dispatcher whether the
//! job's epoch is still live (not live: acknowledged unrun; no answer in 10 s: parked); the
//! engine runs with heartbeats beside it; the done marker is declared; the delivery is settled
//! as decided (`Disposition`); then the lease, the claim and the slot are given back, in that
//! order.
//!
//! A job whose lease another live worker holds (the broker redelivered it after a consumer
//! timeout) is parked in `{prefix}.jobs.waiting` (a quorum queue; 3 s TTL, dead-lettered at least
//! once back to the jobs queue) until the holder finishes. A job the broker delivers again after
//! its holder lost it is counted (`x-forgepool-lost`) and parked at once, with the waits it has
//! left in `x-forgepool-holds` (`proto::amqp::Carried`; four waits of 3 s cover the 10 s
//! `REDELIVERY_GRACE`, two sweeps), so the worker still running it, if it lives, takes its lease
//! again first, and a worker that dies holding the parked copy never held the job. Every move of
//! a job to another queue (parked, waiting for a cap, handed over) is `republish`: a fresh copy
//! confirmed before the delivery is acknowledged. A run whose execution was lost ten times is
//! failed by the dispatcher when the next copy asks whether it is live (`MAX_LOST_EXECUTIONS`).
//! docs/RELIABILITY.md tells the whole story with its tests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use proto::amqp::{
    self, AmqpError, Carried, Consume, DeadLetters, Delivery, Disposition, Publisher,
};
use proto::amqp::{Session, Topology};
use proto::{AgentProfile, Job, MAX_JOB_BYTES};
use telemetry::Metrics;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, info_span, warn, Instrument};

use super::execution::Liveness;
use super::gate::AmqpGate;
use super::lease::{Claim, InFlight, Leases, SWEEP_INTERVAL};
use super::ledger::AmqpLedger;
use super::sink::{AmqpSink, ObservedSink};
use crate::config::WorkerConfig;
use crate::engine::{Engine, Execution, RunControl};
use crate::ports::gate::Role;
use crate::runtime::ContainerRuntime;

/// Everything a run needs from the worker: its settings, the engine, and the broker's parts.
pub struct Jobs<R: ContainerRuntime> {
    /// The worker's settings.
    pub config: WorkerConfig,
    /// The engine that executes runs.
    pub engine: Engine<R>,
    /// Queue and exchange names.
    pub topology: Topology,
    /// The confirming publisher (events, parked jobs, dead letters).
    pub publisher: Arc<Publisher>,
    /// The events of runs.
    pub sink: AmqpSink,
    /// The final review ledger.
    pub ledger: AmqpLedger,
    /// Leases, done markers and presence.
    pub leases: Arc<Leases>,
    /// Profile caps and pauses across the pool.
    pub gate: Arc<AmqpGate>,
    /// The runs this worker executes.
    pub in_flight: Arc<InFlight>,
    /// What `/metrics` serves.
    pub metrics: Arc<Metrics>,
    /// Run slots.
    pub slots: Arc<Semaphore>,
    /// Fired when in-flight runs must stop and be handed back.
    pub interrupt: CancellationToken,
    /// Fired when the worker stops taking work (SIGTERM): jobs not started yet go back.
    pub draining: CancellationToken,
}

/// The jobs queue's consumer: each delivery is checked, then run in a task of `runs`.
pub struct JobFeed<R: ContainerRuntime> {
    /// The worker's parts.
    pub jobs: Arc<Jobs<R>>,
    /// The tasks of the runs in flight.
    pub runs: TaskTracker,
}

impl<R: ContainerRuntime> std::fmt::Debug for Jobs<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jobs")
            .field("worker", &self.config.worker_id)
            .finish_non_exhaustive()
    }
}

impl<R: ContainerRuntime> std::fmt::Debug for JobFeed<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobFeed")
            .field("jobs", &self.jobs)
            .field("runs", &self.runs.len())
            .finish()
    }
}

impl<R: ContainerRuntime> JobFeed<R> {
    fn tag(&self) -> String {
        format!("worker-{}", self.jobs.config.worker_id)
    }
}

impl<R: ContainerRuntime> Consume for JobFeed<R> {
    fn name(&self) -> &str {
        "worker-jobs"
    }

    async fn open(&self, again: bool) -> Result<Session, AmqpError> {
        let jobs = &self.jobs;
        // After a lost connection, take the leases of the runs still in flight again before
        // any job arrives: the broker has just offered those jobs to every worker.
        if again {
            let _ = jobs.leases.refresh().await;
        }
        let prefetch = u16::try_from(jobs.config.concurrency).unwrap_or(u16::MAX);
        let queue = jobs.topology.jobs();
        amqp::open_consumer(
            &jobs.config.amqp_url,
            &self.tag(),
            &jobs.topology,
            &queue,
            prefetch,
        )
        .await
    }

    async fn handle(&self, delivery: Delivery) {
        take_delivery(&self.jobs, &self.runs, delivery).await;
    }

    fn connected(&self, again: bool) {
        self.jobs.metrics.set_broker_connected(true);
        if again {
            self.jobs.metrics.broker_reconnected("worker-jobs");
        }
    }

    fn disconnected(&self) {
        self.jobs.metrics.set_broker_connected(false);
    }

    /// The runs in flight settle their deliveries on the lost session's channel, if it still
    /// lives: it is left to the broker rather than closed.
    async fn retire(&self, session: Session) {
        drop(session);
    }
}

/// What one delivery still holds of its run once it is settled.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// The run's lease on the broker.
    lease: bool,
    /// The run's claim in this process.
    claim: bool,
}

/// How long a job lost by its worker waits before its lease is tried: two sweeps, in which a
/// live worker that still runs it declares its lease again.
const REDELIVERY_GRACE: Duration = Duration::from_secs(2 * SWEEP_INTERVAL.as_secs());

/// The grace as waits in the wait queue (its TTL each, on the broker's clock): at least
/// [`REDELIVERY_GRACE`].
const GRACE_HOLDS: u32 = ((REDELIVERY_GRACE.as_millis() as i64 + amqp::WAIT_QUEUE_TTL_MS - 1)
    / amqp::WAIT_QUEUE_TTL_MS) as u32;

async fn take_delivery<R: ContainerRuntime>(
    jobs: &Arc<Jobs<R>>,
    runs: &TaskTracker,
    delivery: Delivery,
) {
    let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
    let job = match trusted_job(&jobs.config, &delivery.data, signature.as_deref()) {
        Ok(job) => job,
        Err(reason) => {
            return jobs
                .settle(&delivery, Disposition::DeadLetter(reason))
                .await
        }
    };
    // The prefetch keeps deliveries within our slots, but the next delivery can arrive just
    // before the slot of the run that was acknowledged is released: it waits for that slot
    // instead of bouncing back to the queue (which would count against the delivery limit).
    let jobs = Arc::clone(jobs);
    let span = info_span!("job", run_id = %job.run_id, ticket = %job.ticket);
    runs.spawn(
        async move {
            let carried = Carried::of(&delivery.properties);
            if let Some(disposition) = jobs.held_back(&job, &delivery, carried).await {
                return jobs.settle(&delivery, disposition).await;
            }
            let Ok(permit) = Arc::clone(&jobs.slots).acquire_owned().await else {
                // The worker drains before a slot came free: the job goes back as a fresh copy,
                // so an unstarted job's hand-over does not count toward the delivery limit.
                let queue = jobs.topology.jobs();
                let handed = jobs.republish(&delivery, &queue, carried).await;
                return jobs.settle(&delivery, handed).await;
            };
            let run_id = job.run_id;
            let held = jobs.run(job, delivery, carried).await;
            // The lease goes back before the run leaves this worker's claims and its slot:
            // a copy of the run taken here meanwhile must not lose the lease it relies on.
            if held.lease {
                jobs.leases.release(run_id).await;
            }
            if held.claim {
                jobs.in_flight.release(run_id).await;
            }
            drop(permit);
        }
        .instrument(span),
    );
}

/// What becomes of a copy of a job that the broker delivered again after its holder lost it:
/// the loss is counted, and the job is poison once its execution was lost
/// [`amqp::LOST_BACKSTOP`] times (the dispatcher fails the run long before, at
/// [`proto::MAX_LOST_EXECUTIONS`], when this copy asks whether its execution is live).
fn after_loss(carried: Carried) -> Result<Carried, String> {
    let lost = carried.lost.saturating_add(1);
    if lost >= amqp::LOST_BACKSTOP {
        return Err(format!(
            "the job's execution was lost {lost} times (its worker died or lost the broker while \
             holding it): it is taken for poison"
        ));
    }
    Ok(Carried {
        lost,
        // The park that follows the loss is the first wait.
        holds: GRACE_HOLDS - 1,
        again: true,
        waits_for: carried.waits_for,
    })
}

impl<R: ContainerRuntime> Jobs<R> {
    /// Holds a copy back from running, without holding it here (SPEC 11: a job held unstarted
    /// by a worker that dies must not count toward the delivery limit):
    /// - one the broker delivered again after its holder lost it (a worker that died, or lost
    ///   the broker, while it held it) is counted and parked, a fresh copy, for the grace in
    ///   which that worker, if it lives, takes its lease again;
    /// - a parked copy whose grace has not passed goes back to the wait queue.
    ///
    /// `None` lets the copy run here.
    async fn held_back(
        &self,
        job: &Job,
        delivery: &Delivery,
        carried: Carried,
    ) -> Option<Disposition> {
        if delivery.redelivered && !self.in_flight.contains(job.run_id).await {
            return Some(match after_loss(carried) {
                Ok(counted) => self.park(delivery, counted).await,
                Err(poison) => Disposition::DeadLetter(poison),
            });
        }
        if carried.holds > 0 {
            let held = Carried {
                holds: carried.holds - 1,
                ..carried
            };
            return Some(self.park(delivery, held).await);
        }
        None
    }

    /// Settles a delivery of the jobs queue as decided, counting dead letters.
    async fn settle(&self, delivery: &Delivery, disposition: Disposition) {
        let source = self.topology.jobs();
        if matches!(disposition, Disposition::DeadLetter(_)) {
            self.metrics.dead_lettered(&source);
        }
        let dead_letters = DeadLetters {
            publisher: &self.publisher,
            topology: &self.topology,
            source: &source,
        };
        if let Err(error) = amqp::settle(delivery, disposition, dead_letters).await {
            // The channel was closed under us (a consumer timeout or a lost connection): the
            // broker offers the job again, and the done marker settles it then.
            warn!(%error, "cannot settle the job; the broker offers it again");
        }
    }

    /// One delivery of a trusted job: runs it unless it is finished or held elsewhere, then
    /// settles the delivery. Returns what this delivery still holds of the run (the caller
    /// gives back the lease, then the claim and the slot).
    async fn run(&self, job: Job, delivery: Delivery, carried: Carried) -> Held {
        let (disposition, held) = self.claim_and_execute(&job, &delivery, carried).await;
        self.settle(&delivery, disposition).await;
        held
    }

    /// Returns what to do with the delivery, and what of the run it still holds.
    async fn claim_and_execute(
        &self,
        job: &Job,
        delivery: &Delivery,
        carried: Carried,
    ) -> (Disposition, Held) {
        let (none, both) = (
            Held {
                lease: false,
                claim: false,
            },
            Held {
                lease: true,
                claim: true,
            },
        );
        let run_id = job.run_id;
        // Claim the run in this process first: the lease is exclusive per connection, so it
        // cannot tell two deliveries to this same worker apart.
        let Some(claim) = self.in_flight.claim(run_id, &self.interrupt).await else {
            // This worker runs it already (the broker redelivered it after a lost connection).
            return (self.park(delivery, carried).await, none);
        };
        match self.leases.acquire(run_id).await {
            Ok(true) => {}
            Ok(false) => {
                // Another live worker holds the run (the broker redelivered it after a consumer
                // timeout): park it in the wait queue; it comes back until that worker is done.
                self.in_flight.release(run_id).await;
                return (self.park(delivery, carried).await, none);
            }
            Err(error) => {
                self.in_flight.release(run_id).await;
                warn!(%error, "cannot lease the run; handing the job back");
                return (Disposition::Requeue, none);
            }
        }
        // The done marker is read once the lease is held: a worker declares it before it
        // gives its lease back, so a finished run delivered again is seen as finished and
        // acknowledged without running.
        match self
            .leases
            .exists(&self.topology.done(&job.execution_key()))
            .await
        {
            Ok(false) => {}
            Ok(true) => {
                info!("run already finished; acknowledging the redelivered job");
                return (Disposition::Ack, both);
            }
            Err(error) => {
                warn!(%error, "cannot check the done marker; handing the job back");
                return (Disposition::Requeue, both);
            }
        }
        if let Some(dropped) = self.unless_live(job, delivery, carried).await {
            return (dropped, both);
        }
        if let Some(parked) = self.still_waiting(job, delivery, carried).await {
            return (parked, both);
        }
        // The wait is over: no later copy of this job (a hand-over) waits for that slot again.
        let carried = Carried {
            waits_for: 0,
            ..carried
        };
        // A copy that was delivered again, or lost before, may follow an execution that pushed.
        let again = delivery.redelivered || carried.lost > 0 || carried.again;
        let (disposition, waiting) = self.execute(job, claim, again).await;
        self.gate.forget(run_id).await;
        if let Some(role) = waiting {
            info!(?role, "the run waits for its profile's cap");
            let waiting = Carried {
                holds: 0,
                again: true,
                waits_for: role.code(),
                ..carried
            };
            return (self.park(delivery, waiting).await, both);
        }
        let drained = self.draining.is_cancelled() || self.interrupt.is_cancelled();
        if disposition == Disposition::Requeue && drained {
            // A drain hands the run over (between stages, or when the drain time is over): a
            // fresh copy of the job goes back, so the hand-over does not count toward the
            // poison limit, and the next execution continues from the progress kept on the
            // broker.
            let handed = Carried {
                holds: 0,
                again: true,
                ..carried
            };
            return (
                self.republish(delivery, &self.topology.jobs(), handed)
                    .await,
                both,
            );
        }
        (disposition, both)
    }

    /// The store is the truth: a run that finished, paused or was queued again since this
    /// copy was published is not executed again, whatever the broker still holds (`Some`:
    /// acknowledged unrun). Without an answer the copy waits in the wait queue.
    async fn unless_live(
        &self,
        job: &Job,
        delivery: &Delivery,
        carried: Carried,
    ) -> Option<Disposition> {
        let liveness = match self.leases.channel().await {
            Ok(channel) => {
                let (topology, key) = (&self.topology, &self.config.job_key);
                super::execution::ask(channel, topology, key, job, carried.lost).await
            }
            Err(error) => Liveness::Unknown(error.to_string()),
        };
        match liveness {
            Liveness::Live => None,
            Liveness::NotLive(reason) => {
                warn!(%reason, "the job's execution is not live in the dispatcher's store; dropping it unrun");
                Some(Disposition::Ack)
            }
            Liveness::Unknown(reason) => {
                warn!(%reason, "cannot learn whether the job's execution is live; it waits");
                Some(self.park(delivery, carried).await)
            }
        }
    }

    /// A run that waits for a cap slot of one of its profiles takes the slot first; while
    /// every slot is taken its job waits again, silently and without a run slot (`Some`).
    async fn still_waiting(
        &self,
        job: &Job,
        delivery: &Delivery,
        carried: Carried,
    ) -> Option<Disposition> {
        let role = Role::from_code(carried.waits_for)?;
        if self.gate.reserve(job.run_id, role, job).await {
            return None;
        }
        let waiting = Carried {
            holds: 0,
            again: true,
            ..carried
        };
        Some(self.park(delivery, waiting).await)
    }

    /// Puts a job whose run is held elsewhere, or whose grace after a loss has not passed, into
    /// the wait queue: a fresh copy, signature, counts and all.
    async fn park(&self, delivery: &Delivery, carried: Carried) -> Disposition {
        let again = Carried {
            again: true,
            ..carried
        };
        self.republish(delivery, &self.topology.jobs_wait(), again)
            .await
    }

    /// Publishes a fresh copy of the delivered job to `queue` (a hand-over goes to the jobs
    /// queue, so it does not count toward the delivery limit); `Ack` once the broker confirmed
    /// it, `Requeue` when it could not be published.
    ///
    /// Every move of a job between queues (parked, waiting for a cap, handed over) comes here:
    /// the copy is confirmed before the delivery is acknowledged, so a crash at any step
    /// leaves the job on the broker once or twice, never not at all; a second copy is absorbed
    /// by the run's lease, its done marker and the store's live execution.
    async fn republish(&self, delivery: &Delivery, queue: &str, carried: Carried) -> Disposition {
        let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
        crate::fault::point("moving");
        match self
            .publisher
            .publish("", queue, &delivery.data, carried.headers(signature))
            .await
        {
            Ok(()) => {
                crate::fault::point("moved");
                Disposition::Ack
            }
            Err(_) => Disposition::Requeue,
        }
    }

    /// Executes a leased run with heartbeats beside it; a finished run is marked done before
    /// its job is acknowledged. With a role, the run waits for that role's profile's cap.
    async fn execute(
        &self,
        job: &Job,
        claim: Claim,
        redelivered: bool,
    ) -> (Disposition, Option<Role>) {
        let sink = ObservedSink::new(&self.sink, &self.metrics, job);
        self.metrics.runs_in_progress().inc();
        // A lost claim, like a drain, stops the run without its final events.
        let control = RunControl {
            cancel: claim.cancel,
            interrupt: claim.lost,
            again: redelivered,
            handover: self.draining.clone(),
        };
        let execution = self
            .engine
            .execute_in_pool(job, &sink, &self.ledger, control);
        // Heartbeats go out beside the run, never in its way.
        let heartbeats =
            self.sink
                .heartbeats(job.run_id, &self.config.worker_id, self.config.heartbeat);
        let outcome = tokio::select! {
            outcome = execution => outcome,
            () = heartbeats => unreachable!("heartbeats go on until the run ends"),
        };
        self.metrics.runs_in_progress().dec();
        match outcome {
            Ok(Execution::Ended(result)) => {
                crate::fault::point("ended");
                self.leases.mark_done(&job.execution_key()).await;
                crate::fault::point("marked-done");
                info!(state = %result.state, "job done");
                (Disposition::Ack, None)
            }
            Ok(Execution::Waiting(role)) => (Disposition::Ack, Some(role)),
            Ok(Execution::HandedBack) => (Disposition::Requeue, None),
            Err(error) => {
                warn!(%error, "final events not confirmed; handing the job back");
                (Disposition::Requeue, None)
            }
        }
    }
}

/// A job message checked as untrusted input: its size and signature first (nothing of an
/// unsigned message is parsed beyond that), then its schema, its fields, its repository URL,
/// and each of its profiles against the worker's own agents file. The error is the dead
/// letter's reason.
pub fn trusted_job(
    config: &WorkerConfig,
    data: &[u8],
    signature: Option<&str>,
) -> Result<Job, String> {
    if data.len() > MAX_JOB_BYTES {
        return Err(format!(
            "oversized message: {} bytes, over the limit of {MAX_JOB_BYTES}",
            data.len()
        ));
    }
    config.job_key.verify(data, signature)?;
    let job = decode_job(data)?;
    check_job(&job, &config.profiles, &config.allowed_schemes)?;
    let Some(publication) = &job.publication else {
        return Err(
            "the job carries no `publication` (its epoch and expiry): it was not published by a dispatcher of this release".into(),
        );
    };
    if let Some(reason) = publication.expired(std::time::SystemTime::now()) {
        return Err(reason);
    }
    Ok(job)
}

/// Checks a decoded job's fields, its repository URL, and each profile against the worker's
/// own profiles (image, command, env names, network, user and limits must be the same).
pub fn check_job(
    job: &Job,
    profiles: &BTreeMap<String, AgentProfile>,
    allowed_schemes: &[String],
) -> Result<(), String> {
    job.check()
        .map_err(|e| format!("the job is invalid: {e}"))?;
    proto::names::check_url(&job.repository.url, allowed_schemes)
        .map_err(|e| format!("the job's repository.url {e}"))?;
    let named = [
        Some(&job.implementer),
        job.reviewer.as_ref(),
        job.final_reviewer.as_ref(),
    ];
    for profile in named.into_iter().flatten() {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: losses that are not counted (a job that kills every worker that runs it would
    /// circulate for ever), a limit that is off by one, a lost job that is not held back for
    /// the grace in which its worker, if it lives, takes its lease again, and worker deaths
    /// counted against the broker's delivery limit (a run failed by bad luck).
    #[test]
    fn a_job_is_poison_after_its_execution_was_lost_as_often_as_the_backstop() {
        let mut carried = Carried::default();
        for lost in 1..amqp::LOST_BACKSTOP {
            carried = after_loss(carried).expect("not poison yet");
            assert_eq!(carried.lost, lost);
            assert!(carried.again, "a lost job may follow an execution");
            let waited = u64::from(carried.holds + 1) * amqp::WAIT_QUEUE_TTL_MS as u64;
            assert!(
                waited >= REDELIVERY_GRACE.as_millis() as u64,
                "parked for at least the grace, on the broker's clock"
            );
        }
        assert!(
            i64::from(carried.lost) >= amqp::DELIVERY_LIMIT,
            "more losses than the broker's delivery limit are survived"
        );
        let poison = after_loss(carried).expect_err("poison at the limit");
        assert!(poison.contains("lost 20 times"), "{poison}");
    }
}
