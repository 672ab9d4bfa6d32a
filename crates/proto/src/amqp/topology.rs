//! The names of forgepool's queues and exchanges, their arguments, and their declaration.
//!
//! `Topology` holds every queue and exchange name with its arguments, as tables. Both services
//! declare it whole at start; declarations are idempotent.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};

use super::{AmqpError, DELIVERY_LIMIT, WAIT_QUEUE_TTL_MS};

/// The names of forgepool's queues and exchanges under one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    prefix: String,
}

impl Topology {
    /// The topology under `prefix` (`forgepool` by default).
    pub fn new(prefix: impl Into<String>) -> Topology {
        Topology {
            prefix: prefix.into(),
        }
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Run requests from external producers: `{prefix}.submissions`.
    pub fn submissions(&self) -> String {
        format!("{}.submissions", self.prefix)
    }

    /// The exchange external producers publish run requests to: `{prefix}.submit`, a fanout
    /// bound to the submission queue only. A broker user allowed to write to this exchange and
    /// nothing else can submit runs and cannot reach the jobs queue (publishing to a queue by
    /// name goes through the default exchange, whose write permission covers every queue).
    pub fn submit(&self) -> String {
        format!("{}.submit", self.prefix)
    }

    /// Frozen jobs for workers: `{prefix}.jobs`.
    pub fn jobs(&self) -> String {
        format!("{}.jobs", self.prefix)
    }

    /// Jobs whose run is leased by a live worker wait here, then return to the jobs queue:
    /// `{prefix}.jobs.waiting`, a quorum queue (releases before 2026-12-06 had a classic
    /// `{prefix}.jobs.wait`, homed on one node; it empties itself into the jobs queue within
    /// seconds and may be deleted).
    pub fn jobs_wait(&self) -> String {
        format!("{}.jobs.waiting", self.prefix)
    }

    /// Dead letters: `{prefix}.dead`, a queue behind the fanout exchange of the same name.
    pub fn dead(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// The events topic exchange: `{prefix}.events`.
    pub fn events(&self) -> String {
        format!("{}.events", self.prefix)
    }

    /// The dispatcher's copy of every dead letter (bound to the dead-letter exchange), so a job
    /// the broker gave up on fails its run instead of staying queued: `{prefix}.dispatcher.dead`.
    pub fn dispatcher_dead(&self) -> String {
        format!("{}.dispatcher.dead", self.prefix)
    }

    /// The shared queues whose depth `forge_queue_depth` reports.
    pub fn watched_queues(&self) -> Vec<String> {
        vec![
            self.jobs(),
            self.jobs_wait(),
            self.submissions(),
            self.dead(),
        ]
    }

    /// The dispatcher's durable queue of every event.
    pub fn dispatcher_events(&self) -> String {
        format!("{}.dispatcher.events", self.prefix)
    }

    /// The control topic exchange (cancel requests `cancel.{run}`, profile pauses
    /// `pause.{profile}`): `{prefix}.control`.
    pub fn control(&self) -> String {
        format!("{}.control", self.prefix)
    }

    /// The exclusive queue that leases a run to the worker holding it.
    pub fn lease(&self, run_id: &str) -> String {
        format!("{}.lease.{run_id}", self.prefix)
    }

    /// The final review's intent for a run: a queue holding the tree under review.
    pub fn review_intent(&self, run_id: &str) -> String {
        format!("{}.review.intent.{run_id}", self.prefix)
    }

    /// The final review's receipt for a run: a queue holding the validated report.
    pub fn review_receipt(&self, run_id: &str) -> String {
        format!("{}.review.receipt.{run_id}", self.prefix)
    }

    /// A running run's progress: a queue holding its latest checkpoint.
    pub fn progress(&self, run_id: &str) -> String {
        format!("{}.progress.{run_id}", self.prefix)
    }

    /// The queue whose existence says a run finished and its final events were confirmed.
    pub fn done(&self, run_id: &str) -> String {
        format!("{}.done.{run_id}", self.prefix)
    }

    /// The exclusive queue that holds cap slot `slot` of an agent profile (`max_concurrent`).
    pub fn cap(&self, profile: &str, slot: u32) -> String {
        format!("{}.cap.{profile}.{slot}", self.prefix)
    }

    /// The stream of profile pauses (`pause.json`) every worker reads: `{prefix}.pauses`.
    pub fn pauses(&self) -> String {
        format!("{}.pauses", self.prefix)
    }

    /// Workers' questions to the dispatcher: is this execution of a run still live
    /// (`crate::ExecutionQuery`)? `{prefix}.execution-questions`, a quorum queue, answered
    /// through direct reply-to (the classic `{prefix}.executions` of earlier releases may be
    /// deleted).
    pub fn executions(&self) -> String {
        format!("{}.execution-questions", self.prefix)
    }

    /// Where gateways ask the dispatcher for a share of a profile's daily budget
    /// (`crate::allotment::AllotmentQuery`), answered through direct reply-to.
    pub fn allotments(&self) -> String {
        format!("{}.allotments", self.prefix)
    }

    /// The routing key a worker instance's beacon (`crate::roster::WorkerBeacon`) goes out
    /// with on the control exchange; each dispatcher binds a queue of its own to `roster.*`.
    pub fn roster_key(&self, instance: &str) -> String {
        format!("roster.{instance}")
    }

    /// The exclusive queue that says a worker instance is alive.
    pub fn presence(&self, instance: &str) -> String {
        format!("{}.presence.{instance}", self.prefix)
    }

    /// Declares every exchange and shared queue, and binds them. Idempotent.
    pub async fn declare(&self, channel: &Channel) -> Result<(), AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let exchanges = [
            (self.dead(), ExchangeKind::Fanout),
            (self.events(), ExchangeKind::Topic),
            (self.submit(), ExchangeKind::Fanout),
            (self.control(), ExchangeKind::Topic),
        ];
        for (name, kind) in exchanges {
            channel
                .exchange_declare(name.into(), kind, durable, FieldTable::default())
                .await
                .map_err(broker("declare exchange"))?;
        }
        let queue = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let work = || quorum(Some(&self.dead()), Some(DELIVERY_LIMIT));
        let queues = [
            (self.dead(), quorum(None, None)),
            (self.dispatcher_dead(), quorum(None, None)),
            (self.jobs(), work()),
            (self.submissions(), work()),
            (self.jobs_wait(), self.wait_arguments()),
            (self.dispatcher_events(), work()),
            (self.pauses(), pause_stream()),
            (self.executions(), questions()),
            (self.allotments(), questions()),
        ];
        for (name, arguments) in queues {
            channel
                .queue_declare(name.into(), queue, arguments)
                .await
                .map_err(broker("declare queue"))?;
        }
        // (queue, exchange, routing key)
        let bindings = [
            (self.dead(), self.dead(), ""),
            (self.dispatcher_dead(), self.dead(), ""),
            (self.submissions(), self.submit(), ""),
            (self.dispatcher_events(), self.events(), "run.#"),
            (self.pauses(), self.control(), "pause.*"),
        ];
        for (queue, exchange, key) in bindings {
            channel
                .queue_bind(
                    queue.into(),
                    exchange.into(),
                    key.into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(broker("bind queue"))?;
        }
        Ok(())
    }

    /// The wait queue holds a job for [`WAIT_QUEUE_TTL_MS`], then dead-letters it back to the
    /// jobs queue through the default exchange. A quorum queue, so it outlives any one node,
    /// with at-least-once dead-lettering (the broker re-publishes with confirms: a job is
    /// never dropped on its way back), which needs `reject-publish` overflow.
    fn wait_arguments(&self) -> FieldTable {
        let mut wait = quorum(None, None);
        wait.insert(
            "x-dead-letter-strategy".into(),
            AMQPValue::LongString(LongString::from("at-least-once")),
        );
        wait.insert(
            "x-overflow".into(),
            AMQPValue::LongString(LongString::from("reject-publish")),
        );
        wait.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(WAIT_QUEUE_TTL_MS),
        );
        wait.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from("")),
        );
        wait.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(self.jobs())),
        );
        wait
    }
}

/// The pause stream's arguments: a stream (every worker reads it whole, from the start of its
/// retention), kept two days (a pause lasts at most one), in small segments.
fn pause_stream() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("stream")),
    );
    arguments.insert(
        "x-max-age".into(),
        AMQPValue::LongString(LongString::from("2D")),
    );
    arguments.insert(
        "x-stream-max-segment-size-bytes".into(),
        AMQPValue::LongLongInt(1_000_000),
    );
    arguments
}

/// The questions queue's arguments: a quorum queue (it outlives any one node), where a
/// question unanswered for [`super::QUESTION_TTL_MS`] is dropped (its worker stopped waiting
/// and asks again later).
fn questions() -> FieldTable {
    let mut arguments = quorum(None, None);
    arguments.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(super::QUESTION_TTL_MS),
    );
    arguments
}

/// Quorum-queue arguments with an optional dead-letter exchange and delivery limit.
fn quorum(dead_letter_exchange: Option<&str>, delivery_limit: Option<i64>) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    if let Some(exchange) = dead_letter_exchange {
        arguments.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString(LongString::from(exchange)),
        );
    }
    if let Some(limit) = delivery_limit {
        arguments.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
    }
    arguments
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_spec_11() {
        let topology = Topology::new("forgepool");
        assert_eq!(topology.submissions(), "forgepool.submissions");
        assert_eq!(topology.jobs(), "forgepool.jobs");
        assert_eq!(topology.dead(), "forgepool.dead");
        assert_eq!(topology.events(), "forgepool.events");
        assert_eq!(Topology::new("t1").jobs(), "t1.jobs");
    }
}
