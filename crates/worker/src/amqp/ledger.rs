//! The final review ledger on the broker, shared by every worker of the cluster.
//!
//! One durable queue per intent and per receipt, kept seven days; a receipt is a versioned
//! `proto::ReviewReceipt`. Every message is signed with the job key over its queue and body; one
//! that does not verify is ignored. The ledger lives on the broker, like leases and done markers:
//! every worker already reaches it, it survives any worker, and it needs no new service.
//!
//! The run's progress is here too: after each completed stage a `proto::Progress` is kept in
//! `{prefix}.progress.{run_id}`, a one-message queue (`x-max-length` 1 with `drop-head`), so a
//! later progress is one confirmed publish.

use std::collections::HashSet;
use std::sync::Arc;

use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection};
use proto::amqp::{self, refusal_code, AmqpError, Publisher, Topology};
use proto::{Checkpoint, JobKey, Progress};
use tracing::warn;

use crate::ports::ledger::{Entry, LedgerError, Receipt, ReviewLedger};

/// What a ledger message's signature covers: its queue and its body, so that a message
/// signed for one run cannot be moved to another's queue.
pub(super) fn bound(queue: &str, body: &[u8]) -> Vec<u8> {
    let mut signed = Vec::with_capacity(queue.len() + 1 + body.len());
    signed.extend_from_slice(queue.as_bytes());
    signed.push(b'\n');
    signed.extend_from_slice(body);
    signed
}

/// The largest progress message read back: a checkpoint's patch and the loop's state.
const MAX_PROGRESS_BYTES: usize = proto::MAX_JOB_BYTES;

/// The largest receipt read back (a report is at most 256 KiB).
const MAX_RECEIPT_BYTES: usize = 1024 * 1024;

/// How long the final review's intent and receipt are kept: long after any redelivery.
const LEDGER_TTL_MS: i64 = 7 * 24 * 3600 * 1000;

/// The final review ledger on the broker, shared by every worker of the cluster: the intent
/// and the receipt of a run are each one persistent message in a durable queue of their own
/// (`{prefix}.review.intent.{run_id}`, `{prefix}.review.receipt.{run_id}`), kept seven days.
#[derive(Debug, Clone)]
pub struct AmqpLedger {
    amqp_url: String,
    topology: Topology,
    publisher: Arc<Publisher>,
    /// Signs what the ledger keeps, and checks what it reads back: only a worker of the
    /// cluster may write an intent, a receipt or a run's progress (a forged progress could
    /// skip a run's review).
    key: JobKey,
    /// One connection, kept across operations (the run's progress is kept after every
    /// stage) and opened again after a failure.
    connection: Arc<tokio::sync::Mutex<Option<Arc<Connection>>>>,
    /// The progress queues this process declared: a later progress of the run is only
    /// published (the queue keeps its newest message alone).
    declared: Arc<std::sync::Mutex<HashSet<String>>>,
}

impl AmqpLedger {
    /// A ledger on the broker at `amqp_url`, publishing through `publisher`.
    pub fn new(
        amqp_url: &str,
        topology: Topology,
        publisher: Arc<Publisher>,
        key: JobKey,
    ) -> AmqpLedger {
        AmqpLedger {
            amqp_url: amqp_url.to_string(),
            topology,
            publisher,
            key,
            connection: Arc::default(),
            declared: Arc::default(),
        }
    }

    async fn session<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        let done = tokio::time::timeout(amqp::SESSION_TIMEOUT, work)
            .await
            .unwrap_or_else(|_| Err(LedgerError("the broker did not answer in time".into())));
        if done.is_err() {
            // The next operation opens a new connection.
            *self.connection.lock().await = None;
        }
        done
    }

    async fn channel(&self, connection: &Connection) -> Result<Channel, LedgerError> {
        connection
            .create_channel()
            .await
            .map_err(|e| LedgerError(e.to_string()))
    }

    /// The one message kept in `queue`, left in place; `None` when the queue does not exist
    /// or its message is not signed with the cluster's key for this queue.
    async fn peek(
        &self,
        connection: &Connection,
        queue: &str,
    ) -> Result<Option<Vec<u8>>, LedgerError> {
        let exists = amqp::queue_exists(self.channel(connection).await?, queue)
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        if !exists {
            return Ok(None);
        }
        let channel = self.channel(connection).await?;
        let message = channel
            .basic_get(
                queue.into(),
                lapin::options::BasicGetOptions { no_ack: false },
            )
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        let body = match message {
            Some(message) => {
                amqp::requeue(&message.delivery)
                    .await
                    .map_err(LedgerError)?;
                let delivery = message.delivery;
                let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
                match self
                    .key
                    .verify(&bound(queue, &delivery.data), signature.as_deref())
                {
                    Ok(()) => Some(delivery.data),
                    Err(reason) => {
                        warn!(%queue, %reason, "ignoring a ledger message not signed by the cluster");
                        None
                    }
                }
            }
            None => None,
        };
        let _ = channel.close(200, "read".into()).await;
        Ok(body)
    }

    /// Replaces what `queue` holds with `body`, confirmed by the broker.
    async fn keep(
        &self,
        connection: &Connection,
        queue: &str,
        body: &[u8],
    ) -> Result<(), LedgerError> {
        let channel = self.channel(connection).await?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongLongInt(LEDGER_TTL_MS));
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(queue.into(), durable, arguments)
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        channel
            .queue_purge(queue.into(), Default::default())
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        let _ = channel.close(200, "declared".into()).await;
        let signature = self.key.sign(&bound(queue, body));
        self.publisher
            .publish("", queue, body, Some(amqp::signature_headers(signature)))
            .await
            .map_err(|e| LedgerError(e.to_string()))
    }

    /// Keeps `body` as the newest message of the progress queue `queue`: the queue holds one
    /// message, and a publish drops the older one, so a run's later progress costs one
    /// confirmed publish. The queue is declared on first use, and again when it is gone (the
    /// broker returns the unroutable message) or was declared by an older version.
    async fn keep_newest(
        &self,
        connection: &Connection,
        queue: &str,
        body: &[u8],
    ) -> Result<(), LedgerError> {
        let signature = self.key.sign(&bound(queue, body));
        let known = self.is_declared(queue);
        if known {
            let headers = Some(amqp::signature_headers(signature.clone()));
            match self.publisher.publish("", queue, body, headers).await {
                Ok(()) => return Ok(()),
                Err(AmqpError::Refused { .. }) => self.forget_declared(queue),
                Err(error) => return Err(LedgerError(error.to_string())),
            }
        }
        self.declare_progress(connection, queue).await?;
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(queue.to_string());
        self.publisher
            .publish("", queue, body, Some(amqp::signature_headers(signature)))
            .await
            .map_err(|e| LedgerError(e.to_string()))
    }

    /// Declares a progress queue: durable, one message (the newest), gone after a week unused.
    /// A queue of an older version (other arguments) is replaced.
    async fn declare_progress(
        &self,
        connection: &Connection,
        queue: &str,
    ) -> Result<(), LedgerError> {
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongLongInt(LEDGER_TTL_MS));
        arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
        arguments.insert(
            "x-overflow".into(),
            AMQPValue::LongString("drop-head".into()),
        );
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        for _ in 0..2 {
            let channel = self.channel(connection).await?;
            match channel
                .queue_declare(queue.into(), durable, arguments.clone())
                .await
            {
                Ok(_) => {
                    let _ = channel.close(200, "declared".into()).await;
                    return Ok(());
                }
                // Declared by an older version with other arguments: its progress is about
                // to be replaced anyway.
                Err(error) if refusal_code(&error) == Some(406) => {
                    self.delete(connection, queue).await?;
                }
                Err(error) => return Err(LedgerError(error.to_string())),
            }
        }
        Err(LedgerError(format!(
            "cannot declare the progress queue {queue}"
        )))
    }

    fn is_declared(&self, queue: &str) -> bool {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(queue)
    }

    fn forget_declared(&self, queue: &str) {
        self.declared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(queue);
    }

    async fn delete(&self, connection: &Connection, queue: &str) -> Result<(), LedgerError> {
        let channel = self.channel(connection).await?;
        match channel
            .queue_delete(queue.into(), QueueDeleteOptions::default())
            .await
        {
            Ok(_) => {
                let _ = channel.close(200, "deleted".into()).await;
                Ok(())
            }
            Err(error) if refusal_code(&error) == Some(404) => Ok(()),
            Err(error) => Err(LedgerError(error.to_string())),
        }
    }

    async fn connect(&self) -> Result<Arc<Connection>, LedgerError> {
        let mut slot = self.connection.lock().await;
        if let Some(connection) = slot.as_ref().filter(|c| c.status().connected()) {
            return Ok(Arc::clone(connection));
        }
        let connection = amqp::connect(&self.amqp_url, "forgepool-worker-ledger")
            .await
            .map_err(|e| LedgerError(e.to_string()))?;
        let connection = Arc::new(connection);
        *slot = Some(Arc::clone(&connection));
        Ok(connection)
    }

    /// The one message kept in `queue`, left in place; `None` when there is none.
    async fn read(&self, queue: &str) -> Result<Option<Vec<u8>>, LedgerError> {
        self.session(async { self.peek(&*self.connect().await?, queue).await })
            .await
    }

    /// Replaces what `queue` holds with `body`.
    async fn write(&self, queue: &str, body: &[u8]) -> Result<(), LedgerError> {
        self.session(async { self.keep(&*self.connect().await?, queue, body).await })
            .await
    }

    /// Deletes `queue`.
    async fn remove(&self, queue: &str) -> Result<(), LedgerError> {
        self.session(async { self.delete(&*self.connect().await?, queue).await })
            .await
    }

    /// Whether any of `queues` exists.
    async fn any_exists(&self, queues: &[String]) -> Result<bool, LedgerError> {
        self.session(async {
            let connection = self.connect().await?;
            for queue in queues {
                let channel = self.channel(&connection).await?;
                let exists = amqp::queue_exists(channel, queue)
                    .await
                    .map_err(|e| LedgerError(e.to_string()))?;
                if exists {
                    return Ok(true);
                }
            }
            Ok(false)
        })
        .await
    }

    /// Closes the kept connection with a goodbye (at shutdown).
    pub async fn close(&self) {
        if let Some(connection) = self.connection.lock().await.take() {
            let _ = tokio::time::timeout(amqp::SETTLE_TIMEOUT, connection.close(200, "bye".into()))
                .await;
        }
    }
}

impl ReviewLedger for AmqpLedger {
    async fn lookup(&self, run_id: &str) -> Result<Entry, LedgerError> {
        let intent = self.read(&self.topology.review_intent(run_id)).await?;
        let receipt = self.read(&self.topology.review_receipt(run_id)).await?;
        Ok(Entry {
            intent: intent.map(|tree| String::from_utf8_lossy(&tree).to_string()),
            receipt: receipt.and_then(|body| proto::decode_message(&body, MAX_RECEIPT_BYTES).ok()),
        })
    }

    async fn intent(&self, run_id: &str, tree: &str) -> Result<(), LedgerError> {
        self.write(&self.topology.review_intent(run_id), tree.as_bytes())
            .await
    }

    async fn receipt(&self, run_id: &str, receipt: &Receipt) -> Result<(), LedgerError> {
        let body = serde_json::to_vec(receipt).map_err(|e| LedgerError(e.to_string()))?;
        self.write(&self.topology.review_receipt(run_id), &body)
            .await?;
        self.remove(&self.topology.review_intent(run_id)).await
    }

    async fn clear(&self, run_id: &str) -> Result<(), LedgerError> {
        self.remove(&self.topology.review_intent(run_id)).await
    }

    async fn progress(&self, run_id: &str) -> Result<Option<Checkpoint>, LedgerError> {
        let body = self.read(&self.topology.progress(run_id)).await?;
        // An unreadable progress message (another version) is no progress: the run starts over.
        Ok(body
            .and_then(|body| proto::decode_message::<Progress>(&body, MAX_PROGRESS_BYTES).ok())
            .filter(|progress| progress.run_id.to_string() == run_id)
            .map(|progress| progress.checkpoint))
    }

    async fn keep_progress(
        &self,
        run_id: &str,
        checkpoint: &Checkpoint,
    ) -> Result<(), LedgerError> {
        let run = uuid::Uuid::parse_str(run_id).map_err(|e| LedgerError(e.to_string()))?;
        let progress = Progress {
            schema_version: proto::SCHEMA_VERSION,
            run_id: run,
            checkpoint: checkpoint.clone(),
        };
        let body = serde_json::to_vec(&progress).map_err(|e| LedgerError(e.to_string()))?;
        let queue = self.topology.progress(run_id);
        self.session(async {
            self.keep_newest(&*self.connect().await?, &queue, &body)
                .await
        })
        .await
    }

    async fn clear_progress(&self, run_id: &str) -> Result<(), LedgerError> {
        let queue = self.topology.progress(run_id);
        self.forget_declared(&queue);
        self.remove(&queue).await
    }

    async fn run_unfinished(&self, run_id: &str) -> Result<bool, LedgerError> {
        let queues = [self.topology.lease(run_id), self.topology.progress(run_id)];
        self.any_exists(&queues).await
    }
}
