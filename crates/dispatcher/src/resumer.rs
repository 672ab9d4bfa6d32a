//! Paused runs resume by themselves when their provider's pause ends (SPEC 6, `pause.json`):
//! a checkpoint that carries `resume_at` is scheduled as it is stored, and the schedule is
//! rebuilt from the paused runs when the dispatcher starts. A manual resume, a cancel or a
//! later pause of the same run makes the scheduled entry stale; it is then skipped.
//!
//! `resume_when_due` rebuilds the schedule at start, then queues each run again at its time if it
//! is still paused at that checkpoint (`FORGEPOOL_AUTO_RESUME`).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proto::RunState;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::dispatcher::Dispatcher;
use crate::schedule::Due;
use crate::store::{RunFilter, RunStore};

/// How often the schedule is looked at.
const TICK: Duration = Duration::from_secs(1);

/// How long a run whose resume came due may take to reach `paused` (its checkpoint is
/// stored just before its `paused` state): tried every second this many times.
const NOT_YET_PAUSED_ATTEMPTS: u32 = 60;

/// Rebuilds the schedule from the paused runs (trying again until the store answers), then
/// resumes each run when its time comes, until `shutdown`.
pub async fn resume_when_due(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_secs(1);
    while let Err(error) = rebuild(&dispatcher).await {
        warn!(%error, "cannot read the paused runs yet; trying again");
        tokio::select! {
            () = tokio::time::sleep(backoff) => {},
            () = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
    loop {
        tokio::select! {
            () = tokio::time::sleep(TICK) => {},
            () = shutdown.cancelled() => return,
        }
        for due in dispatcher.resumes.due(SystemTime::now()) {
            resume_one(&dispatcher, due).await;
        }
    }
}

/// Schedules every paused run whose latest checkpoint names a time.
async fn rebuild(dispatcher: &Dispatcher) -> Result<(), crate::store::StoreError> {
    let mut cursor = None;
    loop {
        let filter = RunFilter {
            state: Some(RunState::Paused),
            ticket: None,
            skill: None,
            limit: 200,
            cursor,
        };
        let (runs, next) = dispatcher.store.list_runs(filter).await?;
        for run in runs {
            let events = dispatcher.store.events(run.run_id, 0).await?;
            if let Some(checkpoint) = proto::latest_checkpoint(events.iter().map(|(_, e)| e)) {
                dispatcher.resumes.add(run.run_id, &checkpoint);
            }
        }
        match next {
            Some(next) => cursor = Some(next),
            None => return Ok(()),
        }
    }
}

/// Resumes a run that came due if it is still paused at the entry's checkpoint; a run not
/// paused yet (its `paused` state follows its checkpoint) and a failure to queue it are tried
/// again a little later.
async fn resume_one(dispatcher: &Dispatcher, due: Due) {
    let (run_id, sequence, attempts) = due;
    let record = match dispatcher.store.get_run(run_id).await {
        Ok(Some(record)) if record.state == RunState::Paused => record,
        Ok(Some(record))
            if matches!(record.state, RunState::Running | RunState::Queued)
                && attempts < NOT_YET_PAUSED_ATTEMPTS =>
        {
            dispatcher.resumes.retry(due, Duration::from_secs(1));
            return;
        }
        Ok(_) => return,
        Err(error) => {
            warn!(%run_id, %error, "cannot read a run due to resume; trying again");
            dispatcher.resumes.retry(due, Duration::from_secs(5));
            return;
        }
    };
    match dispatcher.resume_automatically(&record, sequence).await {
        Ok(true) => {
            info!(%run_id, sequence, "the run resumed by itself: its profile's pause ended")
        }
        Ok(false) => {}
        Err(error) => {
            warn!(%run_id, %error, "cannot resume the run by itself yet; trying again");
            dispatcher.resumes.retry(due, Duration::from_secs(5));
        }
    }
}
