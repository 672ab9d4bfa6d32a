//! Trackers in the dispatcher (SPEC 17): the webhook route's work after the signature, and
//! the live comment of each run a tracker started. The trackers themselves (their events,
//! APIs and signatures) are the `forgepool-trackers` crate.
//!
//! - `mod.rs`: starts the work: the queue's workers, the comments of runs already started.
//! - `set.rs`: the trackers of the file, the route's checks (signature first, then the
//!   per-tracker rate limit, the delivery's de-duplication, the parse) and the bounded queue
//!   between the route and the work, so the route answers at once.
//! - `intake.rs`: what a happening does: who may, the claim, the ticket, the run.
//! - `comment.rs`: one comment per run, edited in place as the run moves.

mod comment;
mod intake;
pub mod set;

use std::sync::Arc;

use tracing::{info, warn};
use trackers::Tracker;

use crate::dispatcher::Dispatcher;

/// The most happenings worked on at once.
const WORKERS: usize = 8;

/// Starts the trackers' work: the queue's workers, and the live comments of runs that a
/// dispatcher before this one started and whose comment is not final yet.
pub fn start(dispatcher: Arc<Dispatcher>) {
    let Some(trackers) = dispatcher.trackers.clone() else {
        return;
    };
    for tracker in trackers.entries.values() {
        let (weak, name) = (
            Arc::downgrade(&dispatcher),
            tracker.get().config().name.clone(),
        );
        tracker.observe(Arc::new(move |code| {
            if let Some(dispatcher) = weak.upgrade() {
                dispatcher.metrics.tracker_request(&name, code);
            }
        }));
    }
    let receiver = trackers
        .receiver
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(receiver) = receiver {
        let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
        for _ in 0..WORKERS {
            let (dispatcher, receiver) = (Arc::clone(&dispatcher), Arc::clone(&receiver));
            tokio::spawn(async move {
                loop {
                    let work = tokio::select! {
                        work = async { receiver.lock().await.recv().await } => work,
                        () = dispatcher.stopping.cancelled() => None,
                    };
                    let Some(work) = work else { return };
                    intake::handle(&dispatcher, &work.tracker, work.happening).await;
                }
            });
        }
    }
    for tracker in trackers.entries.values() {
        if tracker.get().config().poll_seconds > 0 {
            tokio::spawn(poll(Arc::clone(&dispatcher), Arc::clone(tracker)));
        }
    }
    tokio::spawn(async move {
        match dispatcher.store.tracker_claims(None, None).await {
            Ok(claims) => {
                for claim in claims {
                    if let Some(tracker) = trackers.entries.get(&claim.tracker) {
                        info!(run_id = %claim.run_id, tracker = %claim.tracker, "following the run's comment again");
                        comment::follow(Arc::clone(&dispatcher), Arc::clone(tracker), claim);
                    }
                }
            }
            Err(error) => {
                warn!(%error, "cannot read the runs trackers started; their comments wait for the next start")
            }
        }
    });
}

/// The reconciling poll (SPEC 17): every `poll_seconds`, the open issues carrying the label in
/// each repository the entry names exactly (a glob cannot be listed; Jira: each project) go the way of a webhook's
/// label event, so a lost delivery delays a run and never drops it; an issue already claimed
/// starts nothing. The person who added the label is the one whose permission decides.
async fn poll(dispatcher: Arc<Dispatcher>, tracker: Arc<trackers::AnyTracker>) {
    let config = tracker.get().config().clone();
    let every = std::time::Duration::from_secs(config.poll_seconds);
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = dispatcher.stopping.cancelled() => return,
        }
        for repository in config.listable() {
            match tracker.get().labelled(&repository).await {
                Ok(found) => {
                    for happening in found {
                        intake::handle(&dispatcher, &tracker, happening).await;
                    }
                }
                Err(error) => {
                    warn!(tracker = %config.name, %repository, %error, "the reconciling poll could not list the labelled issues");
                }
            }
        }
    }
}
