//! The event seam: where a running engine sends its events.
//!
//! In embedded mode the sink is a channel into the same process's store; in distributed mode
//! it publishes to the events exchange with publisher confirms.

use std::future::Future;

use proto::Event;
use tokio::sync::mpsc;

/// A failed publish.
#[derive(Debug, thiserror::Error)]
#[error("cannot publish event: {0}")]
pub struct PublishEvent(pub String);

/// Receives the events of runs.
pub trait EventSink: Send + Sync {
    /// Publishes one event; returns once it is safely handed over (stored or confirmed).
    fn publish(&self, event: Event) -> impl Future<Output = Result<(), PublishEvent>> + Send;
}

/// A sink that sends events into an in-process channel (embedded mode, unit tests).
#[derive(Debug, Clone)]
pub struct ChannelSink {
    sender: mpsc::Sender<Event>,
}

impl ChannelSink {
    /// A sink and the receiver its events arrive on. The channel is bounded, so a slow
    /// receiver slows the run down instead of losing events.
    pub fn new(capacity: usize) -> (ChannelSink, mpsc::Receiver<Event>) {
        let (sender, receiver) = mpsc::channel(capacity);
        (ChannelSink { sender }, receiver)
    }
}

impl EventSink for ChannelSink {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        self.sender
            .send(event)
            .await
            .map_err(|_| PublishEvent("the event receiver has stopped".into()))
    }
}
