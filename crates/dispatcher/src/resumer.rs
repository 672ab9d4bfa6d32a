//! Paused runs resume by themselves when their provider's pause ends (SPEC 6, `pause.json`):
//! a checkpoint that carries `resume_at` is scheduled as it is stored, and the schedule is
//! rebuilt from the paused runs when the dispatcher starts. A manual resume, a cancel or a
//! later pause of the same run makes the scheduled entry stale; it is then skipped.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proto::RunState;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use crate::dispatcher::Dispatcher;
use crate::store::{RunFilter, RunStore};

/// How often the schedule is looked at.
const TICK: Duration = Duration::from_secs(1);

/// Rebuilds the schedule from the paused runs, then resumes each run when its time comes,
/// until `shutdown`.
pub async fn resume_when_due(dispatcher: Arc<Dispatcher>, shutdown: CancellationToken) {
    if let Err(error) = rebuild(&dispatcher).await {
        warn!(%error, "cannot read the paused runs; only runs paused from now on resume by themselves");
    }
    loop {
        tokio::select! {
            () = tokio::time::sleep(TICK) => {},
            () = shutdown.cancelled() => return,
        }
        for (run_id, sequence) in dispatcher.resumes.due(SystemTime::now()) {
            resume_one(&dispatcher, run_id, sequence).await;
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

/// Resumes `run_id` if it is still paused at checkpoint `sequence`; a failure to queue it is
/// tried again a little later.
async fn resume_one(dispatcher: &Dispatcher, run_id: Uuid, sequence: u32) {
    let record = match dispatcher.store.get_run(run_id).await {
        Ok(Some(record)) if record.state == RunState::Paused => record,
        Ok(_) => return,
        Err(error) => {
            warn!(%run_id, %error, "cannot read a run due to resume; trying again");
            dispatcher.resumes.retry(run_id, sequence);
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
            dispatcher.resumes.retry(run_id, sequence);
        }
    }
}
