//! The trackers of the file and the webhook route's checks, in order: the tracker, the
//! signature over the raw body, the per-tracker rate limit, the delivery's de-duplication,
//! the parse; a happening goes on a bounded queue, so the route answers at once.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::warn;
use trackers::{AnyTracker, Happening, Parsed, Tracker};

use crate::store::Store;

/// The most happenings waiting for work; past it the route answers 503 (the tracker
/// redelivers).
const QUEUE: usize = 4096;
/// The most deliveries one tracker may send in a second; past it, 429.
const PER_SECOND: u32 = 2000;

/// The trackers of `FORGEPOOL_TRACKERS_FILE`.
pub struct Trackers {
    /// The address of a run's page for people, `{run_id}` in it.
    pub run_url: Option<String>,
    pub(super) entries: HashMap<String, Arc<AnyTracker>>,
    queue: mpsc::Sender<Work>,
    pub(super) receiver: Mutex<Option<mpsc::Receiver<Work>>>,
    windows: Mutex<HashMap<String, (Instant, u32)>>,
}

impl std::fmt::Debug for Trackers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trackers")
            .field("names", &self.entries.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A verified, parsed delivery waiting for work.
pub(super) struct Work {
    pub(super) tracker: Arc<AnyTracker>,
    pub(super) happening: Happening,
}

/// What the route answers a delivery.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    /// No tracker of that name (404).
    Unknown,
    /// The signature is missing or wrong (401); nothing is stored.
    Unsigned(String),
    /// Too many deliveries this second (429).
    TooMany,
    /// Seen in the last 24 hours (200); nothing done.
    Duplicate,
    /// Taken (202): queued for work, or nothing to do (`why`).
    Accepted(String),
    /// The queue is full or the store failed (503): the tracker redelivers.
    Busy(String),
}

impl Trackers {
    /// Reads the trackers file; the error names the entry and the setting.
    pub fn load(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<Trackers, String> {
        let file = trackers::config::load(path, env).map_err(|e| e.to_string())?;
        let mut entries = HashMap::new();
        for config in file.trackers {
            let name = config.name.clone();
            entries.insert(name, Arc::new(AnyTracker::new(config)?));
        }
        let (queue, receiver) = mpsc::channel(QUEUE);
        Ok(Trackers {
            run_url: file.run_url,
            entries,
            queue,
            receiver: Mutex::new(Some(receiver)),
            windows: Mutex::default(),
        })
    }

    /// The tracker named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<AnyTracker>> {
        self.entries.get(name)
    }

    /// The route's work on a delivery, in order: the tracker, the signature over the raw
    /// body, the rate limit, the delivery id, the parse; a happening is queued.
    pub async fn receive(
        &self,
        store: &Store,
        metrics: &telemetry::Metrics,
        name: &str,
        headers: &trackers::Headers,
        body: &[u8],
    ) -> Answer {
        let Some(tracker) = self.entries.get(name) else {
            return Answer::Unknown;
        };
        let t = tracker.get();
        let count = |outcome: &str| metrics.tracker_delivery(name, outcome);
        if let Err(why) = t.verify(headers, body) {
            count("refused_signature");
            warn!(tracker = name, %why, "a tracker delivery's signature was refused");
            return Answer::Unsigned(why);
        }
        if !self.within_rate(name) {
            return Answer::TooMany;
        }
        let delivery = t.delivery_id(headers);
        if let Some(delivery) = &delivery {
            match store.tracker_delivery_seen(name, delivery).await {
                Ok(true) => {
                    count("duplicate");
                    return Answer::Duplicate;
                }
                Ok(false) => {}
                Err(error) => return Answer::Busy(format!("the store did not answer: {error}")),
            }
        }
        match t.parse(headers, body) {
            Ok(Parsed::Ignored(why)) => {
                count("ignored");
                Answer::Accepted(why)
            }
            Err(why) => {
                count("error");
                warn!(tracker = name, %why, "a tracker delivery could not be read");
                Answer::Accepted(format!("not read: {why}"))
            }
            Ok(Parsed::Happening(happening)) => {
                let work = Work {
                    tracker: Arc::clone(tracker),
                    happening: *happening,
                };
                match self.queue.try_send(work) {
                    Ok(()) => Answer::Accepted("queued".into()),
                    Err(_) => {
                        // Not taken: its redelivery must not count as a repeat.
                        if let Some(delivery) = &delivery {
                            let _ = store.tracker_delivery_forget(name, delivery).await;
                        }
                        Answer::Busy("too many deliveries are waiting".into())
                    }
                }
            }
        }
    }

    fn within_rate(&self, name: &str) -> bool {
        let mut windows = self.windows.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let window = windows.entry(name.to_string()).or_insert((now, 0));
        if now.duration_since(window.0) >= Duration::from_secs(1) {
            *window = (now, 0);
        }
        window.1 += 1;
        window.1 <= PER_SECOND
    }
}
