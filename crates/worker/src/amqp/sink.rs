//! Events out: the run's events published with confirms, counted in the metrics, and
//! heartbeats beside the run.
//!
//! Events are published with a confirm; heartbeats get one attempt each, so a broker outage never
//! holds the run up. `ObservedSink` wraps the sink per run and feeds the run's events to the
//! metrics.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proto::amqp::{Publisher, Topology};
use proto::{Event, EventKind, Job};
use telemetry::Metrics;
use tracing::warn;
use uuid::Uuid;

use crate::ports::sink::{EventSink, PublishEvent};

/// Publishes a run's events to the events exchange with confirms, retrying through a broker
/// restart for up to the publish deadline.
#[derive(Debug)]
pub struct AmqpSink {
    publisher: Arc<Publisher>,
    topology: Topology,
    deadline: Duration,
}

impl EventSink for AmqpSink {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        self.send(&event, true).await
    }
}

impl AmqpSink {
    /// A sink publishing through `publisher`, retrying each event for up to `deadline`.
    pub fn new(publisher: Arc<Publisher>, topology: Topology, deadline: Duration) -> AmqpSink {
        AmqpSink {
            publisher,
            topology,
            deadline,
        }
    }

    /// Publishes `event` to the events exchange: `reliably` retries through a broker restart
    /// for up to the publish deadline; otherwise there is one attempt (a heartbeat, which the
    /// next one replaces).
    async fn send(&self, event: &Event, reliably: bool) -> Result<(), PublishEvent> {
        let payload = serde_json::to_vec(event).map_err(|e| PublishEvent(e.to_string()))?;
        let (exchange, key) = (self.topology.events(), event.routing_key());
        let sent = if reliably {
            self.publisher
                .publish_reliably(&exchange, &key, &payload, None, self.deadline)
                .await
        } else {
            self.publisher
                .publish(&exchange, &key, &payload, None)
                .await
        };
        sent.map_err(|e| PublishEvent(e.to_string()))
    }

    /// Publishes a heartbeat of `run_id` every `interval` until the future is dropped: one
    /// attempt each (a later one replaces a lost one), so a broker outage never holds the run
    /// up.
    pub async fn heartbeats(&self, run_id: Uuid, worker: &str, interval: Duration) {
        let mut heartbeat = tokio::time::interval(interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        heartbeat.tick().await;
        loop {
            heartbeat.tick().await;
            let beat = Event::new(
                run_id,
                EventKind::Heartbeat {
                    worker: worker.to_string(),
                },
            );
            if let Err(error) = self.send(&beat, false).await {
                warn!(%error, "heartbeat not published");
            }
        }
    }
}

/// A run's view of the worker's sink: events are published, then counted in the metrics under
/// the job's (validated) skill and step.
pub struct ObservedSink<'a> {
    sink: &'a AmqpSink,
    metrics: &'a Metrics,
    job: &'a Job,
    /// Cycle files already counted: a file rewritten in place is one review cycle.
    cycles: Mutex<HashSet<(String, String)>>,
}

impl std::fmt::Debug for ObservedSink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObservedSink")
            .field("run_id", &self.job.run_id)
            .finish_non_exhaustive()
    }
}

impl<'a> ObservedSink<'a> {
    /// `sink` seen by one run of `job`.
    pub fn new(sink: &'a AmqpSink, metrics: &'a Metrics, job: &'a Job) -> ObservedSink<'a> {
        ObservedSink {
            sink,
            metrics,
            job,
            cycles: Mutex::default(),
        }
    }
}

impl EventSink for ObservedSink<'_> {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        // Log lines and heartbeats count for nothing: they are not copied.
        let counted = match &event.kind {
            EventKind::Log { .. } | EventKind::Heartbeat { .. } => None,
            kind => Some(kind.clone()),
        };
        self.sink.publish(event).await?;
        let Some(kind) = counted else {
            return Ok(());
        };
        let repeat = match &kind {
            EventKind::Cycle { cycle } => self
                .cycles
                .lock()
                .is_ok_and(|mut seen| !seen.insert((cycle.step.clone(), cycle.file.clone()))),
            _ => false,
        };
        if !repeat {
            self.metrics.observe(self.job, &kind);
        }
        Ok(())
    }
}
