//! Connections and the confirming publisher.
//!
//! `Publisher` has a connection of its own (opened again through `brokers::connect` when lost)
//! and a channel in confirm mode: publishes are persistent and `mandatory`, with a confirm
//! timeout. `publish_reliably` retries through a broker restart, `publish_optional` is for
//! cancels (not `mandatory`), and `dead_letter` sends a message on with its reason and
//! signature.
//! `queue_depths` reads queue depths with passive declares, for the gauges.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use tokio::sync::Mutex;

use super::brokers::{broker_urls, connect};
use super::{
    refusal_code, AmqpError, Topology, CONFIRM_TIMEOUT, REASON_HEADER, SESSION_TIMEOUT,
    SOURCE_HEADER,
};

/// The shortest AMQP heartbeat a worker may use. A worker cut off from the broker stops its
/// runs within about 40 s (one sweep, one bounded broker call, the claim grace); another
/// worker may take them once the broker has dropped the cut-off connection (one heartbeat
/// timeout) and a 10 s grace have passed. A shorter heartbeat would let two executions of a
/// run overlap (SPEC 11).
pub const MIN_WORKER_HEARTBEAT_SECONDS: u64 = 60;

/// Refuses a worker's broker URL whose `heartbeat` is shorter than
/// [`MIN_WORKER_HEARTBEAT_SECONDS`]; `heartbeat=0` (none) is allowed: the broker then keeps a
/// dead worker's jobs until TCP gives up on it, which is slow but safe.
pub fn check_worker_heartbeat(url: &str) -> Result<(), String> {
    for url in broker_urls(url) {
        check_heartbeat(&url)?;
    }
    Ok(())
}

fn check_heartbeat(url: &str) -> Result<(), String> {
    let Some((_, query)) = url.split_once('?') else {
        return Ok(());
    };
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("heartbeat=") {
            let seconds: u64 = value.parse().map_err(|_| {
                format!("FORGEPOOL_AMQP_URL: heartbeat=`{value}` is not a number of seconds")
            })?;
            if seconds > 0 && seconds < MIN_WORKER_HEARTBEAT_SECONDS {
                return Err(format!(
                    "FORGEPOOL_AMQP_URL: heartbeat={seconds} is too short for a worker: use at least \
                     {MIN_WORKER_HEARTBEAT_SECONDS} s (the default), or a worker cut off from the \
                     broker could still run a job another worker has taken"
                ));
            }
        }
    }
    Ok(())
}

/// Opens a connection of its own (see [`connect`]) and a channel on it.
pub async fn connect_channel(url: &str, name: &str) -> Result<(Connection, Channel), AmqpError> {
    let connection = connect(url, name).await?;
    let channel = open_channel(&connection).await?;
    Ok((connection, channel))
}

/// Opens a channel on `connection`.
pub async fn open_channel(connection: &Connection) -> Result<Channel, AmqpError> {
    connection
        .create_channel()
        .await
        .map_err(|source| AmqpError::Broker {
            operation: "open channel",
            source,
        })
}

/// The options of a queue that lives and dies with its connection (presence, a control
/// queue).
pub fn exclusive_queue() -> QueueDeclareOptions {
    QueueDeclareOptions {
        exclusive: true,
        auto_delete: true,
        ..Default::default()
    }
}

/// Whether `queue` exists, by a passive declare on `channel`, which is closed afterwards (a
/// missing queue closes it anyway). Another connection's exclusive queue exists (it answers
/// "locked").
pub async fn queue_exists(channel: Channel, queue: &str) -> Result<bool, AmqpError> {
    let passive = QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    match channel
        .queue_declare(queue.into(), passive, FieldTable::default())
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "checked".into()).await;
            Ok(true)
        }
        Err(error) if refusal_code(&error) == Some(404) => Ok(false),
        Err(error) if refusal_code(&error) == Some(405) => Ok(true),
        Err(source) => Err(AmqpError::Broker {
            operation: "check queue",
            source,
        }),
    }
}

/// A publisher with confirms on a connection of its own (to a node of the broker list,
/// opened lazily and again after a lost one). Every publish is persistent and `mandatory`,
/// and waits for the broker's confirm for at most [`CONFIRM_TIMEOUT`].
pub struct Publisher {
    url: String,
    name: String,
    /// The confirm channel in use, with the connection it lives on.
    channel: Mutex<Option<(Connection, Channel)>>,
    /// The connection queue statistics are read on, apart from publishing.
    stats: Mutex<Option<Connection>>,
}

impl std::fmt::Debug for Publisher {
    /// The broker URL without its password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("url", &super::brokers::redact_url(&self.url))
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The limit on one publish attempt as a whole: getting a connection and a channel, sending,
/// and the confirm. A connection that died without saying so (a broker restart) must not
/// hold a publish for ever.
pub const PUBLISH_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);

impl Publisher {
    /// A publisher connecting to `url` (one node, or a list: see [`broker_urls`]) when it is
    /// first used, and again after a lost connection.
    pub fn new(url: &str, name: &str) -> Result<Publisher, AmqpError> {
        Ok(Publisher {
            url: url.to_string(),
            name: name.to_string(),
            channel: Mutex::new(None),
            stats: Mutex::new(None),
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
        // The old connection is not used again: it failed us once.
        if let Some((connection, _)) = slot.take() {
            close_quietly(connection);
        }
        let connection = connect(&self.url, &self.name).await?;
        let channel = open_channel(&connection).await?;
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
            if let Some((connection, channel)) = self.channel.lock().await.take() {
                let _ = channel.close(200, "bye".into()).await;
                let _ = connection.close(200, "bye".into()).await;
            }
            if let Some(connection) = self.stats.lock().await.take() {
                let _ = connection.close(200, "bye".into()).await;
            }
        };
        let _ = tokio::time::timeout(CONFIRM_TIMEOUT, work).await;
    }

    /// Forgets the channel in use and its connection, so the next publish starts afresh.
    async fn forget_channel(&self) {
        if let Some((connection, _)) = self.channel.lock().await.take() {
            close_quietly(connection);
        }
    }

    /// The number of ready messages in each queue, read with passive declares on a channel of
    /// its own (a missing queue closes only that channel), within [`SESSION_TIMEOUT`].
    pub async fn queue_depths(&self, names: &[String]) -> Result<Vec<(String, u32)>, AmqpError> {
        let stats = self.queue_stats(names).await?;
        Ok(stats
            .into_iter()
            .map(|(name, ready, _)| (name, ready))
            .collect())
    }

    /// Like [`Publisher::queue_depths`], with each queue's number of consumers:
    /// `(queue, ready messages, consumers)`.
    pub async fn queue_stats(
        &self,
        names: &[String],
    ) -> Result<Vec<(String, u32, u32)>, AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let work = async {
            let mut slot = self.stats.lock().await;
            if !slot.as_ref().is_some_and(|c| c.status().connected()) {
                if let Some(old) = slot.take() {
                    close_quietly(old);
                }
                *slot = Some(connect(&self.url, &format!("{}-stats", self.name)).await?);
            }
            let Some(connection) = slot.as_ref() else {
                return Err(AmqpError::Pool("no connection for queue statistics".into()));
            };
            let channel = match connection.create_channel().await {
                Ok(channel) => channel,
                Err(source) => {
                    // The next reading connects again.
                    if let Some(old) = slot.take() {
                        close_quietly(old);
                    }
                    return Err(AmqpError::Broker {
                        operation: "open channel",
                        source,
                    });
                }
            };
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            let mut depths = Vec::with_capacity(names.len());
            for name in names {
                let queue = channel
                    .queue_declare(name.as_str().into(), passive, FieldTable::default())
                    .await
                    .map_err(broker("read queue depth"))?;
                depths.push((name.clone(), queue.message_count(), queue.consumer_count()));
            }
            let _ = channel.close(200, "done".into()).await;
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
        let attempt = self.publish_once(exchange, routing_key, payload, headers, true);
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
        mandatory: bool,
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
            mandatory,
            ..Default::default()
        };
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                options,
                payload,
                properties,
            )
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

    /// Publishes once a message no queue may be bound for right now (a cancel request for a run
    /// no worker holds): it is not `mandatory`, so the broker confirms it even when it routes
    /// it nowhere. Waits for the confirm like [`Publisher::publish`].
    pub async fn publish_optional(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
    ) -> Result<(), AmqpError> {
        let attempt = self.publish_once(exchange, routing_key, payload, None, false);
        let outcome = tokio::time::timeout(PUBLISH_ATTEMPT_TIMEOUT, attempt)
            .await
            .unwrap_or_else(|_| {
                Err(AmqpError::ConfirmTimeout {
                    target: format!("{exchange}/{routing_key}"),
                })
            });
        if outcome.is_err() {
            self.forget_channel().await;
        }
        outcome
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

/// A text header of a message, if it has one.
pub fn header_text(properties: &BasicProperties, name: &str) -> Option<String> {
    match properties.headers().as_ref()?.inner().get(name)? {
        AMQPValue::LongString(value) => Some(value.to_string()),
        AMQPValue::ShortString(value) => Some(value.to_string()),
        _ => None,
    }
}

/// Ends a connection that failed us without waiting for the broker: a goodbye sent in the
/// background, so a dead node never holds the caller.
fn close_quietly(connection: Connection) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        runtime.spawn(async move {
            let _ =
                tokio::time::timeout(CONFIRM_TIMEOUT, connection.close(200, "bye".into())).await;
        });
    }
}

#[cfg(test)]
mod tests {
    /// Catches: a publisher whose debug form, printed by whoever logs it, shows the broker's
    /// password (it keeps the URL to connect again).
    #[test]
    fn a_publisher_does_not_show_its_password() {
        let publisher = Publisher::new("amqp://fp:hunter2-secret@h/%2f,h2", "test").unwrap();
        let shown = format!("{publisher:?}");
        assert!(
            !shown.contains("hunter2-secret") && shown.contains("fp:***@h"),
            "{shown}"
        );
    }

    /// Catches: a worker that accepts a heartbeat short enough that the broker hands its run
    /// to another worker before it stops it (two executions at once), or that refuses the
    /// default.
    #[test]
    fn a_worker_refuses_a_heartbeat_shorter_than_its_claim_grace() {
        let base = "amqp://guest:guest@127.0.0.1:5672/%2f";
        assert!(check_worker_heartbeat(base).is_ok());
        assert!(check_worker_heartbeat(&format!("{base}?heartbeat=60")).is_ok());
        assert!(check_worker_heartbeat(&format!("{base}?heartbeat=0")).is_ok());
        let short = check_worker_heartbeat(&format!("{base}?frame_max=8192&heartbeat=10"))
            .expect_err("too short");
        assert!(
            short.contains("heartbeat=10") && short.contains("FORGEPOOL_AMQP_URL"),
            "{short}"
        );
        assert!(check_worker_heartbeat(&format!("{base}?heartbeat=soon")).is_err());
        // Every node of a list is checked (a later node's own URL may set its heartbeat).
        let listed = format!("{base}?heartbeat=60,amqp://h2/%2f?heartbeat=5");
        assert!(check_worker_heartbeat(&listed).is_err(), "{listed}");
    }

    use super::*;
}
