//! Taking messages: headers, consumers that reconnect, and settling a delivery.
//!
//! The headers a message carries (`Carried`: `x-forgepool-lost`, `x-forgepool-holds` and the
//! others); `Consume` and `consume`, the one reconnecting consumer loop both services use;
//! `declare_with_retry`; and `settle`, the one function that carries out a handler's
//! `Disposition` (`Ack`, `Requeue`, `Retry`, `DeadLetter(reason)`). Every delivery of a
//! consumed work queue (jobs, events, submissions, dead letters) is settled here.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
pub use lapin::message::Delivery;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::brokers::connect;
use super::client::{header_text, Publisher};
use super::{AmqpError, Topology, DELIVERY_LIMIT, REASON_HEADER, SESSION_TIMEOUT, SOURCE_HEADER};

/// The headers that carry a job's signature.
pub fn signature_headers(signature: String) -> FieldTable {
    let mut headers = FieldTable::default();
    headers.insert(
        crate::SIGNATURE_HEADER.into(),
        AMQPValue::LongString(LongString::from(signature)),
    );
    headers
}

/// The header of a job's copy that counts how often its execution was lost: a worker died,
/// or lost the broker, while it held the job.
pub const LOST_HEADER: &str = "x-forgepool-lost";
/// The header of a parked copy of a lost job: how many more times it waits in the wait queue
/// (its TTL each time, kept by the broker's clock) before a worker may start it, so the worker
/// that held it can take its lease again if it still lives.
pub const HOLDS_HEADER: &str = "x-forgepool-holds";
/// The header of a copy of a job that may follow an earlier execution of its run (a copy
/// forgepool published again: a hand-over, a parked job, a run queued again). Only such a copy
/// reads the progress kept on the broker; a first copy has none to read.
pub const AGAIN_HEADER: &str = "x-forgepool-again";
/// The header of a copy whose run waits for a cap slot of one of its profiles (the role's
/// code: 1 implementer, 2 reviewer, 3 final reviewer): a worker takes the slot before it starts
/// the run, and puts the copy back to wait, silently, while every slot is taken.
pub const WAITS_HEADER: &str = "x-forgepool-waits-for";
/// The most waits a copy's header may ask for; more is taken as this (a forged header must
/// not hold a job back for long).
pub const MAX_HOLDS: u32 = 10;

/// What a copy of a job carries besides its body and signature (SPEC 11): how often its
/// execution was lost, and when a copy parked after such a loss may run. Forgepool makes a
/// fresh copy of a job to hand it over (a drain) or to park it, so that neither counts toward
/// the broker's delivery limit; these counts go with the copy instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Carried {
    /// How often a worker lost the job while holding it.
    pub lost: u32,
    /// How many more times the copy waits in the wait queue before it may run.
    pub holds: u32,
    /// The copy may follow an earlier execution of its run.
    pub again: bool,
    /// The code of the role whose profile's cap slot the run waits for; 0 for none.
    pub waits_for: u8,
}

impl Carried {
    /// The counts of a delivered copy; a missing or malformed header counts as none.
    pub fn of(properties: &BasicProperties) -> Carried {
        let number = |name| header_text(properties, name).and_then(|v| v.parse::<u64>().ok());
        Carried {
            lost: number(LOST_HEADER).map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX)),
            holds: number(HOLDS_HEADER).map_or(0, |n| n.min(u64::from(MAX_HOLDS)) as u32),
            again: number(AGAIN_HEADER).is_some_and(|n| n > 0),
            waits_for: number(WAITS_HEADER).map_or(0, |n| u8::try_from(n).unwrap_or(0)),
        }
    }

    /// The headers of a copy: the signature, and the counts that are not zero.
    pub fn headers(self, signature: Option<String>) -> Option<FieldTable> {
        let mut headers = signature.map(signature_headers).unwrap_or_default();
        let mut text = |name: &str, value: u64| {
            headers.insert(
                name.into(),
                AMQPValue::LongString(LongString::from(value.to_string())),
            );
        };
        if self.lost > 0 {
            text(LOST_HEADER, u64::from(self.lost));
        }
        if self.holds > 0 {
            text(HOLDS_HEADER, u64::from(self.holds));
        }
        if self.again {
            text(AGAIN_HEADER, 1);
        }
        if self.waits_for > 0 {
            text(WAITS_HEADER, u64::from(self.waits_for));
        }
        (!headers.inner().is_empty()).then_some(headers)
    }
}

/// Where a dead letter came from and why: our own headers for messages forgepool refused, the
/// broker's `x-first-death-*` headers for messages it gave up on (`delivery_limit`, `rejected`,
/// `expired`). Returns `(source queue, reason)`.
pub fn dead_letter_origin(properties: &BasicProperties) -> (Option<String>, String) {
    let header = |name: &str| -> Option<String> {
        match properties.headers().as_ref()?.inner().get(name)? {
            AMQPValue::LongString(value) => Some(value.to_string()),
            AMQPValue::ShortString(value) => Some(value.to_string()),
            _ => None,
        }
    };
    // The newest death comes first in `x-death`; `x-first-death-*` keeps the oldest one.
    let newest = |field: &str| -> Option<String> {
        let AMQPValue::FieldArray(deaths) =
            properties.headers().as_ref()?.inner().get("x-death")?
        else {
            return None;
        };
        let AMQPValue::FieldTable(death) = deaths.as_slice().first()? else {
            return None;
        };
        match death.inner().get(field)? {
            AMQPValue::LongString(value) => Some(value.to_string()),
            AMQPValue::ShortString(value) => Some(value.to_string()),
            _ => None,
        }
    };
    let source = header(SOURCE_HEADER)
        .or_else(|| newest("queue"))
        .or_else(|| header("x-first-death-queue"));
    let reason = header(REASON_HEADER)
        .or_else(|| {
            newest("reason")
                .or_else(|| header("x-first-death-reason"))
                .map(|reason| match reason.as_str() {
                "delivery_limit" => format!(
                    "the broker gave up after {DELIVERY_LIMIT} deliveries without an acknowledgement (delivery_limit)"
                ),
                other => format!("the broker dead-lettered it ({other})"),
            })
        })
        .unwrap_or_else(|| "dead-lettered for an unknown reason".into());
    (source, reason)
}

/// Like [`open_consumer`], on a queue of this connection's own (exclusive, server-named)
/// bound to the control exchange for every worker's beacon (`roster.*`), where a beacon
/// older than [`crate::roster::BEACON_TTL_MS`] expires: each dispatcher replica hears every
/// worker.
pub async fn open_roster_consumer(
    url: &str,
    name: &str,
    topology: &Topology,
) -> Result<Session, AmqpError> {
    open_session(url, name, topology, Source::Roster, 64).await
}

/// Opens a connection of its own, declares the topology, sets the prefetch and starts a
/// consumer on `queue`, all within [`SESSION_TIMEOUT`]: a broker that stops answering is
/// retried by the caller, never waited on. The consumer's tag is `name`.
pub async fn open_consumer(
    url: &str,
    name: &str,
    topology: &Topology,
    queue: &str,
    prefetch: u16,
) -> Result<Session, AmqpError> {
    open_session(url, name, topology, Source::Shared(queue), prefetch).await
}

/// Where a session consumes.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// A queue of the topology, by name.
    Shared(&'a str),
    /// The roster's queue of this connection's own.
    Roster,
}

async fn open_session(
    url: &str,
    name: &str,
    topology: &Topology,
    source: Source<'_>,
    prefetch: u16,
) -> Result<Session, AmqpError> {
    let broker = |operation| move |source| AmqpError::Broker { operation, source };
    let session = async {
        let connection = connect(url, name).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(broker("open channel"))?;
        topology.declare(&channel).await?;
        let queue = match source {
            Source::Shared(queue) => queue.into(),
            Source::Roster => roster_queue(&channel, topology).await?,
        };
        channel
            .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
            .await
            .map_err(broker("set prefetch"))?;
        let consumer = channel
            .basic_consume(
                queue,
                name.into(),
                lapin::options::BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker("start consumer"))?;
        Ok(Session {
            connection,
            channel,
            consumer,
            tag: name.to_string(),
        })
    };
    let what = match source {
        Source::Shared(queue) => queue,
        Source::Roster => "the roster",
    };
    tokio::time::timeout(SESSION_TIMEOUT, session)
        .await
        .map_err(|_| AmqpError::Pool(format!("no consumer on {what} within {SESSION_TIMEOUT:?}")))?
}

/// Declares this connection's roster queue and binds it to the beacons; its name.
async fn roster_queue(
    channel: &Channel,
    topology: &Topology,
) -> Result<lapin::types::ShortString, AmqpError> {
    let broker = |operation| move |source| AmqpError::Broker { operation, source };
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(crate::roster::BEACON_TTL_MS),
    );
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(10_000));
    let queue = channel
        .queue_declare("".into(), super::exclusive_queue(), arguments)
        .await
        .map_err(broker("declare roster queue"))?;
    channel
        .queue_bind(
            queue.name().clone(),
            topology.control().into(),
            "roster.*".into(),
            lapin::options::QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(broker("bind roster queue"))?;
    Ok(queue.name().clone())
}

/// A consuming connection: its channel, and the consumer on it.
pub struct Session {
    /// The connection, of this session alone.
    pub connection: Connection,
    /// The channel the consumer lives on; deliveries are settled on it.
    pub channel: Channel,
    /// The stream of deliveries.
    pub consumer: lapin::Consumer,
    /// The consumer's tag.
    pub tag: String,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl Session {
    /// Stops the consumer: no more deliveries arrive, and those held can still be settled.
    pub async fn stop_consuming(&self) {
        let _ = tokio::time::timeout(
            SETTLE_TIMEOUT,
            self.channel
                .basic_cancel(self.tag.as_str().into(), Default::default()),
        )
        .await;
    }

    /// Closes the channel and the connection with a goodbye, each within [`SETTLE_TIMEOUT`].
    pub async fn close(self) {
        let _ = tokio::time::timeout(SETTLE_TIMEOUT, self.channel.close(200, "bye".into())).await;
        let _ =
            tokio::time::timeout(SETTLE_TIMEOUT, self.connection.close(200, "bye".into())).await;
    }
}

/// A consumer that [`consume`] keeps connected.
pub trait Consume: Send + Sync {
    /// The consumer's name, for logs and the reconnection metric.
    fn name(&self) -> &str;

    /// Opens a session; `again` after a lost one.
    fn open(&self, again: bool) -> impl Future<Output = Result<Session, AmqpError>> + Send;

    /// Handles one delivery. Deliveries are handled one after the other; a handler that needs
    /// time spawns its work, and settles the delivery there.
    fn handle(&self, delivery: Delivery) -> impl Future<Output = ()> + Send;

    /// Called when a session is open; `again` after a lost one.
    fn connected(&self, _again: bool) {}

    /// Called when a session is lost or ends.
    fn disconnected(&self) {}

    /// Disposes of a session lost while running. The default closes it; a consumer whose
    /// deliveries outlive their handler (they settle on the session's channel later) lets the
    /// broker end it instead.
    fn retire(&self, session: Session) -> impl Future<Output = ()> + Send {
        session.close()
    }
}

/// Consumes until `shutdown`, opening a new session with back-off (0.2 s doubling up to 5 s)
/// after each loss. Returns the session open at shutdown, its consumer stopped, so that the
/// deliveries still held can be settled on it before the caller closes it.
pub async fn consume<C: Consume>(consumer: &C, shutdown: &CancellationToken) -> Option<Session> {
    let mut backoff = Duration::from_millis(200);
    let mut again = false;
    while !shutdown.is_cancelled() {
        let opened = tokio::select! {
            opened = consumer.open(again) => opened,
            () = shutdown.cancelled() => break,
        };
        let mut session = match opened {
            Ok(session) => session,
            Err(error) => {
                warn!(%error, consumer = consumer.name(), "cannot consume; retrying");
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {},
                    () = shutdown.cancelled() => break,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        consumer.connected(again);
        again = true;
        info!(consumer = consumer.name(), "consuming");
        loop {
            tokio::select! {
                next = session.consumer.next() => match next {
                    Some(Ok(delivery)) => consumer.handle(delivery).await,
                    Some(Err(error)) => {
                        warn!(%error, consumer = consumer.name(), "consumer failed; reconnecting");
                        break;
                    }
                    None => {
                        warn!(consumer = consumer.name(), "consumer closed; reconnecting");
                        break;
                    }
                },
                () = shutdown.cancelled() => break,
            }
        }
        consumer.disconnected();
        session.stop_consuming().await;
        if shutdown.is_cancelled() {
            return Some(session);
        }
        consumer.retire(session).await;
    }
    None
}

/// The longest wait between two attempts of [`declare_with_retry`].
pub const DECLARE_BACKOFF_CAP: Duration = Duration::from_secs(30);

/// Declares the topology, retrying a broker that refuses or does not answer for as long as it
/// takes (each attempt within [`SESSION_TIMEOUT`]; the waits between them double from 1 s up
/// to [`DECLARE_BACKOFF_CAP`]), so a service started before its broker waits for it instead of
/// exiting. Returns `false` when `shutdown` is cancelled first.
pub async fn declare_with_retry(
    publisher: &Publisher,
    topology: &Topology,
    shutdown: &CancellationToken,
) -> bool {
    let mut wait = Duration::from_secs(1);
    let mut attempts = 0u64;
    loop {
        let declare = async { topology.declare(&publisher.channel().await?).await };
        let result = tokio::select! {
            result = tokio::time::timeout(SESSION_TIMEOUT, declare) => result
                .unwrap_or_else(|_| Err(AmqpError::Pool("the broker did not answer in time".into()))),
            () = shutdown.cancelled() => return false,
        };
        match result {
            Ok(()) => {
                if attempts > 0 {
                    info!(attempts, "RabbitMQ is set up");
                }
                return true;
            }
            Err(error) => {
                attempts += 1;
                warn!(%error, attempts, retry_in_seconds = wait.as_secs(), "cannot set up RabbitMQ yet; retrying (FORGEPOOL_AMQP_URL)");
                tokio::select! {
                    () = tokio::time::sleep(wait) => {},
                    () = shutdown.cancelled() => return false,
                }
                wait = (wait * 2).min(DECLARE_BACKOFF_CAP);
            }
        }
    }
}

/// What a handler decided about a delivery; [`settle`] carries it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Done with: the broker forgets it.
    Ack,
    /// Handed back to the queue at once, to be taken again (by any consumer).
    Requeue,
    /// Handed back after [`RETRY_PAUSE`]: the handler could not do its work now (its store
    /// failed), and an immediate redelivery would fail the same way.
    Retry,
    /// Refused for good: kept in the dead-letter queue with this reason, then acknowledged (or
    /// rejected to the broker's own dead-lettering when it cannot be published).
    DeadLetter(String),
}

/// How long [`Disposition::Retry`] waits before handing a delivery back.
pub const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// Where dead letters of one queue go.
#[derive(Debug, Clone, Copy)]
pub struct DeadLetters<'a> {
    /// The publisher that sends them.
    pub publisher: &'a Publisher,
    /// The topology whose dead-letter exchange takes them.
    pub topology: &'a Topology,
    /// The queue the deliveries come from.
    pub source: &'a str,
}

/// Settles a delivery as its handler decided, each broker call within [`SETTLE_TIMEOUT`]. A
/// dead letter keeps the message's signature header, so that the dispatcher can tell a job it
/// signed from a forged one. The error says why the broker was not told (a closed channel: the
/// broker then offers the message again).
pub async fn settle(
    delivery: &Delivery,
    disposition: Disposition,
    dead_letters: DeadLetters<'_>,
) -> Result<(), String> {
    match disposition {
        Disposition::Ack => bounded(delivery.ack(lapin::options::BasicAckOptions::default())).await,
        Disposition::Requeue => requeue(delivery).await,
        Disposition::Retry => {
            tokio::time::sleep(RETRY_PAUSE).await;
            requeue(delivery).await
        }
        Disposition::DeadLetter(reason) => {
            warn!(%reason, source = dead_letters.source, "dead-lettering a message");
            let published = dead_letters
                .publisher
                .dead_letter(
                    dead_letters.topology,
                    dead_letters.source,
                    &delivery.data,
                    &reason,
                    Some(&delivery.properties),
                )
                .await;
            match published {
                Ok(()) => bounded(delivery.ack(lapin::options::BasicAckOptions::default())).await,
                Err(error) => {
                    warn!(%error, "cannot dead-letter; rejecting instead");
                    bounded(delivery.reject(lapin::options::BasicRejectOptions { requeue: false }))
                        .await
                }
            }
        }
    }
}

/// The limit on settling a delivery; a dead connection must not hang the task holding it.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Hands a delivery back to its queue within [`SETTLE_TIMEOUT`] (a message read and left in
/// place).
pub async fn requeue(delivery: &Delivery) -> Result<(), String> {
    bounded(delivery.nack(lapin::options::BasicNackOptions {
        requeue: true,
        ..Default::default()
    }))
    .await
}

/// Runs one settling call within [`SETTLE_TIMEOUT`]. The client answers `false` when it sent
/// nothing: the delivery was settled already, or its channel is gone (the broker then offers
/// the message again), so that is not a success either.
async fn bounded(operation: impl Future<Output = lapin::Result<bool>>) -> Result<(), String> {
    match tokio::time::timeout(SETTLE_TIMEOUT, operation).await {
        Ok(Ok(true)) => Ok(()),
        Ok(Ok(false)) => Err("the delivery was settled already, or its channel is closed".into()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!("no answer within {SETTLE_TIMEOUT:?}")),
    }
}

#[cfg(test)]
mod carried_tests {
    use super::*;

    /// Catches: counts that do not survive a copy (a hand-over or a parked job would reset the
    /// poison count), and a forged or malformed header that holds a job back for long.
    #[test]
    fn a_copy_carries_its_counts_and_ignores_nonsense() {
        let carried = Carried {
            lost: 3,
            holds: 4,
            again: true,
            waits_for: 2,
        };
        let headers = carried.headers(Some("sig".into())).expect("headers");
        let properties = BasicProperties::default().with_headers(headers);
        assert_eq!(Carried::of(&properties), carried);
        assert_eq!(
            header_text(&properties, crate::SIGNATURE_HEADER).as_deref(),
            Some("sig")
        );
        let mut forged = FieldTable::default();
        forged.insert(
            HOLDS_HEADER.into(),
            AMQPValue::LongString(LongString::from("1000000")),
        );
        let properties = BasicProperties::default().with_headers(forged);
        assert_eq!(Carried::of(&properties).holds, MAX_HOLDS, "bounded");
        assert_eq!(Carried::default().headers(None), None);
        let mut nonsense = FieldTable::default();
        nonsense.insert(
            LOST_HEADER.into(),
            AMQPValue::LongString(LongString::from("many")),
        );
        let properties = BasicProperties::default().with_headers(nonsense);
        assert_eq!(Carried::of(&properties), Carried::default());
    }
}
