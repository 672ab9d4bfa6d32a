//! Paused runs resume by themselves when their provider's pause ends (SPEC 6, `pause.json`):
//! a checkpoint that carries `resume_at` is scheduled as it is stored, and the schedule is
//! rebuilt from the paused runs when the dispatcher starts. A manual resume, a cancel or a
//! later pause of the same run makes the scheduled entry stale; it is then skipped.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use proto::{Checkpoint, RunState};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use uuid::Uuid;

use crate::dispatcher::Dispatcher;
use crate::store::{RunFilter, RunStore};

/// How often the schedule is looked at.
const TICK: Duration = Duration::from_secs(1);

/// The paused runs to resume, by time: `(when, run, checkpoint sequence)`.
#[derive(Debug, Default)]
pub struct Schedule(Mutex<BTreeSet<(SystemTime, Uuid, u32)>>);

impl Schedule {
    /// Schedules `run_id`'s resume from `checkpoint`, if it names a time.
    pub fn add(&self, run_id: Uuid, checkpoint: &Checkpoint) {
        let Some(at) = checkpoint.resume_at.as_deref().and_then(proto::parse_time) else {
            return;
        };
        let mut entries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        entries.insert((at, run_id, checkpoint.sequence));
    }

    /// Takes the entries due by `now`.
    fn due(&self, now: SystemTime) -> Vec<(Uuid, u32)> {
        let mut entries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let later = entries.split_off(&(now, Uuid::max(), u32::MAX));
        let due = std::mem::replace(&mut *entries, later);
        due.into_iter()
            .map(|(_, run, sequence)| (run, sequence))
            .collect()
    }
}

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

impl Schedule {
    /// Schedules an entry again in five seconds.
    fn retry(&self, run_id: Uuid, sequence: u32) {
        let at = SystemTime::now() + Duration::from_secs(5);
        let mut entries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        entries.insert((at, run_id, sequence));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a run resumed before its time, or never.
    #[test]
    fn entries_come_due_at_their_time() {
        let schedule = Schedule::default();
        let now = SystemTime::now();
        let (early, late) = (Uuid::new_v4(), Uuid::new_v4());
        let mut checkpoint = Checkpoint {
            sequence: 1,
            base: "b".into(),
            tree: "t".into(),
            patch: String::new(),
            state: proto::LoopState {
                machine: proto::MachineState {
                    phase: proto::Phase::Implement {
                        round: 1,
                        reason: proto::RoundReason::Initial,
                    },
                    limits: proto::Limits {
                        max_cycles: 0,
                        block_on_failure: false,
                        repair_budget: 0,
                        final_review: false,
                    },
                    implementation_rounds: 0,
                    repairs_used: 0,
                    cycles_used: 0,
                    review_exhausted: false,
                    last_failure: None,
                },
                history: vec![],
                rounds: vec![],
                checks: vec![],
                cycles: vec![],
                stage_count: 0,
                usage: None,
            },
            resume_at: None,
        };
        schedule.add(early, &checkpoint);
        assert!(
            schedule.due(now + Duration::from_secs(3600)).is_empty(),
            "no time, no entry"
        );
        checkpoint.resume_at = Some(proto::format_timestamp(now + Duration::from_secs(5)));
        schedule.add(early, &checkpoint);
        checkpoint.resume_at = Some(proto::format_timestamp(now + Duration::from_secs(60)));
        schedule.add(late, &checkpoint);
        assert!(schedule.due(now).is_empty());
        assert_eq!(schedule.due(now + Duration::from_secs(10)), [(early, 1)]);
        assert_eq!(schedule.due(now + Duration::from_secs(61)), [(late, 1)]);
        assert!(schedule.due(now + Duration::from_secs(3600)).is_empty());
    }
}
