//! The AMQP wire: queue and exchange names, their arguments, and a confirming publisher.
//!
//! Both services declare the whole topology on start (declarations are idempotent), so either
//! may start first and no message is ever unroutable. Names share a prefix (`forgepool` by
//! default) so that several installations, or tests, can share one broker.

use std::time::Duration;

use deadpool_lapin::lapin;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::Mutex;

/// How often a message is delivered before the broker dead-letters it (a job that keeps
/// killing its workers must not be retried forever).
pub const DELIVERY_LIMIT: i64 = 5;
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

    /// Jobs whose run is leased by a live worker wait here, then return to the jobs queue.
    pub fn jobs_wait(&self) -> String {
        format!("{}.jobs.wait", self.prefix)
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

    /// The control topic exchange (cancel requests): `{prefix}.control`.
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

    /// The queue whose existence says a run finished and its final events were confirmed.
    pub fn done(&self, run_id: &str) -> String {
        format!("{}.done.{run_id}", self.prefix)
    }

    /// The exclusive queue that says a worker instance is alive.
    pub fn presence(&self, instance: &str) -> String {
        format!("{}.presence.{instance}", self.prefix)
    }

    /// Declares every exchange and shared queue. Idempotent.
    pub async fn declare(&self, channel: &Channel) -> Result<(), AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .exchange_declare(
                &self.dead(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(broker("declare dead-letter exchange"))?;
        channel
            .exchange_declare(
                &self.events(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(broker("declare events exchange"))?;
        channel
            .exchange_declare(
                &self.submit(),
                ExchangeKind::Fanout,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(broker("declare submit exchange"))?;
        channel
            .exchange_declare(
                &self.control(),
                ExchangeKind::Topic,
                durable,
                FieldTable::default(),
            )
            .await
            .map_err(broker("declare control exchange"))?;

        let queue = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        for name in [self.dead(), self.dispatcher_dead()] {
            channel
                .queue_declare(&name, queue, quorum(None, None))
                .await
                .map_err(broker("declare dead-letter queue"))?;
            channel
                .queue_bind(
                    &name,
                    &self.dead(),
                    "",
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(broker("bind dead-letter queue"))?;
        }
        for name in [self.jobs(), self.submissions()] {
            channel
                .queue_declare(
                    &name,
                    queue,
                    quorum(Some(&self.dead()), Some(DELIVERY_LIMIT)),
                )
                .await
                .map_err(broker("declare work queue"))?;
        }
        channel
            .queue_bind(
                &self.submissions(),
                &self.submit(),
                "",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker("bind submission queue"))?;
        let mut wait = FieldTable::default();
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
        channel
            .queue_declare(&self.jobs_wait(), queue, wait)
            .await
            .map_err(broker("declare wait queue"))?;
        channel
            .queue_declare(
                &self.dispatcher_events(),
                queue,
                quorum(Some(&self.dead()), Some(DELIVERY_LIMIT)),
            )
            .await
            .map_err(broker("declare dispatcher events queue"))?;
        channel
            .queue_bind(
                &self.dispatcher_events(),
                &self.events(),
                "run.#",
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker("bind dispatcher events queue"))?;
        Ok(())
    }
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

/// Connection properties that run lapin on the current tokio runtime.
pub fn connection_properties(name: &str) -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(LongString::from(name.to_string()))
}

/// The largest AMQP frame forgepool asks for, unless the URL sets `frame_max` itself. The
/// client keeps two buffers of 32 frames per connection and fills them with zeros, so the
/// broker's default (128 KiB) costs 8 MiB of resident memory per connection; 8 KiB frames
/// cost 512 KiB. Messages of any size still pass: a body is split into frames.
pub const FRAME_MAX: u32 = 8192;

/// `url` with `frame_max=`[`FRAME_MAX`] added to its query, unless it has one.
pub fn with_frame_max(url: &str) -> String {
    if url.contains("frame_max=") {
        return url.to_string();
    }
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}frame_max={FRAME_MAX}")
}

/// Opens a connection within [`CONNECT_TIMEOUT`].
pub async fn connect(url: &str, name: &str) -> Result<Connection, AmqpError> {
    let failed = |detail: String| AmqpError::Connect {
        url: redact_url(url),
        detail,
    };
    match tokio::time::timeout(
        CONNECT_TIMEOUT,
        Connection::connect(&with_frame_max(url), connection_properties(name)),
    )
    .await
    {
        Ok(Ok(connection)) => Ok(connection),
        Ok(Err(error)) => Err(failed(error.to_string())),
        Err(_) => Err(failed(format!("no answer within {CONNECT_TIMEOUT:?}"))),
    }
}

/// A URL with its password hidden, for messages and logs.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            let user = credentials.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// A publisher with confirms on its own pooled connection. Every publish is persistent and
/// `mandatory`, and waits for the broker's confirm for at most [`CONFIRM_TIMEOUT`].
#[derive(Debug)]
pub struct Publisher {
    pool: deadpool_lapin::Pool,
    /// The confirm channel in use, with the pooled connection it lives on.
    channel: Mutex<Option<(deadpool_lapin::Object, Channel)>>,
}

/// The limit on one publish attempt as a whole: getting a connection and a channel, sending,
/// and the confirm. A connection that died without saying so (a broker restart) must not
/// hold a publish for ever.
pub const PUBLISH_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);

impl Publisher {
    /// A publisher connecting to `url` (lazily, and again after a lost connection).
    pub fn new(url: &str, name: &str) -> Result<Publisher, AmqpError> {
        let manager =
            deadpool_lapin::Manager::new(with_frame_max(url), connection_properties(name));
        let pool = deadpool_lapin::Pool::builder(manager)
            .max_size(2)
            .runtime(deadpool_lapin::Runtime::Tokio1)
            .build()
            .map_err(|e| AmqpError::Pool(e.to_string()))?;
        Ok(Publisher {
            pool,
            channel: Mutex::new(None),
        })
    }

    /// A channel in confirm mode, reusing the last one while it is healthy.
    pub async fn channel(&self) -> Result<Channel, AmqpError> {
        let mut slot = self.channel.lock().await;
        if let Some((_, channel)) = slot.as_ref() {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        // The old connection is not given back to the pool: it failed us once.
        if let Some((object, _)) = slot.take() {
            drop(deadpool_lapin::Object::take(object));
        }
        let connection = tokio::time::timeout(CONNECT_TIMEOUT, self.pool.get())
            .await
            .map_err(|_| AmqpError::Pool(format!("no connection within {CONNECT_TIMEOUT:?}")))?
            .map_err(|e| AmqpError::Pool(e.to_string()))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|source| AmqpError::Broker {
                operation: "open channel",
                source,
            })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|source| AmqpError::Broker {
                operation: "enable confirms",
                source,
            })?;
        *slot = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// Closes the publisher's connections with a goodbye to the broker, within
    /// [`CONFIRM_TIMEOUT`]: a stopping service ends them cleanly instead of leaving them to be
    /// dropped with the runtime. Publishing afterwards opens a new connection.
    pub async fn close(&self) {
        let work = async {
            if let Some((object, channel)) = self.channel.lock().await.take() {
                let _ = channel.close(200, "bye").await;
                let _ = deadpool_lapin::Object::take(object).close(200, "bye").await;
            }
            // The idle pooled connections, taken out of the pool so none is made anew.
            for _ in 0..self.pool.status().available {
                let Ok(object) = self.pool.get().await else {
                    break;
                };
                let _ = deadpool_lapin::Object::take(object).close(200, "bye").await;
            }
        };
        let _ = tokio::time::timeout(CONFIRM_TIMEOUT, work).await;
    }

    /// Forgets the channel in use and its connection, so the next publish starts afresh.
    async fn forget_channel(&self) {
        if let Some((object, _)) = self.channel.lock().await.take() {
            drop(deadpool_lapin::Object::take(object));
        }
    }

    /// The number of ready messages in each queue, read with passive declares on a channel of
    /// its own (a missing queue closes only that channel), within [`SESSION_TIMEOUT`].
    pub async fn queue_depths(&self, names: &[String]) -> Result<Vec<(String, u32)>, AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let work = async {
            let connection = self
                .pool
                .get()
                .await
                .map_err(|e| AmqpError::Pool(e.to_string()))?;
            let channel = connection
                .create_channel()
                .await
                .map_err(broker("open channel"))?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let mut depths = Vec::with_capacity(names.len());
            for name in names {
                let queue = channel
                    .queue_declare(name, passive, FieldTable::default())
                    .await
                    .map_err(broker("read queue depth"))?;
                depths.push((name.clone(), queue.message_count()));
            }
            let _ = channel.close(200, "done").await;
            Ok(depths)
        };
        tokio::time::timeout(SESSION_TIMEOUT, work)
            .await
            .map_err(|_| AmqpError::Pool(format!("no queue depths within {SESSION_TIMEOUT:?}")))?
    }

    /// Publishes once and waits for the confirm. `headers` are added to the message.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        headers: Option<FieldTable>,
    ) -> Result<(), AmqpError> {
        let attempt = self.publish_once(exchange, routing_key, payload, headers);
        let outcome = match tokio::time::timeout(PUBLISH_ATTEMPT_TIMEOUT, attempt).await {
            Ok(outcome) => outcome,
            Err(_) => Err(AmqpError::ConfirmTimeout {
                target: format!("{exchange}/{routing_key}"),
            }),
        };
        if let Err(error) = &outcome {
            // A refusal (nack, unroutable) says nothing about the connection.
            if !matches!(error, AmqpError::Refused { .. }) {
                self.forget_channel().await;
            }
        }
        outcome
    }

    async fn publish_once(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        headers: Option<FieldTable>,
    ) -> Result<(), AmqpError> {
        let target = format!("{exchange}/{routing_key}");
        let channel = self.channel().await?;
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_content_type(ShortString::from("application/json"));
        if let Some(headers) = headers {
            properties = properties.with_headers(headers);
        }
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let confirm = channel
            .basic_publish(exchange, routing_key, options, payload, properties)
            .await
            .map_err(|source| AmqpError::Broker {
                operation: "publish",
                source,
            })?;
        let confirmation = tokio::time::timeout(CONFIRM_TIMEOUT, confirm)
            .await
            .map_err(|_| AmqpError::ConfirmTimeout {
                target: target.clone(),
            })?
            .map_err(|source| AmqpError::Broker {
                operation: "confirm",
                source,
            })?;
        if confirmation.is_nack() {
            return Err(AmqpError::Refused {
                target,
                detail: "the broker nacked it".into(),
            });
        }
        if let Some(returned) = confirmation.take_message() {
            return Err(AmqpError::Refused {
                target,
                detail: format!("unroutable ({})", returned.reply_text),
            });
        }
        Ok(())
    }

    /// Publishes, retrying with backoff (0.1 s up to 5 s) until `deadline` passes. Use it for
    /// messages that must not be lost across a broker restart.
    pub async fn publish_reliably(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        headers: Option<FieldTable>,
        deadline: Duration,
    ) -> Result<(), AmqpError> {
        let started = std::time::Instant::now();
        let mut backoff = Duration::from_millis(100);
        loop {
            match self
                .publish(exchange, routing_key, payload, headers.clone())
                .await
            {
                Ok(()) => return Ok(()),
                Err(error) if started.elapsed() + backoff < deadline => {
                    tracing::warn!(%error, "publish failed; retrying");
                    *self.channel.lock().await = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(error) => return Err(error),
            }
        }
    }

    /// Publishes a message taken from `source` (a queue name) to the dead-letter exchange,
    /// with the reason and the source in headers.
    /// A job's signature travels along, so that the dispatcher can tell a job it signed from
    /// a forged one.
    pub async fn dead_letter(
        &self,
        topology: &Topology,
        source: &str,
        payload: &[u8],
        reason: &str,
        original: Option<&BasicProperties>,
    ) -> Result<(), AmqpError> {
        let mut headers = FieldTable::default();
        if let Some(signature) = original.and_then(|p| header_text(p, crate::SIGNATURE_HEADER)) {
            headers.insert(
                crate::SIGNATURE_HEADER.into(),
                AMQPValue::LongString(LongString::from(signature)),
            );
        }
        headers.insert(
            REASON_HEADER.into(),
            AMQPValue::LongString(LongString::from(reason.to_string())),
        );
        headers.insert(
            SOURCE_HEADER.into(),
            AMQPValue::LongString(LongString::from(source.to_string())),
        );
        self.publish(&topology.dead(), "", payload, Some(headers))
            .await
    }
}

/// The headers that carry a job's signature.
pub fn signature_headers(signature: String) -> FieldTable {
    let mut headers = FieldTable::default();
    headers.insert(
        crate::SIGNATURE_HEADER.into(),
        AMQPValue::LongString(LongString::from(signature)),
    );
    headers
}

/// A text header of a message, if it has one.
pub fn header_text(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(value) => Some(value.to_string()),
        AMQPValue::ShortString(value) => Some(value.to_string()),
        _ => None,
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

/// The limit on connecting, declaring the topology and starting a consumer.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(30);

/// Opens a connection of its own, declares the topology, sets the prefetch and starts a
/// consumer on `queue`, all within [`SESSION_TIMEOUT`]: a broker that stops answering is
/// retried by the caller, never waited on.
pub async fn open_consumer(
    url: &str,
    name: &str,
    topology: &Topology,
    queue: &str,
    prefetch: u16,
) -> Result<(Connection, Channel, lapin::Consumer), AmqpError> {
    let session = async {
        let connection = connect(url, name).await?;
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let channel = connection
            .create_channel()
            .await
            .map_err(broker("open channel"))?;
        topology.declare(&channel).await?;
        channel
            .basic_qos(prefetch, lapin::options::BasicQosOptions::default())
            .await
            .map_err(broker("set prefetch"))?;
        let consumer = channel
            .basic_consume(
                queue,
                name,
                lapin::options::BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(broker("start consumer"))?;
        Ok((connection, channel, consumer))
    };
    tokio::time::timeout(SESSION_TIMEOUT, session)
        .await
        .map_err(|_| {
            AmqpError::Pool(format!("no consumer on {queue} within {SESSION_TIMEOUT:?}"))
        })?
}

/// The limit on settling a delivery; a dead connection must not hang the task holding it.
pub const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Acknowledges a delivery within [`SETTLE_TIMEOUT`].
pub async fn ack(delivery: &lapin::message::Delivery) -> Result<(), String> {
    settle(delivery.ack(lapin::options::BasicAckOptions::default())).await
}

/// Hands a delivery back to the queue within [`SETTLE_TIMEOUT`].
pub async fn requeue(delivery: &lapin::message::Delivery) -> Result<(), String> {
    settle(delivery.nack(lapin::options::BasicNackOptions {
        requeue: true,
        ..Default::default()
    }))
    .await
}

/// Rejects a delivery without requeue (the broker dead-letters it) within [`SETTLE_TIMEOUT`].
pub async fn reject(delivery: &lapin::message::Delivery) -> Result<(), String> {
    settle(delivery.reject(lapin::options::BasicRejectOptions { requeue: false })).await
}

async fn settle(
    operation: impl std::future::Future<Output = lapin::Result<()>>,
) -> Result<(), String> {
    match tokio::time::timeout(SETTLE_TIMEOUT, operation).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!("no answer within {SETTLE_TIMEOUT:?}")),
    }
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

    #[test]
    fn urls_lose_their_password() {
        assert_eq!(
            redact_url("amqp://guest:secret@host:5672/%2f"),
            "amqp://guest:***@host:5672/%2f"
        );
        assert_eq!(redact_url("amqp://host"), "amqp://host");
    }

    #[test]
    fn urls_ask_for_small_frames_unless_they_say_otherwise() {
        assert_eq!(
            with_frame_max("amqp://h:5672/%2f"),
            "amqp://h:5672/%2f?frame_max=8192"
        );
        assert_eq!(
            with_frame_max("amqp://h/%2f?heartbeat=30"),
            "amqp://h/%2f?heartbeat=30&frame_max=8192"
        );
        assert_eq!(
            with_frame_max("amqp://h/%2f?frame_max=65536"),
            "amqp://h/%2f?frame_max=65536"
        );
    }
}
