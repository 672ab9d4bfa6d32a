//! The dispatcher's shared state, and what it does for its handlers: submit, store events,
//! resume and cancel runs.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use proto::amqp::{self, AmqpError, Publisher, Topology};
use proto::{Control, Event, EventKind, Job, RunRequest, RunState, SCHEMA_VERSION};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use crate::store::{RunRecord, RunStore, Store, StoreError};
use crate::{AgentBook, Freezer, Frozen, SubmitError};
use telemetry::Metrics;

/// How long publishing a job or a control message may keep retrying.
pub(crate) const PUBLISH_DEADLINE: Duration = Duration::from_secs(30);

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

/// What a submission made.
#[derive(Debug)]
pub enum Submission {
    /// A new run.
    New(Box<Frozen>),
    /// Nothing: the submission repeats one seen in the last 24 hours, whose run this is.
    Repeat(Uuid),
}

/// How a cancel went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// The run is cancelled (it was queued or paused).
    Now,
    /// The request is stored; the worker holding the run stops it.
    Requested,
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
    Broker(PublishError),
}

/// Why a job could not be published.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The run's epoch could not be read.
    #[error("cannot read the run's epoch from the store: {0}")]
    Store(#[from] StoreError),
    /// The broker did not take it.
    #[error(transparent)]
    Broker(#[from] AmqpError),
}

/// How many stored events the live channel of the event streams holds: a stream more than
/// this far behind reads the rest from the store (the channel's memory is bounded whatever
/// the streams do).
pub const LIVE_EVENTS: usize = 1024;

/// The position a live event carries when it has none: its run's streams read the store.
pub const RESYNC: i64 = -1;

/// The shared state of the dispatcher's tasks and handlers.
#[derive(Debug)]
pub struct Dispatcher {
    /// The run store.
    pub store: Store,
    /// The confirming publisher (jobs, control messages, dead letters).
    pub publisher: Publisher,
    /// Queue and exchange names.
    pub topology: Topology,
    pub(crate) skills_dir: PathBuf,
    pub(crate) agents: AgentBook,
    pub(crate) job_key: proto::JobKey,
    /// How long a published job stays valid (`FORGEPOOL_JOB_TTL`).
    pub(crate) job_ttl: Duration,
    pub(crate) allowed_schemes: Vec<String>,
    /// The bearer token, when authentication is on.
    pub api_token: Option<String>,
    /// Every event stored, with its position, sent once to every open event stream: live
    /// events reach watchers without a store read. A stream that falls behind the channel
    /// (it holds [`LIVE_EVENTS`]) reads what it missed from the store instead.
    pub events_stored: tokio::sync::broadcast::Sender<Arc<(i64, Event)>>,
    /// Held from storing an event to sending it on [`Dispatcher::events_stored`], one per
    /// shard of runs ([`Dispatcher::event_lock`]), so that the channel carries each run's
    /// events in the order of their positions and a stream can tell a repeat (at or below its
    /// position) from a new event; other runs' events are stored meanwhile.
    pub(crate) event_order: Vec<tokio::sync::Mutex<()>>,
    /// The frozen jobs of the runs whose events arrive (no store read per event).
    pub(crate) jobs: crate::job_cache::JobCache,
    /// Whether other dispatchers store events in the same store: the broadcast then only
    /// wakes streams, which read what is stored.
    pub shared_store: bool,
    /// The pool as last sampled (`GET /v1/pool`).
    pub pool: std::sync::Mutex<proto::PoolView>,
    /// The worker processes alive, as their beacons say.
    pub roster: crate::roster::Roster,
    /// Whether the events consumer is connected (for `/readyz`).
    pub broker_ready: AtomicBool,
    /// Whether `/metrics` is served on a port of its own rather than the API's.
    pub metrics_apart: bool,
    /// Whether the broker topology is declared; before, a submission is only stored, and the
    /// republisher publishes it once the topology exists.
    pub(crate) topology_ready: AtomicBool,
    /// Cancelled at shutdown: event streams end, so that the HTTP server can stop.
    pub stopping: CancellationToken,
    /// What `/metrics` serves.
    pub metrics: Metrics,
    /// The event streams open per run, capped.
    pub streams: Arc<crate::streams::StreamCounts>,
    pub(crate) amqp_url: String,
    /// Paused runs that resume by themselves when their profile's pause ends.
    pub(crate) resumes: crate::schedule::Schedule,
    /// Runs that ended, for the webhooks (`FORGEPOOL_WEBHOOKS_FILE`).
    pub(crate) ended: Option<crate::webhooks::Ended>,
    /// The trackers tickets come from (`FORGEPOOL_TRACKERS_FILE`).
    pub trackers: Option<Arc<crate::trackers::set::Trackers>>,
}

impl Dispatcher {
    /// Validates, freezes, stores and publishes a request. A run that is stored but cannot be
    /// published yet is published later by the republisher; it is never lost.
    pub async fn submit(&self, request: RunRequest) -> Result<Frozen, SubmitFailure> {
        match self.submit_once(request, None).await? {
            Submission::New(frozen) => Ok(*frozen),
            Submission::Repeat(_) => unreachable!("a submission without a key is always new"),
        }
    }

    /// Like [`Dispatcher::submit`], but a submission whose `key` was seen in the last 24 hours
    /// returns the first run instead of creating another (SPEC 11).
    pub async fn submit_once(
        &self,
        request: RunRequest,
        key: Option<&str>,
    ) -> Result<Submission, SubmitFailure> {
        self.submit_continuing(request, key, None).await
    }

    /// Like [`Dispatcher::submit_once`], for a run that continues another (SPEC 17).
    pub(crate) async fn submit_continuing(
        &self,
        request: RunRequest,
        key: Option<&str>,
        follow_up: Option<proto::FollowUp>,
    ) -> Result<Submission, SubmitFailure> {
        let freezer = Freezer::from_process_env(&self.skills_dir, self.agents.clone())
            .with_allowed_schemes(self.allowed_schemes.clone());
        // Freezing reads the skill's files: on a blocking thread, never the runtime's. It comes
        // before the key is looked up: a request that is not valid is refused as such, repeated
        // key or not, and freezing stores nothing.
        let mut frozen = tokio::task::spawn_blocking(move || freezer.freeze(request))
            .await
            .unwrap_or_else(|panicked| std::panic::resume_unwind(panicked.into_panic()))?;
        frozen.job.follow_up = follow_up;
        if let Some(key) = key {
            if let Some(first) = self.store.run_of_key(key).await? {
                return self.repeat(first, key, &frozen.job).await;
            }
        }
        if let Some(first) = self.store.insert_run_once(&frozen.job, key).await? {
            // The same key was submitted at the same moment: the first one won.
            return self
                .repeat(first, key.unwrap_or_default(), &frozen.job)
                .await;
        }
        info!(run_id = %frozen.job.run_id, ticket = %frozen.job.ticket, "run accepted");
        if !self.topology_ready.load(Ordering::SeqCst) {
            // Publishing could only wait for the broker: the republisher publishes it as soon
            // as the queues exist.
            info!(run_id = %frozen.job.run_id, "job stored; it is published once RabbitMQ is set up");
        } else if let Err(error) = self.publish_job(&frozen.job, false).await {
            warn!(run_id = %frozen.job.run_id, %error, "job stored but not yet published; it will be retried");
        }
        Ok(Submission::New(Box::new(frozen)))
    }

    /// A submission whose `key` named the run `first`: a repeat when it is the same request,
    /// refused when the key was used for another (the IETF Idempotency-Key draft's 422).
    async fn repeat(&self, first: Uuid, key: &str, job: &Job) -> Result<Submission, SubmitFailure> {
        let record = self.store.get_run(first).await?;
        let digest = record.and_then(|record| record.job.request_digest);
        match (digest, &job.request_digest) {
            (Some(first_digest), Some(digest)) if first_digest != *digest => {
                let field = if key.starts_with("amqp:") {
                    "message_id"
                } else {
                    "Idempotency-Key"
                };
                Err(SubmitFailure::Invalid(SubmitError::Invalid {
                    field: field.into(),
                    message: format!(
                        "was used in the last 24 hours for another request (run {first}); a key names one request: send a new key with a new request"
                    ),
                }))
            }
            _ => Ok(Submission::Repeat(first)),
        }
    }

    /// Publishes `job` to the jobs queue. `again` marks a copy that may follow an execution of
    /// the run (a run queued again, a job published late): only such a copy makes the worker
    /// look for progress kept on the broker.
    pub(crate) async fn publish_job(&self, job: &Job, again: bool) -> Result<(), PublishError> {
        // The epoch is read from the store as it stands after the `queued` state that made
        // this copy: a worker runs the copy only while the store still names that epoch.
        let epoch = self.epoch(job.run_id).await?;
        let mut job = job.clone();
        job.publication = Some(proto::Publication::new(
            epoch,
            std::time::SystemTime::now(),
            self.job_ttl,
        ));
        let payload = serde_json::to_vec(&job).unwrap_or_default();
        let carried = amqp::Carried {
            again,
            ..amqp::Carried::default()
        };
        let headers = carried
            .headers(Some(self.job_key.sign(&payload)))
            .unwrap_or_default();
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

    /// The run's epoch: how many times the dispatcher queued it again (a resume, a requeue of
    /// a silent run), counted from its stored `queued` states that no worker published.
    pub(crate) async fn epoch(&self, run_id: Uuid) -> Result<u32, StoreError> {
        let states = self
            .store
            .events_of_kinds(run_id, &["state"], false, u32::MAX)
            .await?;
        Ok(epoch_of(states.iter().map(|(_, event)| event)))
    }

    /// Answers a worker's question: is this execution of a run still live in the store? The
    /// lost executions it reports are kept; at [`proto::MAX_LOST_EXECUTIONS`] the run fails
    /// with that reason, and the answer says so.
    pub(crate) async fn answer(
        &self,
        query: &proto::ExecutionQuery,
    ) -> Result<proto::ExecutionAnswer, StoreError> {
        let Some(mut record) = self.store.get_run(query.run_id).await? else {
            return Ok(proto::ExecutionAnswer::to(query, None));
        };
        if query.lost > 0 && !record.state.is_terminal() {
            let lost = self.store.record_lost(query.run_id, query.lost).await?;
            if lost >= proto::MAX_LOST_EXECUTIONS {
                let reason = format!(
                    "the run's execution was lost {lost} times (its worker died, or lost the \
                     broker, while running it; the limit is {}): the ticket can be submitted again",
                    proto::MAX_LOST_EXECUTIONS
                );
                warn!(run_id = %query.run_id, %reason, "failing a run whose workers keep dying");
                let event = Event::new(
                    query.run_id,
                    EventKind::State {
                        state: RunState::Failed,
                        reason,
                    },
                );
                self.store_event(&record.job, &event).await?;
                record.state = RunState::Failed;
            }
        }
        let epoch = self.epoch(query.run_id).await?;
        Ok(proto::ExecutionAnswer::to(
            query,
            Some((record.state, epoch)),
        ))
    }

    /// Stores an event of `job`'s run (one the dispatcher made); when it is new, counts it in
    /// the metrics and wakes the watchers. Returns whether it was new.
    pub async fn store_event(&self, job: &Job, event: &Event) -> Result<bool, StoreError> {
        self.store_event_after(Some(RunState::Queued), job, event)
            .await
            .map(|recorded| recorded.new)
    }

    /// Like [`Dispatcher::store_event`], for an event a worker published: the run's state
    /// before it (`prior`, or the store's when `None`) decides whether it is the outcome of a
    /// run that had already ended (a late duplicate), which is stored but not counted again,
    /// as is a cycle file rewritten in place.
    pub(crate) async fn store_event_after(
        &self,
        prior: Option<RunState>,
        job: &Job,
        event: &Event,
    ) -> Result<crate::store::Recorded, StoreError> {
        let order = self.event_lock(event.run_id).lock().await;
        let recorded = self.store.record(event).await?;
        let (new, repeats) = (recorded.new, recorded.repeats);
        let prior = prior.or(recorded.prior).unwrap_or(RunState::Queued);
        if let (true, EventKind::Checkpoint { checkpoint }) = (new, &event.kind) {
            self.resumes.add(event.run_id, checkpoint);
        }
        let late_outcome = prior.is_terminal()
            && matches!(
                event.kind,
                EventKind::State { .. } | EventKind::Result { .. }
            );
        if new {
            if !late_outcome && !repeats {
                self.metrics.observe(job, &event.kind);
                self.metrics.observe_run_times(job, event, prior);
            }
            let ends = matches!(&event.kind, EventKind::State { state, .. } if state.is_terminal());
            if let (true, false, Some(ended)) = (ends, late_outcome, &self.ended) {
                // A full queue is caught up by the notifier's check within a minute.
                if ended.sender.try_send(event.run_id).is_err() {
                    ended.dropped.store(true, Ordering::SeqCst);
                }
            }
            // With no stream open there is no receiver, and nothing to send.
            if self.events_stored.receiver_count() > 0 {
                // Sent to every stream open; each keeps only its run's. Without its position
                // (the store did not answer), it tells the run's streams to read the store.
                let position = recorded.position.unwrap_or(RESYNC);
                let _ = self.events_stored.send(Arc::new((position, event.clone())));
            }
        }
        drop(order);
        Ok(recorded)
    }

    /// The lock that orders `run_id`'s events between the store and the broadcast.
    pub(crate) fn event_lock(&self, run_id: Uuid) -> &tokio::sync::Mutex<()> {
        let shard = (run_id.as_u128() % self.event_order.len() as u128) as usize;
        &self.event_order[shard]
    }

    /// The frozen job of `run_id` (`None`: no such run), from the cache or the store.
    pub(crate) async fn job_of(&self, run_id: Uuid) -> Result<Option<Arc<Job>>, StoreError> {
        if let Some(job) = self.jobs.get(run_id) {
            return Ok(Some(job));
        }
        let Some(job) = self.store.job_of(run_id).await? else {
            return Ok(None);
        };
        let job = Arc::new(job);
        self.jobs.put(Arc::clone(&job));
        Ok(Some(job))
    }

    /// Queues a paused run again with its latest checkpoint and its original frozen job, so
    /// it continues where it stopped with the same budget, limits and profiles. Returns the
    /// checkpoint's sequence number.
    pub async fn resume(&self, record: &crate::store::RunRecord) -> Result<u32, ResumeFailure> {
        let checkpoint = self.latest_checkpoint(record.job.run_id).await?;
        let queued = proto::resumed_event(record.job.run_id, &checkpoint);
        self.resume_from(record, checkpoint, queued).await
    }

    /// Resumes a paused run whose profile's pause ended, if it is still paused at checkpoint
    /// `sequence` (a manual resume or a later pause made the schedule's entry stale). Returns
    /// whether it resumed it.
    pub async fn resume_automatically(
        &self,
        record: &RunRecord,
        sequence: u32,
    ) -> Result<bool, ResumeFailure> {
        let checkpoint = self.latest_checkpoint(record.job.run_id).await?;
        if checkpoint.sequence != sequence {
            return Ok(false);
        }
        let queued = Event::new(
            record.job.run_id,
            EventKind::State {
                state: RunState::Queued,
                reason: format!(
                    "{} from checkpoint {sequence}: the pause of its agent profile ended",
                    proto::AUTO_RESUMED_REASON
                ),
            },
        );
        self.resume_from(record, checkpoint, queued).await?;
        Ok(true)
    }

    async fn latest_checkpoint(&self, run_id: Uuid) -> Result<proto::Checkpoint, ResumeFailure> {
        let events = self.store.events(run_id, 0).await?;
        proto::latest_checkpoint(events.iter().map(|(_, event)| event))
            .ok_or(ResumeFailure::NoCheckpoint(run_id))
    }

    async fn resume_from(
        &self,
        record: &RunRecord,
        checkpoint: proto::Checkpoint,
        queued: Event,
    ) -> Result<u32, ResumeFailure> {
        let run_id = record.job.run_id;
        let sequence = checkpoint.sequence;
        let mut job = record.job.clone();
        job.resume = Some(checkpoint);
        self.store_event(&record.job, &queued).await?;
        if let Err(error) = self.publish_job(&job, true).await {
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

    /// Cancels a run, durably: the cancel is stored before anyone is told. A queued or paused
    /// run is cancelled in the store at once (no worker holds it); for a running run the
    /// request is stored, and the worker holding it is told now and again each time it reports
    /// the run. A failed publish is only a warning: the next report tells the worker.
    pub async fn cancel(&self, job: &Job, state: RunState) -> Result<Cancelled, StoreError> {
        let (kind, cancelled) = match state {
            RunState::Queued | RunState::Paused => (
                EventKind::State {
                    state: RunState::Cancelled,
                    reason: format!("cancelled by request while {state}"),
                },
                Cancelled::Now,
            ),
            _ => (
                EventKind::CancelRequested {
                    reason: "cancel requested through the API".into(),
                },
                Cancelled::Requested,
            ),
        };
        self.store_event(job, &Event::new(job.run_id, kind)).await?;
        if let Err(error) = self.publish_cancel(job.run_id).await {
            warn!(run_id = %job.run_id, %error, "cannot tell the workers yet; the run's next report will");
        }
        Ok(cancelled)
    }

    /// Queues a silent run again: its state goes back to `queued` with the reason, and its job
    /// is published (by the republisher, if not now).
    pub(crate) async fn requeue_silent(
        &self,
        job: &Job,
        silent_after: Duration,
    ) -> Result<(), StoreError> {
        let reason = format!(
            "nothing was heard from its worker for {} s; queued again to continue from its last completed stage",
            silent_after.as_secs()
        );
        warn!(run_id = %job.run_id, "{reason}");
        self.store.mark_unpublished(job.run_id).await?;
        let queued = Event::new(
            job.run_id,
            EventKind::State {
                state: RunState::Queued,
                reason,
            },
        );
        self.store_event(job, &queued).await?;
        if let Err(error) = self.publish_job(job, true).await {
            warn!(run_id = %job.run_id, %error, "the silent run's job will be published later");
        }
        Ok(())
    }

    /// Tells the worker that reports a run to cancel it again, when the run was cancelled
    /// (or asked to be) after the worker took it: its first report, a heartbeat after a
    /// reconnection, or the next worker's.
    pub(crate) async fn cancel_again_if_asked(&self, state: Option<RunState>, event: &Event) {
        let reports = matches!(
            event.kind,
            EventKind::State {
                state: RunState::Running,
                ..
            } | EventKind::Heartbeat { .. }
                | EventKind::StageStarted { .. }
        );
        if !reports {
            return;
        }
        let asked = state == Some(RunState::Cancelled)
            || self
                .store
                .cancel_requested(event.run_id)
                .await
                .unwrap_or(false);
        if asked {
            let _ = self.publish_cancel(event.run_id).await;
        }
    }

    pub(crate) async fn publish_cancel(&self, run_id: Uuid) -> Result<(), AmqpError> {
        let control = Control {
            schema_version: SCHEMA_VERSION,
            run_id,
            action: proto::ControlAction::Cancel,
        };
        let payload = serde_json::to_vec(&control).unwrap_or_default();
        // Control messages are not mandatory: no worker may hold the run right now.
        self.publisher
            .publish_optional(
                &self.topology.control(),
                &format!("cancel.{run_id}"),
                &payload,
            )
            .await
    }
}

/// The epoch of a run from its state events: its `queued` states the dispatcher stored (a
/// worker's events carry their execution; a run waiting for a cap slot is `queued` by its
/// worker, and that starts no new execution).
fn epoch_of<'a>(events: impl Iterator<Item = &'a Event>) -> u32 {
    let queued = events.filter(|event| {
        event.execution.is_none()
            && matches!(
                event.kind,
                EventKind::State {
                    state: RunState::Queued,
                    ..
                }
            )
    });
    u32::try_from(queued.count()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: an epoch that counts a worker's `queued` (a run waiting for a cap slot), which
    /// would make the live copy of the job look superseded and drop it unrun.
    #[test]
    fn the_epoch_counts_only_the_dispatchers_queued_states() {
        let run = Uuid::new_v4();
        let queued = |reason: &str| {
            Event::new(
                run,
                EventKind::State {
                    state: RunState::Queued,
                    reason: reason.into(),
                },
            )
        };
        let running = Event::new(
            run,
            EventKind::State {
                state: RunState::Running,
                reason: String::new(),
            },
        )
        .by(Uuid::new_v4());
        let waiting = queued("waits for a cap slot").by(Uuid::new_v4());
        assert_eq!(epoch_of([&running, &waiting].into_iter()), 0);
        let resumed = queued("resumed");
        let requeued = queued("silent");
        assert_eq!(epoch_of([&running, &waiting, &resumed].into_iter()), 1);
        assert_eq!(
            epoch_of([&running, &resumed, &waiting, &requeued].into_iter()),
            2
        );
    }
}
