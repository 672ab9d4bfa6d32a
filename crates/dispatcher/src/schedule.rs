//! The schedule of paused runs that resume by themselves: `(when, run, checkpoint)`, in
//! time order. [`crate::resumer`] reads it; storing a checkpoint that names a time adds to it.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use proto::Checkpoint;
use uuid::Uuid;

/// The paused runs to resume, by time: `(when, run, checkpoint sequence, attempts)`.
#[derive(Debug)]
pub struct Schedule {
    entries: Mutex<BTreeSet<(SystemTime, Uuid, u32, u32)>>,
    /// `FORGEPOOL_AUTO_RESUME`: without it nothing is scheduled.
    enabled: bool,
}

impl Default for Schedule {
    fn default() -> Schedule {
        Schedule::new(true)
    }
}

/// An entry that came due: the run, its checkpoint's sequence, and how often it was tried.
pub(crate) type Due = (Uuid, u32, u32);

impl Schedule {
    /// A schedule; a disabled one schedules nothing.
    pub fn new(enabled: bool) -> Schedule {
        Schedule {
            entries: Mutex::new(BTreeSet::new()),
            enabled,
        }
    }

    /// Schedules `run_id`'s resume from `checkpoint`, if it names a time.
    pub fn add(&self, run_id: Uuid, checkpoint: &Checkpoint) {
        let Some(at) = checkpoint.resume_at.as_deref().and_then(proto::parse_time) else {
            return;
        };
        self.insert(at, (run_id, checkpoint.sequence, 0));
    }

    /// Takes the entries due by `now`.
    pub(crate) fn due(&self, now: SystemTime) -> Vec<Due> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let later = entries.split_off(&(now, Uuid::max(), u32::MAX, u32::MAX));
        let due = std::mem::replace(&mut *entries, later);
        due.into_iter()
            .map(|(_, run, sequence, attempts)| (run, sequence, attempts))
            .collect()
    }

    /// Schedules an entry that came due again `after` from now, one attempt more.
    pub(crate) fn retry(&self, (run_id, sequence, attempts): Due, after: Duration) {
        let at = SystemTime::now() + after;
        self.insert(at, (run_id, sequence, attempts.saturating_add(1)));
    }

    fn insert(&self, at: SystemTime, (run_id, sequence, attempts): Due) {
        if !self.enabled {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.insert((at, run_id, sequence, attempts));
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
        assert_eq!(schedule.due(now + Duration::from_secs(10)), [(early, 1, 0)]);
        assert_eq!(schedule.due(now + Duration::from_secs(61)), [(late, 1, 0)]);
        assert!(schedule.due(now + Duration::from_secs(3600)).is_empty());
        schedule.retry((late, 1, 0), Duration::ZERO);
        assert_eq!(
            schedule.due(SystemTime::now() + Duration::from_secs(1)),
            [(late, 1, 1)]
        );
        let off = Schedule::new(false);
        off.add(early, &checkpoint);
        assert!(
            off.due(now + Duration::from_secs(3600)).is_empty(),
            "disabled"
        );
    }
}
