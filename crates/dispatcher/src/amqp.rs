//! The dispatcher's AMQP wing: its six consumers (events, submissions, dead letters, workers'
//! questions about executions, gateways' questions about daily budgets, workers' beacons) and
//! their handlers. Each handler decides a [`Disposition`]; [`Dispatcher::settle`] carries it
//! out, in one place.
//!
//! - events: stored, then acknowledged; unknown runs and malformed events are dead-lettered; a
//!   store failure is retried in place. They are stored in [`EVENT_LANES`] lanes at once, each
//!   run's events down one lane in the order they came (the store orders a run's events by its
//!   row, not across runs); a run's job is read once and kept (`crate::job_cache`);
//! - submissions: the same validation as the API, and an answer on `reply_to` when asked;
//! - dead letters: a job dead-lettered from the jobs queue (by a worker, or by the broker's
//!   delivery limit) fails its run with the reason;
//! - execution questions and allotment questions (`crate::allotments`), answered signed;
//! - workers' beacons, kept by `crate::roster`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use proto::amqp::{self, Consume, DeadLetters, Delivery, Disposition, Session};
use proto::{Event, EventKind, RunRequest, RunState};
use tokio_util::sync::CancellationToken;
use tracing::{info_span, warn, Instrument};
use uuid::Uuid;

use crate::dispatcher::{Dispatcher, Submission, SubmitFailure};
use crate::store::{RunStore, StoreError};

/// The queues the dispatcher consumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queue {
    /// Every event workers publish.
    Events,
    /// Run requests from external producers.
    Submissions,
    /// The dispatcher's copy of every dead letter.
    DeadLetters,
    /// Workers' questions: is this execution of a run still live?
    Executions,
    /// Gateways' questions: a share of a profile's daily budget.
    Allotments,
    /// Worker processes announcing themselves.
    Roster,
}

/// How many runs' events the events consumer stores at once.
pub const EVENT_LANES: usize = 16;
/// The deliveries one lane holds before the consumer waits for it.
const LANE_DEPTH: usize = 16;

/// One of the dispatcher's consumers.
struct Consumer {
    dispatcher: Arc<Dispatcher>,
    queue: Queue,
    /// The events consumer's lanes.
    lanes: Option<Lanes>,
}

type Laned = (Delivery, Result<Event, String>);

/// The events consumer's lanes: each a task storing and settling its deliveries in order.
struct Lanes {
    senders: Vec<tokio::sync::mpsc::Sender<Laned>>,
    tasks: tokio_util::task::TaskTracker,
}

impl Lanes {
    fn start(dispatcher: &Arc<Dispatcher>, source: &str) -> Lanes {
        let tasks = tokio_util::task::TaskTracker::new();
        let senders = (0..EVENT_LANES)
            .map(|_| {
                let (sender, mut receiver) = tokio::sync::mpsc::channel::<Laned>(LANE_DEPTH);
                let (dispatcher, source) = (Arc::clone(dispatcher), source.to_string());
                tasks.spawn(async move {
                    while let Some((delivery, decoded)) = receiver.recv().await {
                        let disposition = handle_event(&dispatcher, decoded).await;
                        dispatcher.settle(&delivery, disposition, &source).await;
                    }
                });
                sender
            })
            .collect();
        tasks.close();
        Lanes { senders, tasks }
    }

    /// Hands a delivery to its run's lane (a malformed one to the first).
    async fn send(&self, dispatcher: &Dispatcher, delivery: Delivery, source: &str) {
        let decoded = decode::<Event>(&delivery.data);
        let lane = match &decoded {
            Ok(event) => (event.run_id.as_u128() % EVENT_LANES as u128) as usize,
            Err(_) => 0,
        };
        if let Err(refused) = self.senders[lane].send((delivery, decoded)).await {
            let (delivery, _) = refused.0;
            dispatcher
                .settle(&delivery, Disposition::Requeue, source)
                .await;
        }
    }

    /// Lets the lanes store and settle what they hold, for up to 30 s.
    async fn finish(self) {
        drop(self.senders);
        let _ = tokio::time::timeout(Duration::from_secs(30), self.tasks.wait()).await;
    }
}

impl Consumer {
    fn source(&self) -> String {
        let topology = &self.dispatcher.topology;
        match self.queue {
            Queue::Events => topology.dispatcher_events(),
            Queue::Submissions => topology.submissions(),
            Queue::DeadLetters => topology.dispatcher_dead(),
            Queue::Executions => topology.executions(),
            Queue::Allotments => topology.allotments(),
            Queue::Roster => format!("{}.roster", topology.control()),
        }
    }
}

impl Consume for Consumer {
    fn name(&self) -> &str {
        match self.queue {
            Queue::Events => "forgepool-dispatcher-events",
            Queue::Submissions => "forgepool-dispatcher-submissions",
            Queue::DeadLetters => "forgepool-dispatcher-dead",
            Queue::Executions => "forgepool-dispatcher-executions",
            Queue::Allotments => "forgepool-dispatcher-allotments",
            Queue::Roster => "forgepool-dispatcher-roster",
        }
    }

    async fn open(&self, _again: bool) -> Result<Session, amqp::AmqpError> {
        let dispatcher = &self.dispatcher;
        if self.queue == Queue::Roster {
            let (url, name) = (&dispatcher.amqp_url, self.name());
            return amqp::open_roster_consumer(url, name, &dispatcher.topology).await;
        }
        amqp::open_consumer(
            &dispatcher.amqp_url,
            self.name(),
            &dispatcher.topology,
            &self.source(),
            64,
        )
        .await
    }

    async fn handle(&self, delivery: Delivery) {
        let dispatcher = &self.dispatcher;
        let source = self.source();
        match self.queue {
            Queue::Events => match &self.lanes {
                Some(lanes) => lanes.send(dispatcher, delivery, &source).await,
                None => {
                    let decoded = decode::<Event>(&delivery.data);
                    let disposition = handle_event(dispatcher, decoded).await;
                    dispatcher.settle(&delivery, disposition, &source).await;
                }
            },
            Queue::Submissions => {
                let (disposition, reply) = handle_submission(dispatcher, &delivery).await;
                dispatcher.settle(&delivery, disposition, &source).await;
                if let Some((reply_to, body)) = reply {
                    let payload = serde_json::to_vec(&body).unwrap_or_default();
                    let replied = dispatcher.publisher.publish("", &reply_to, &payload, None);
                    if let Err(error) = replied.await {
                        warn!(%error, "cannot reply to the submitter");
                    }
                }
            }
            Queue::DeadLetters => {
                let disposition = handle_dead_letter(dispatcher, &delivery).await;
                dispatcher.settle(&delivery, disposition, &source).await;
            }
            Queue::Executions => {
                // A question is answered or dropped, never retried: its worker asks again.
                dispatcher
                    .settle(&delivery, Disposition::Ack, &source)
                    .await;
                answer_question(dispatcher, &delivery).await;
            }
            Queue::Allotments => {
                // Answered or dropped, like a question: the gateway asks again.
                dispatcher
                    .settle(&delivery, Disposition::Ack, &source)
                    .await;
                crate::allotments::answer_allotment(dispatcher, &delivery).await;
            }
            Queue::Roster => {
                dispatcher
                    .settle(&delivery, Disposition::Ack, &source)
                    .await;
                crate::roster::take_beacon(&dispatcher.roster, &dispatcher.job_key, &delivery);
            }
        }
    }

    fn connected(&self, again: bool) {
        if again {
            self.dispatcher.metrics.broker_reconnected(self.name());
        }
        if self.queue == Queue::Events {
            self.dispatcher.broker_ready.store(true, Ordering::SeqCst);
            self.dispatcher.metrics.set_broker_connected(true);
        }
    }

    fn disconnected(&self) {
        if self.queue == Queue::Events {
            self.dispatcher.broker_ready.store(false, Ordering::SeqCst);
            self.dispatcher.metrics.set_broker_connected(false);
        }
    }
}

/// Consumes `queue` until shutdown, reconnecting after a lost connection.
pub async fn consume(dispatcher: Arc<Dispatcher>, queue: Queue, shutdown: CancellationToken) {
    let mut consumer = Consumer {
        dispatcher,
        queue,
        lanes: None,
    };
    if queue == Queue::Events {
        consumer.lanes = Some(Lanes::start(&consumer.dispatcher, &consumer.source()));
    }
    let session = amqp::consume(&consumer, &shutdown).await;
    // What the lanes hold is stored and settled on the session before it closes.
    if let Some(lanes) = consumer.lanes {
        lanes.finish().await;
    }
    if let Some(session) = session {
        session.close().await;
    }
}

impl Dispatcher {
    /// Settles a delivery taken from `source` as its handler decided, counting dead letters.
    async fn settle(&self, delivery: &Delivery, disposition: Disposition, source: &str) {
        if matches!(disposition, Disposition::DeadLetter(_)) {
            self.metrics.dead_lettered(source);
        }
        let dead_letters = DeadLetters {
            publisher: &self.publisher,
            topology: &self.topology,
            source,
        };
        if let Err(error) = amqp::settle(delivery, disposition, dead_letters).await {
            warn!(%error, source, "cannot settle a delivery; the broker offers it again");
        }
    }
}

/// The largest message the dispatcher reads from a queue.
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Decodes a message, refusing oversized ones and a missing or unknown `schema_version` first.
pub fn decode<T: serde::de::DeserializeOwned>(data: &[u8]) -> Result<T, String> {
    proto::decode_message(data, MAX_MESSAGE_BYTES)
}

/// Stores an event before it is acknowledged; an event of an unknown run is dead-lettered.
async fn handle_event(dispatcher: &Dispatcher, decoded: Result<Event, String>) -> Disposition {
    let event = match decoded {
        Ok(event) => event,
        Err(reason) => return Disposition::DeadLetter(format!("not a valid event: {reason}")),
    };
    let span = info_span!("event", run_id = %event.run_id, kind = event.kind.name());
    async {
        let read = patiently(dispatcher, "read the run", || {
            dispatcher.job_of(event.run_id)
        });
        let job = match read.await {
            Some(Some(job)) => job,
            Some(None) => {
                return Disposition::DeadLetter(format!("event for unknown run {}", event.run_id))
            }
            None => return Disposition::Requeue,
        };
        let stored = patiently(dispatcher, "store the event", || {
            dispatcher.store_event_after(None, &job, &event)
        });
        match stored.await {
            Some(recorded) => {
                // A cancel the worker may not have heard (it reconnected, or took the job after
                // the cancel): tell it again.
                dispatcher
                    .cancel_again_if_asked(recorded.prior, &event)
                    .await;
                Disposition::Ack
            }
            None => Disposition::Requeue,
        }
    }
    .instrument(span)
    .await
}

/// How long the events consumer keeps retrying a store that fails before it hands the event
/// back (which counts towards the queue's delivery limit).
const STORE_PATIENCE: Duration = Duration::from_secs(300);

/// Runs a store operation until it succeeds, with back-off (0.2 s doubling up to 5 s), for up
/// to [`STORE_PATIENCE`] or until the dispatcher stops. An event is never dead-lettered because
/// the store failed over: the consumer waits for it, holding its delivery (a requeue would
/// count towards the delivery limit). `None` when it gave up.
async fn patiently<T, F, Fut>(dispatcher: &Dispatcher, what: &str, operation: F) -> Option<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let started = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(200);
    loop {
        match operation().await {
            Ok(value) => return Some(value),
            Err(error) if started.elapsed() < STORE_PATIENCE => {
                warn!(%error, "cannot {what} yet; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = dispatcher.stopping.cancelled() => return None,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
            Err(error) => {
                warn!(%error, "cannot {what}; handing the event back");
                return None;
            }
        }
    }
}

/// Answers a worker's question about an execution (signed, to the question's `reply_to`).
/// Nothing is answered when the store cannot say: the worker waits, then asks again later.
async fn answer_question(dispatcher: &Dispatcher, delivery: &Delivery) {
    let query = match proto::decode_message::<proto::ExecutionQuery>(&delivery.data, 64 * 1024) {
        Ok(query) => query,
        Err(reason) => return warn!(%reason, "ignoring a malformed execution question"),
    };
    let Some(reply_to) = delivery.properties.reply_to().as_ref() else {
        return warn!(run_id = %query.run_id, "ignoring an execution question with no reply_to");
    };
    let answer = match dispatcher.answer(&query).await {
        Ok(answer) => answer,
        Err(error) => {
            return warn!(%error, run_id = %query.run_id, "cannot answer an execution question yet")
        }
    };
    let payload = serde_json::to_vec(&answer).unwrap_or_default();
    let signature = proto::ExecutionAnswer::sign(&payload, &dispatcher.job_key);
    let headers = amqp::signature_headers(signature);
    let replied = dispatcher
        .publisher
        .publish("", reply_to.as_str(), &payload, Some(headers));
    if let Err(error) = replied.await {
        warn!(%error, run_id = %query.run_id, "cannot answer an execution question");
    }
}

/// A reply to a submitter: its queue and the body.
type Reply = (String, serde_json::Value);

/// Submits a run request from the submission queue; the reply (to `reply_to`, when the
/// message names one) is sent once the delivery is settled.
async fn handle_submission(
    dispatcher: &Dispatcher,
    delivery: &Delivery,
) -> (Disposition, Option<Reply>) {
    if delivery.data.len() > crate::freeze::MAX_REQUEST_BYTES {
        let reason = format!(
            "oversized message: {} bytes, over the request limit of {}",
            delivery.data.len(),
            crate::freeze::MAX_REQUEST_BYTES
        );
        return (Disposition::DeadLetter(reason), None);
    }
    let request = match decode::<RunRequest>(&delivery.data) {
        Ok(request) => request,
        Err(reason) => {
            let reason = format!("not a valid run request: {reason}");
            return (Disposition::DeadLetter(reason), None);
        }
    };
    let reply_to = delivery
        .properties
        .reply_to()
        .as_ref()
        .map(|r| r.to_string());
    // A message sent again with the same `message_id` within a day makes no second run.
    let key = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| format!("amqp:{id}"));
    let (disposition, body) = match dispatcher.submit_once(request, key.as_deref()).await {
        Ok(Submission::New(frozen)) => (
            Disposition::Ack,
            serde_json::json!({"run_id": frozen.job.run_id, "state": "queued", "warnings": frozen.warnings}),
        ),
        Ok(Submission::Repeat(first)) => (
            Disposition::Ack,
            serde_json::json!({"run_id": first, "repeated": true}),
        ),
        Err(SubmitFailure::Invalid(error)) => (
            Disposition::DeadLetter(format!("refused: {error}")),
            serde_json::json!({"error": {"code": error.code(), "message": error.to_string(), "field": error.field()}}),
        ),
        Err(SubmitFailure::Store(error)) => {
            warn!(%error, "cannot store a submission; it will be delivered again");
            return (Disposition::Requeue, None);
        }
    };
    (disposition, reply_to.map(|reply_to| (reply_to, body)))
}

/// A job taken off the jobs queue for good (refused by a worker, or given up on by the broker
/// after its delivery limit) fails its run, which would otherwise stay `queued` for ever. Other
/// dead letters are only kept in `{prefix}.dead` for operators.
async fn handle_dead_letter(dispatcher: &Dispatcher, delivery: &Delivery) -> Disposition {
    let (source, reason) = amqp::dead_letter_origin(&delivery.properties);
    let topology = &dispatcher.topology;
    let from_jobs =
        source.is_some_and(|queue| queue == topology.jobs() || queue == topology.jobs_wait());
    // Only a job this dispatcher signed may fail its run: a forged message naming a real run
    // (refused by a worker) must not end that run.
    let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
    let signed = dispatcher
        .job_key
        .verify(&delivery.data, signature.as_deref())
        .is_ok();
    let run_id = serde_json::from_slice::<serde_json::Value>(&delivery.data)
        .ok()
        .filter(|_| signed)
        .and_then(|message| Uuid::parse_str(message.get("run_id")?.as_str()?).ok());
    let (true, Some(run_id)) = (from_jobs, run_id) else {
        return Disposition::Ack;
    };
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
                Ok(_) => {
                    warn!(%run_id, %reason, "a dead-lettered job failed its run");
                    Disposition::Ack
                }
                Err(error) => {
                    warn!(%error, "cannot fail a dead-lettered run; it will be retried");
                    Disposition::Retry
                }
            }
        }
        Ok(_) => Disposition::Ack,
        Err(error) => {
            warn!(%error, "cannot read a dead-lettered run; it will be retried");
            Disposition::Retry
        }
    }
}
