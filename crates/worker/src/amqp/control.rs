//! Cancel requests: a consumer of the control exchange that cancels the runs this worker
//! holds.
//!
//! The same consumer takes profile pauses (`pause.*`) into the `PauseBook`, and catches up from
//! the pause stream's start each time it connects, so a worker that starts later knows every pause
//! in force.

use std::sync::Arc;

use lapin::options::{BasicConsumeOptions, QueueBindOptions};
use lapin::types::FieldTable;
use proto::amqp::{self, AmqpError, Consume, Delivery, Session, Topology};
use proto::{Control, ControlAction};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::gate::PauseBook;
use super::lease::InFlight;

/// Receives cancel requests and profile pauses on an exclusive queue of its own bound to
/// `cancel.*` and `pause.*`, and catches up with the pause stream each time it connects.
#[derive(Debug)]
pub struct Cancels {
    amqp_url: String,
    topology: Topology,
    in_flight: Arc<InFlight>,
    pauses: Option<Arc<PauseBook>>,
}

impl Cancels {
    /// Cancel requests from the broker at `amqp_url` for the runs `in_flight`.
    pub fn new(amqp_url: &str, topology: Topology, in_flight: Arc<InFlight>) -> Cancels {
        Cancels {
            amqp_url: amqp_url.to_string(),
            topology,
            in_flight,
            pauses: None,
        }
    }

    /// The same consumer keeping `book` of the profiles' pauses.
    pub fn with_pauses(mut self, book: Arc<PauseBook>) -> Cancels {
        self.pauses = Some(book);
        self
    }

    /// Receives cancel requests until `shutdown`.
    pub async fn listen(self, shutdown: CancellationToken) {
        if let Some(session) = amqp::consume(&self, &shutdown).await {
            session.close().await;
        }
    }
}

impl Consume for Cancels {
    fn name(&self) -> &str {
        "forgepool-worker-control"
    }

    async fn open(&self, _again: bool) -> Result<Session, AmqpError> {
        let broker = |operation| move |source| AmqpError::Broker { operation, source };
        let opened = async {
            let (connection, channel) = amqp::connect_channel(&self.amqp_url, self.name()).await?;
            let queue = channel
                .queue_declare("".into(), amqp::exclusive_queue(), FieldTable::default())
                .await
                .map_err(broker("declare control queue"))?;
            for key in ["cancel.*", "pause.*"] {
                channel
                    .queue_bind(
                        queue.name().clone(),
                        self.topology.control().into(),
                        key.into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(broker("bind control queue"))?;
            }
            // Bound first, then caught up: no pause falls between the two.
            if let Some(book) = &self.pauses {
                if let Err(error) = book.catch_up(&connection).await {
                    warn!(%error, "cannot read the pause stream; pauses from now on are known");
                }
            }
            let no_ack = BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            };
            let consumer = channel
                .basic_consume(
                    queue.name().clone(),
                    "control".into(),
                    no_ack,
                    FieldTable::default(),
                )
                .await
                .map_err(broker("consume control"))?;
            Ok(Session {
                connection,
                channel,
                consumer,
                tag: "control".into(),
            })
        };
        tokio::time::timeout(amqp::SESSION_TIMEOUT, opened)
            .await
            .unwrap_or_else(|_| Err(AmqpError::Pool("the broker did not answer in time".into())))
    }

    async fn handle(&self, delivery: Delivery) {
        if delivery.routing_key.as_str().starts_with("pause.") {
            if let Some(book) = &self.pauses {
                book.take(&delivery);
            }
            return;
        }
        let Ok(control) = serde_json::from_slice::<Control>(&delivery.data) else {
            return;
        };
        if control.action == ControlAction::Cancel && self.in_flight.cancel(control.run_id).await {
            info!(run_id = %control.run_id, "cancel requested");
        }
    }
}
