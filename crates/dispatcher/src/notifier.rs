//! Tells the webhooks of each run that ended: a run's terminal state, once stored, starts one
//! notification per hook that takes its state. At start, and within a minute of a run that
//! could not be queued (the queue was full), the runs that ended in the last hour are read
//! from the store for a hook whose notification neither was delivered nor gave up (a
//! dispatcher that stopped in the middle, a dropped run), and those are sent again; that read
//! is not repeated otherwise, since it scans the runs' events. A receiver may so get one notification twice; the
//! `X-Forgepool-Delivery` header differs, the run id does not.
//!
//! A stored terminal state queues its run (`Dispatcher::ended`: bounded, `try_send`), and
//! `notify_ended` starts one notification per hook. A run the full queue dropped sets
//! `Ended::dropped`, which brings the read of recently ended runs
//! (`RunStore::ended_with_webhooks`) forward to within a minute.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use proto::Event;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::warn;
use uuid::Uuid;

use crate::dispatcher::Dispatcher;
use crate::store::RunStore;
use crate::webhooks::Webhooks;

/// How often the runs that ended lately are checked for notifications that did not end.
const SCAN_INTERVAL: Duration = Duration::from_secs(60);
/// How far back that check looks.
const SCAN_WINDOW: Duration = Duration::from_secs(3600);
/// How many ended runs may wait to be notified before the minute's check takes the rest.
pub const ENDED_QUEUE: usize = 1024;

/// The notifications in progress: `(run, hook)`.
type InProgress = Arc<Mutex<HashSet<(Uuid, String)>>>;

/// Notifies the webhooks of the runs that end, until `shutdown`.
pub async fn notify_ended(
    dispatcher: Arc<Dispatcher>,
    webhooks: Arc<Webhooks>,
    mut ended: mpsc::Receiver<Uuid>,
    shutdown: CancellationToken,
) {
    let in_progress: InProgress = Arc::default();
    let tasks = TaskTracker::new();
    let mut ticker = tokio::time::interval(SCAN_INTERVAL);
    let mut first = true;
    let start = |run_id: Uuid, done: HashSet<String>| {
        let (dispatcher, webhooks) = (Arc::clone(&dispatcher), Arc::clone(&webhooks));
        let in_progress = Arc::clone(&in_progress);
        tasks.spawn(notify_run(dispatcher, webhooks, in_progress, run_id, done));
    };
    loop {
        tokio::select! {
            Some(run_id) = ended.recv() => start(run_id, HashSet::new()),
            _ = ticker.tick() => {
                // The store is read at start, and after a run could not be queued: each
                // notification started here runs to its end, so nothing else is missed.
                if std::mem::take(&mut first) || dispatcher.ended.as_ref().is_some_and(|e| e.dropped.swap(false, Ordering::SeqCst)) {
                    for (run_id, done) in unfinished(&dispatcher).await {
                        start(run_id, done);
                    }
                }
            }
            () = shutdown.cancelled() => break,
        }
    }
    tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), tasks.wait()).await;
}

/// The runs that ended in the last hour, each with the hooks whose notification ended
/// (`delivered` or `gave_up`).
async fn unfinished(dispatcher: &Dispatcher) -> Vec<(Uuid, HashSet<String>)> {
    let since = proto::format_timestamp(SystemTime::now() - SCAN_WINDOW);
    let rows = match dispatcher.store.ended_with_webhooks(since).await {
        Ok(rows) => rows,
        Err(error) => {
            warn!(%error, "cannot read the runs that ended lately; their webhooks are checked again in a minute");
            return Vec::new();
        }
    };
    let mut runs: HashMap<Uuid, HashSet<String>> = HashMap::new();
    for (run_id, body) in rows {
        let done = runs.entry(run_id).or_default();
        let Some(body) = body else { continue };
        if let Ok(Event {
            kind: proto::EventKind::Webhook { hook, outcome, .. },
            ..
        }) = serde_json::from_str::<Event>(&body)
        {
            if outcome == "delivered" || outcome == "gave_up" {
                done.insert(hook);
            }
        }
    }
    runs.into_iter().collect()
}

/// Notifies each hook of the run's state that is not `done` nor in progress.
async fn notify_run(
    dispatcher: Arc<Dispatcher>,
    webhooks: Arc<Webhooks>,
    in_progress: InProgress,
    run_id: Uuid,
    done: HashSet<String>,
) {
    let record = match dispatcher.store.get_run(run_id).await {
        Ok(Some(record)) if record.state.is_terminal() => record,
        Ok(_) => return,
        Err(error) => {
            warn!(%run_id, %error, "cannot read the run to notify its webhooks; the minute's check will");
            return;
        }
    };
    let hooks: Vec<_> = webhooks
        .hooks_for(record.state)
        .into_iter()
        .filter(|hook| !done.contains(&hook.name))
        .filter(|hook| {
            let mut busy = in_progress.lock().unwrap_or_else(|e| e.into_inner());
            busy.insert((run_id, hook.name.clone()))
        })
        .collect();
    let (webhooks, in_progress) = (&webhooks, &in_progress);
    let notifications = hooks.iter().map(|hook| {
        let (dispatcher, record) = (&dispatcher, &record);
        async move {
            let store = |kind| async move {
                let event = Event::new(run_id, kind);
                if let Err(error) = dispatcher.store_event(&record.job, &event).await {
                    warn!(%run_id, %error, "cannot record a webhook attempt");
                }
            };
            webhooks.notify(hook, record, store).await;
            let mut busy = in_progress.lock().unwrap_or_else(|e| e.into_inner());
            busy.remove(&(run_id, hook.name.clone()));
        }
    });
    futures_util::future::join_all(notifications).await;
}
