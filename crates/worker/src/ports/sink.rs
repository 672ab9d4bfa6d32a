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

/// A sink that replaces every secret value in an event's text with `[REDACTED]` before
/// passing it on: whatever an agent wrote (its output, cycle files, reports) and whatever git
/// said, nothing that leaves the engine carries a secret.
#[derive(Debug)]
pub struct Redacting<'a, S> {
    inner: &'a S,
    secrets: Vec<String>,
}

impl<'a, S: EventSink> Redacting<'a, S> {
    /// Wraps `inner`; values shorter than 4 bytes are not treated as secrets.
    pub fn new(inner: &'a S, secrets: Vec<String>) -> Redacting<'a, S> {
        let mut secrets: Vec<String> = secrets.into_iter().filter(|s| s.len() >= 4).collect();
        // Longer first, so a secret that contains another is replaced whole.
        secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        secrets.dedup();
        Redacting { inner, secrets }
    }

    /// Replaces the secrets in every string (values and keys) of the event. Fails closed:
    /// an event that cannot be redacted is never passed on.
    pub fn redact(&self, event: Event) -> Result<Event, PublishEvent> {
        if self.secrets.is_empty() {
            return Ok(event);
        }
        let mut value = serde_json::to_value(&event)
            .map_err(|e| PublishEvent(format!("cannot redact an event: {e}")))?;
        if !redact_value(&mut value, &self.secrets) {
            return Ok(event);
        }
        serde_json::from_value(value).map_err(|_| {
            PublishEvent(
                "an event held a secret where it could not be replaced; it was not published"
                    .into(),
            )
        })
    }
}

impl<S: EventSink> EventSink for Redacting<'_, S> {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        self.inner.publish(self.redact(event)?).await
    }
}

/// Redacts every string in `value`; whether anything changed.
fn redact_value(value: &mut serde_json::Value, secrets: &[String]) -> bool {
    match value {
        serde_json::Value::String(text) if secrets.iter().any(|s| text.contains(s.as_str())) => {
            *text = crate::runtime::redact(text, secrets);
            true
        }
        serde_json::Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, item| redact_value(item, secrets) | changed),
        serde_json::Value::Object(map) => {
            let leaky: Vec<String> = map
                .keys()
                .filter(|k| secrets.iter().any(|s| k.contains(s.as_str())))
                .cloned()
                .collect();
            let changed = !leaky.is_empty();
            for key in leaky {
                if let Some(item) = map.remove(&key) {
                    map.insert(crate::runtime::redact(&key, secrets), item);
                }
            }
            map.values_mut().fold(changed, |changed, item| {
                redact_value(item, secrets) | changed
            })
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{EventKind, RunState};

    #[tokio::test]
    async fn every_string_of_an_event_is_redacted() {
        let (sink, mut events) = ChannelSink::new(4);
        let redacting = Redacting::new(&sink, vec!["sk-live-secret-value".into(), "ab".into()]);
        let run_id = uuid::Uuid::new_v4();
        redacting
            .publish(Event::new(
                run_id,
                EventKind::State {
                    state: RunState::Failed,
                    reason: "`git push` failed: https://x:sk-live-secret-value@host ab".into(),
                },
            ))
            .await
            .unwrap();
        let event = events.recv().await.unwrap();
        let EventKind::State { reason, .. } = event.kind else {
            panic!("a state event")
        };
        assert_eq!(reason, "`git push` failed: https://x:[REDACTED]@host ab");
    }
}

/// A sink that stamps every event with the execution that publishes it (see
/// [`proto::Event::execution`]).
#[derive(Debug)]
pub struct Stamped<'a, S> {
    inner: &'a S,
    execution: uuid::Uuid,
}

impl<'a, S: EventSink> Stamped<'a, S> {
    /// Events into `inner`, stamped with `execution`.
    pub fn new(inner: &'a S, execution: uuid::Uuid) -> Stamped<'a, S> {
        Stamped { inner, execution }
    }
}

impl<S: EventSink> EventSink for Stamped<'_, S> {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        self.inner.publish(event.by(self.execution)).await
    }
}
