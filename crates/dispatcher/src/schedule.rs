//! The schedule of paused runs that resume by themselves: `(when, run, checkpoint)`, in
//! time order. [`crate::resumer`] reads it; storing a checkpoint that names a time adds to it.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use proto::Checkpoint;
use uuid::Uuid;

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
    pub(crate) fn due(&self, now: SystemTime) -> Vec<(Uuid, u32)> {
        let mut entries = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let later = entries.split_off(&(now, Uuid::max(), u32::MAX));
        let due = std::mem::replace(&mut *entries, later);
        due.into_iter()
            .map(|(_, run, sequence)| (run, sequence))
            .collect()
    }
}

impl Schedule {
    /// Schedules an entry again in five seconds.
    pub(crate) fn retry(&self, run_id: Uuid, sequence: u32) {
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
