//! Connections and the confirming publisher.

use std::time::Duration;

use deadpool_lapin::lapin;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::sync::Mutex;

use super::{
    refusal_code, AmqpError, Topology, CONFIRM_TIMEOUT, CONNECT_TIMEOUT, REASON_HEADER,
    SESSION_TIMEOUT, SOURCE_HEADER,
};

/// Connection properties that run lapin on the current tokio runtime.
pub fn connection_properties(name: &str) -> ConnectionProperties {
    ConnectionProperties::default().with_connection_name(LongString::from(name.to_string()))
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
        let name = name.to_string();
        let config = deadpool_lapin::Config {
            url: Some(with_frame_max(url)),
            pool: None,
        };
        let pool = config
            .builder(
                move || connection_properties(&name),
                deadpool_lapin::Runtime::Tokio1,
            )
            .map_err(|e| AmqpError::Pool(e.to_string()))?
            .max_size(2)
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
            if let Some((object, channel)) = self.channel.lock().await.take() {
                let _ = channel.close(200, "bye".into()).await;
                let _ = deadpool_lapin::Object::take(object)
                    .close(200, "bye".into())
                    .await;
            }
            // The idle pooled connections, taken out of the pool so none is made anew.
            for _ in 0..self.pool.status().available {
                let Ok(object) = self.pool.get().await else {
                    break;
                };
                let _ = deadpool_lapin::Object::take(object)
                    .close(200, "bye".into())
                    .await;
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

#[cfg(test)]
mod tests {
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
    }

    use super::*;

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
