//! What a paused run keeps (its checkpoint: the source it reached and the run loop's state)
//! and what a final review leaves (its receipt). Both cross the broker and the store inside
//! versioned messages: a checkpoint inside its job and event, a receipt as a message of its
//! own with its `schema_version`.
//!
//! A `Checkpoint` holds the base commit, the tree the paused phase starts from, the change as an
//! all-binary git patch, and the typed `LoopState` (the run machine's `MachineState`, `Phase`,
//! `RoundReason`, `Limits`, and the rounds, checks, cycles and history). Checkpoints live in the
//! run store (as an event), not in the user's repository: resuming needs no push rights and
//! leaves no stray refs. The patch is capped at 3 MiB so the resumed job fits a queue message; a
//! larger change pauses without a checkpoint, and the reason says to submit a new run.

use serde::{Deserialize, Serialize};

use crate::{CheckResult, CycleRecord, RoundRecord, RunState};

/// Where a paused run stopped: the source it had reached and the loop's state, enough for any
/// worker to continue it with the same frozen job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    /// 1 for the first pause of a run, 2 for the next, and so on.
    pub sequence: u32,
    /// The commit the run started from.
    pub base: String,
    /// The git tree the run had reached (the last completed round's, or the base's).
    pub tree: String,
    /// The change from `base` to `tree`, every file encoded as binary (ASCII only); replaying
    /// it on `base` must give `tree` exactly.
    pub patch: String,
    /// The run loop's state.
    pub state: LoopState,
    /// When the run paused for a profile whose provider gave a time (`pause.json`): the time
    /// it resumes by itself, RFC 3339 UTC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_at: Option<String>,
}

/// The run loop's state kept by a checkpoint: the machine, and what the prompts, the history
/// and the report are built from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoopState {
    /// The machine; its phase is the one to repeat on resume.
    pub machine: MachineState,
    /// The history given to the implementer (`/forge/input/history.json`).
    pub history: Vec<serde_json::Value>,
    /// The implementation rounds so far.
    pub rounds: Vec<RoundRecord>,
    /// The checks run so far.
    pub checks: Vec<CheckResult>,
    /// The cycle files collected so far.
    pub cycles: Vec<CycleRecord>,
    /// How many stages ran, for the names of their folders.
    pub stage_count: u32,
    /// What the stages so far said they spent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::UsageTotals>,
}

/// The run machine's fields: the phase and the counters its rules depend on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineState {
    /// What happens next.
    pub phase: Phase,
    /// The limits when it was saved (a resume takes the job's).
    pub limits: Limits,
    /// Completed implementer containers.
    pub implementation_rounds: u32,
    /// Repair rounds started after failed checks.
    pub repairs_used: u32,
    /// Review cycles performed.
    pub cycles_used: u32,
    /// Every review cycle was rejected and the run went on without approval.
    pub review_exhausted: bool,
    /// The previous completed round's failure, for the no-progress guard.
    pub last_failure: Option<(String, FailureSignature)>,
}

/// A failing verification signature: each failing command's argv and exit code.
pub type FailureSignature = Vec<(Vec<String>, Option<i64>)>;

/// The limits frozen into a job that the loop obeys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Review cycles allowed; 0 when the skill has no reviewer.
    pub max_cycles: u32,
    /// End blocked when every cycle was rejected.
    pub block_on_failure: bool,
    /// Repair rounds allowed after failed checks.
    pub repair_budget: u32,
    /// Whether an independent final review was requested.
    pub final_review: bool,
}

/// Why an implementation round runs, and the feedback it receives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum RoundReason {
    /// The first round.
    Initial,
    /// A reviewer rejected the previous round; its feedback.
    Review(String),
    /// Verification failed; the failed checks, formatted for the prompt.
    Repair(String),
}

impl RoundReason {
    /// The short name kept in `repair_history`.
    pub fn name(&self) -> &'static str {
        match self {
            RoundReason::Initial => "initial",
            RoundReason::Review(_) => "review",
            RoundReason::Repair(_) => "repair",
        }
    }
}

/// What the run does next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// Run the implementer for `round`.
    Implement {
        /// The 1-based implementation round.
        round: u32,
        /// Why, with the feedback to inject.
        reason: RoundReason,
    },
    /// Run every verification command over `tree`.
    Verify {
        /// The round whose result is checked.
        round: u32,
        /// The tree the implementer left.
        tree: String,
    },
    /// Run review cycle `cycle` over `tree`.
    Review {
        /// The round whose result is reviewed.
        round: u32,
        /// The 1-based cycle.
        cycle: u32,
        /// The verified tree.
        tree: String,
    },
    /// Run the independent final review over `tree`.
    FinalReview {
        /// The verified (and approved) tree.
        tree: String,
    },
    /// Commit and push `tree`.
    Deliver {
        /// The tree to deliver; delivery refuses if the workspace no longer matches it.
        tree: String,
    },
    /// A provider paused the run; `resume` is the phase to return to.
    Paused {
        /// The phase interrupted by the pause, repeated on resume.
        resume: Box<Phase>,
        /// What the stage said.
        reason: String,
    },
    /// The run ended.
    Finished {
        /// The terminal state.
        state: RunState,
        /// Why.
        reason: String,
    },
}

impl Phase {
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Implement { .. } => "implement",
            Phase::Verify { .. } => "verify",
            Phase::Review { .. } => "review",
            Phase::FinalReview { .. } => "final_review",
            Phase::Deliver { .. } => "deliver",
            Phase::Paused { .. } => "paused",
            Phase::Finished { .. } => "finished",
        }
    }
}

/// A validated report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FinalReport {
    /// `approved` or `changes_required`.
    pub approved: bool,
    /// The reviewer's summary.
    pub summary: String,
    /// The findings, each checked against the source.
    pub findings: Vec<Finding>,
}

/// One finding of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Finding {
    /// `low`, `medium`, `high` or `critical`.
    pub severity: String,
    /// A relative source path.
    pub path: String,
    /// A 1-based line in that file.
    pub line: u64,
    /// What is wrong.
    pub summary: String,
    /// Text quoted from the file.
    pub evidence: String,
}

/// A running run's progress, kept on the broker after each completed stage: the checkpoint a
/// later execution of the run (after a hand-over or a lost worker) continues from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Progress {
    /// Always [`crate::SCHEMA_VERSION`] when written; readers refuse other versions.
    pub schema_version: u32,
    /// The run.
    pub run_id: uuid::Uuid,
    /// Where it stands: the phase to run next, and the source so far.
    pub checkpoint: Checkpoint,
}

/// The receipt of a final review: the validated report, kept with the tree it reviewed, in the
/// final review ledger on the broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReviewReceipt {
    /// Always [`crate::SCHEMA_VERSION`] when written; readers refuse other versions.
    pub schema_version: u32,
    /// The reviewed tree.
    pub tree: String,
    /// The validated report.
    pub report: FinalReport,
}

#[cfg(test)]
pub(crate) fn sample_loop_state() -> LoopState {
    LoopState {
        usage: None,
        machine: MachineState {
            phase: Phase::Implement {
                round: 1,
                reason: RoundReason::Initial,
            },
            limits: Limits {
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
        history: Vec::new(),
        rounds: Vec::new(),
        checks: Vec::new(),
        cycles: Vec::new(),
        stage_count: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a change of the checkpoint's shape that a paused run stored before it can no
    /// longer be resumed from.
    #[test]
    fn a_loop_state_keeps_the_shape_checkpoints_were_stored_in() {
        let stored = serde_json::json!({
            "machine": {
                "phase": {"Review": {"round": 2, "cycle": 1, "tree": "abc"}},
                "limits": {"max_cycles": 3, "block_on_failure": true, "repair_budget": 1, "final_review": false},
                "implementation_rounds": 2, "repairs_used": 1, "cycles_used": 0,
                "review_exhausted": false,
                "last_failure": ["t", [[["make", "test"], 2]]]
            },
            "history": [{"round": 1}], "rounds": [], "checks": [], "cycles": [], "stage_count": 4
        });
        let state: LoopState = serde_json::from_value(stored.clone()).expect("it reads");
        assert_eq!(state.machine.repairs_used, 1);
        assert!(matches!(
            state.machine.phase,
            Phase::Review { cycle: 1, .. }
        ));
        assert_eq!(serde_json::to_value(&state).unwrap(), stored);
    }
}
