//! The AMQP wing shared by both services: the wire contract (queue and exchange names, their
//! arguments, headers, TTLs and limits: this file and [`topology`]) and the client code that
//! speaks it ([`client`]: connections and a confirming publisher; [`delivery`]: consumers that
//! reconnect and one function that settles a delivery).
//!
//! The client lives here, beside the contract, because the dispatcher and the worker need the
//! very same connection, confirm and reconnect rules; it is compiled only with the `amqp`
//! feature, so the wire types stay free of lapin for every other user of `proto`. lapin
//! appears in no other module of forgepool's services.
//!
//! Both services declare the whole topology on start (declarations are idempotent), so either
//! may start first and no message is ever unroutable. Names share a prefix (`forgepool` by
//! default) so that several installations, or tests, can share one broker.

use std::time::Duration;

/// How often a message is delivered before the broker dead-letters it: a guard against a
/// message no consumer can settle. A worker that dies holding a job does not count toward it
/// (the next worker sends the job on as a fresh copy); [`crate::MAX_LOST_EXECUTIONS`] bounds
/// those.
pub const DELIVERY_LIMIT: i64 = 5;
/// How many times a job's execution may be lost before a worker takes the job for poison by
/// itself: a backstop at twice the store's limit ([`crate::MAX_LOST_EXECUTIONS`], which the
/// dispatcher applies when a worker asks whether the execution is live), for a dispatcher of
/// an earlier release that does not count. Independent of [`DELIVERY_LIMIT`].
pub const LOST_BACKSTOP: u32 = 2 * crate::MAX_LOST_EXECUTIONS;
/// How long a publish waits for the broker's confirm.
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// How long connecting may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The header that carries why a message was dead-lettered.
pub const REASON_HEADER: &str = "x-forgepool-reason";
/// The header that names the queue a dead-lettered message was taken from.
pub const SOURCE_HEADER: &str = "x-forgepool-source";
/// How long a job waits in the wait queue before it is offered again (its run is leased by a
/// live worker).
pub const WAIT_QUEUE_TTL_MS: i64 = 3_000;
/// How long a run's completion marker is kept: long enough for every copy of a finished job
/// that is still circulating (redelivered after a consumer timeout or a lost connection) to
/// come back and be settled, short enough that markers do not pile up on the broker.
pub const DONE_MARKER_TTL_MS: i64 = 3600 * 1000;

/// How long a worker's question to the dispatcher waits in its queue (and the worker for the
/// answer).
pub const QUESTION_TTL_MS: i64 = 10_000;

/// The limit on connecting, declaring the topology and starting a consumer.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(30);

/// The AMQP reply code of a broker refusal (404 not found, 405 locked, 406 precondition
/// failed), or `None` for any other failure.
pub fn refusal_code(error: &lapin::Error) -> Option<u16> {
    match error.kind() {
        lapin::ErrorKind::ProtocolError(refusal) => Some(refusal.get_id()),
        _ => None,
    }
}

/// A failed AMQP operation.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    /// The broker could not be reached.
    #[error("cannot connect to RabbitMQ at {url}: {detail}; start it (scripts/services.sh) or set FORGEPOOL_AMQP_URL")]
    Connect {
        /// The URL without credentials.
        url: String,
        /// The cause.
        detail: String,
    },
    /// A broker operation failed.
    #[error("RabbitMQ {operation} failed: {source}")]
    Broker {
        /// What was attempted.
        operation: &'static str,
        /// The cause.
        source: lapin::Error,
    },
    /// The broker did not confirm a publish in time.
    #[error("RabbitMQ did not confirm a publish to {target} within {CONFIRM_TIMEOUT:?}")]
    ConfirmTimeout {
        /// Exchange and routing key.
        target: String,
    },
    /// The broker refused a publish, or no queue was bound to take it.
    #[error("RabbitMQ refused a publish to {target}: {detail}")]
    Refused {
        /// Exchange and routing key.
        target: String,
        /// Nack or unroutable.
        detail: String,
    },
    /// A pooled connection could not be had.
    #[error("no RabbitMQ connection available: {0}")]
    Pool(String),
}

pub mod brokers;
pub mod client;
pub mod delivery;
pub mod topology;

pub use brokers::{
    broker_urls, connect, connection_properties, redact_url, with_frame_max, FRAME_MAX,
};
pub use client::{
    check_worker_heartbeat, connect_channel, exclusive_queue, header_text, open_channel,
    queue_exists, Publisher, PUBLISH_ATTEMPT_TIMEOUT,
};
pub use delivery::*;
pub use topology::Topology;
