//! Events: what a worker reports about a run, stored by the dispatcher and streamed to watchers.
//!
//! Kinds: state changes, stage start and finish, log chunks, check results, cycle files,
//! heartbeats, checkpoints, cancel requests, pull requests, webhook attempts, transcripts and
//! the result.

use crate::Checkpoint;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::RunState;

/// One thing that happened to a run. Published on `run.{run_id}.{kind}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Always [`crate::SCHEMA_VERSION`] when written.
    pub schema_version: u32,
    /// Unique per event, so that a redelivered event is stored once.
    pub event_id: Uuid,
    /// The run the event belongs to.
    pub run_id: Uuid,
    /// When it happened (RFC 3339).
    pub time: String,
    /// The execution of the run that published it: each time a worker starts executing a run
    /// it draws a new one. Once a newer execution has started, events of an older one are
    /// kept as history and change nothing. `None` for events the dispatcher makes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub execution: Option<Uuid>,
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
}

impl Event {
    /// A new event for `run_id`, stamped now.
    pub fn new(run_id: Uuid, kind: EventKind) -> Event {
        Event {
            schema_version: crate::SCHEMA_VERSION,
            event_id: Uuid::new_v4(),
            run_id,
            time: crate::timestamp_now(),
            execution: None,
            kind,
        }
    }

    /// The same event, published by `execution`.
    pub fn by(mut self, execution: Uuid) -> Event {
        self.execution = Some(execution);
        self
    }

    /// The topic routing key: `run.{run_id}.{kind}`.
    pub fn routing_key(&self) -> String {
        format!("run.{}.{}", self.run_id, self.kind.name())
    }
}

/// The kinds of events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    /// The run changed state.
    State {
        /// The new state.
        state: RunState,
        /// Why, in words for a person.
        reason: String,
    },
    /// A stage container was started.
    StageStarted {
        /// Which stage.
        stage: Stage,
        /// The implementation round it belongs to (1-based).
        round: u32,
        /// The review cycle, for review stages.
        cycle: Option<u32>,
    },
    /// A stage container finished (or was stopped).
    StageFinished {
        /// Which stage.
        stage: Stage,
        /// The implementation round it belongs to.
        round: u32,
        /// The review cycle, for review stages.
        cycle: Option<u32>,
        /// The container's exit code; `None` when it never exited by itself.
        exit_code: Option<i64>,
        /// Wall time from create to removal.
        duration_seconds: f64,
        /// How it ended.
        outcome: StageOutcome,
        /// What the stage said it spent (its `usage.json`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<crate::Usage>,
    },
    /// A line a stage container wrote.
    Log {
        /// Which stage.
        stage: Stage,
        /// stdout or stderr.
        stream: LogStream,
        /// One or more complete lines, with secret values redacted.
        text: String,
    },
    /// A verification command's result.
    Check {
        /// The result.
        result: CheckResult,
    },
    /// A review cycle file appeared in the workspace.
    Cycle {
        /// The cycle.
        cycle: CycleRecord,
    },
    /// The worker is still working on the run.
    Heartbeat {
        /// The worker's identity.
        worker: String,
    },
    /// A paused run's progress, saved so that it can be resumed on any worker.
    Checkpoint {
        /// The saved progress.
        checkpoint: Checkpoint,
    },
    /// A user asked to cancel the running run: stored before the workers are told, and told
    /// again to whichever worker reports the run until it ends.
    CancelRequested {
        /// Who asked, or why.
        reason: String,
    },
    /// The delivered branch's pull request was opened or updated.
    PullRequest {
        /// Its address.
        url: String,
        /// `opened` or `updated`.
        action: String,
    },
    /// One attempt to notify a webhook of the run's terminal state (SPEC 9), recorded by the
    /// dispatcher.
    Webhook {
        /// The webhook's name in the webhooks file (never its URL, which may be a secret).
        hook: String,
        /// 1 for the first attempt.
        attempt: u32,
        /// The receiver's HTTP status, when it answered.
        status: Option<u16>,
        /// Why the attempt failed, when it did.
        error: Option<String>,
        /// `delivered`, `retrying` (another attempt follows) or `gave_up`.
        outcome: String,
    },
    /// What the dispatcher did on the run's tracker (SPEC 17): a comment written or edited,
    /// a reaction, a refusal answered.
    Tracker {
        /// The tracker's name in the trackers file.
        tracker: String,
        /// `comment`, `edit`, `react`.
        action: String,
        /// The tracker's HTTP status, when it answered.
        status: Option<u16>,
        /// Why it failed, when it did (never the token).
        error: Option<String>,
    },
    /// What an agent kind's stage said and did (SPEC 16), read from its CLI's output when
    /// the stage ended; published just before its `stage_finished`.
    Transcript {
        /// Which stage.
        stage: Stage,
        /// The implementation round it belongs to.
        round: u32,
        /// The review cycle, for review stages.
        cycle: Option<u32>,
        /// The agent kind that ran.
        agent: crate::AgentKind,
        /// The conversation, bounded.
        transcript: crate::Transcript,
    },
    /// The run's final result; always followed by a terminal `state` event.
    Result {
        /// The result.
        result: RunResult,
    },
}

impl EventKind {
    /// The short name used in routing keys and the store.
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::State { .. } => "state",
            EventKind::StageStarted { .. } => "stage_started",
            EventKind::StageFinished { .. } => "stage_finished",
            EventKind::Log { .. } => "log",
            EventKind::Check { .. } => "check",
            EventKind::Cycle { .. } => "cycle",
            EventKind::Heartbeat { .. } => "heartbeat",
            EventKind::Checkpoint { .. } => "checkpoint",
            EventKind::CancelRequested { .. } => "cancel_requested",
            EventKind::Webhook { .. } => "webhook",
            EventKind::Tracker { .. } => "tracker",
            EventKind::PullRequest { .. } => "pull_request",
            EventKind::Transcript { .. } => "transcript",
            EventKind::Result { .. } => "result",
        }
    }
}

/// A stage of the run loop (SPEC 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The implementer changes the source.
    Implement,
    /// A verification command checks it.
    Verify,
    /// The reviewer judges it against `review.md`.
    Review,
    /// The independent final reviewer writes `review.json`.
    FinalReview,
}

impl Stage {
    /// The snake_case name, also used as a container label and a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Implement => "implement",
            Stage::Verify => "verify",
            Stage::Review => "review",
            Stage::FinalReview => "final_review",
        }
    }
}

/// Which output stream a log line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogStream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// A review cycle file (SPEC 8), as collected from `.forge/{step}/review_cycle_{N}.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CycleRecord {
    /// The step folder the file was found in.
    pub step: String,
    /// The file name, `review_cycle_{N}.json`.
    pub file: String,
    /// N.
    pub cycle: u32,
    /// The cycle limit the file states.
    pub max_cycles: Option<u32>,
    /// `approved` or `rejected`, lowercased.
    pub verdict: String,
    /// The reviewer's feedback.
    pub feedback: String,
    /// The whole file, exactly as written.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub content: serde_json::Value,
    /// Who wrote it: forgepool's own review, or a container's own loop. A container's file
    /// never replaces forgepool's record of the same name.
    #[serde(default)]
    pub origin: CycleOrigin,
}

/// How a stage container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageOutcome {
    /// It exited 0.
    Completed,
    /// It exited with another code, or the runtime failed it.
    Failed,
    /// It ran past its time limit and was stopped.
    TimedOut,
    /// It exited 75: its provider paused.
    Paused,
    /// The run was cancelled, or the worker stopped it.
    Cancelled,
}

impl StageOutcome {
    /// The wire name, also the metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            StageOutcome::Completed => "completed",
            StageOutcome::Failed => "failed",
            StageOutcome::TimedOut => "timed_out",
            StageOutcome::Paused => "paused",
            StageOutcome::Cancelled => "cancelled",
        }
    }
}

/// Who wrote a review cycle file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CycleOrigin {
    /// A stage container wrote it into `/workspace/.forge/` for its own review loop.
    #[default]
    Container,
    /// forgepool wrote it from the review stage that produced it.
    Forgepool,
}

/// The start of the reason of the `queued` state a resume records.
pub const RESUMED_REASON: &str = "resumed by request";
/// How the reason of a `queued` state begins when a paused run resumed by itself (its
/// profile's pause ended).
pub const AUTO_RESUMED_REASON: &str = "resumed by itself";

/// The `queued` state event that resumes `run_id` from `checkpoint`.
pub fn resumed_event(run_id: Uuid, checkpoint: &Checkpoint) -> Event {
    Event::new(
        run_id,
        EventKind::State {
            state: RunState::Queued,
            reason: format!("{RESUMED_REASON} from checkpoint {}", checkpoint.sequence),
        },
    )
}

/// The checkpoint saved by a run's latest pause, from its events in the order they were
/// stored; `None` when that pause saved none (an older checkpoint is never used: its
/// execution has already run).
pub fn latest_checkpoint<'a>(
    events: impl DoubleEndedIterator<Item = &'a Event>,
) -> Option<Checkpoint> {
    let mut events = events.rev();
    // The latest pause's `state` event comes last; its checkpoint is published before it.
    events.find(|e| {
        matches!(
            e.kind,
            EventKind::State {
                state: RunState::Paused,
                ..
            }
        )
    })?;
    for event in events {
        match &event.kind {
            EventKind::Checkpoint { checkpoint } => return Some(checkpoint.clone()),
            EventKind::State { .. } => return None,
            _ => {}
        }
    }
    None
}

/// The largest checkpoint patch, so that a resumed job still fits in a queue message.
pub const MAX_CHECKPOINT_PATCH_BYTES: usize = 3 * 1024 * 1024;

/// One verification command's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckResult {
    /// The implementation round whose source was checked.
    pub round: u32,
    /// The command.
    pub argv: Vec<String>,
    /// Its exit code; `None` when it timed out.
    pub exit_code: Option<i64>,
    /// Wall time of its container.
    pub duration_seconds: f64,
    /// The last lines of its output.
    pub output_tail: String,
}

/// One completed implementation round, as kept in `repair_history`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RoundRecord {
    /// The round number (1-based).
    pub round: u32,
    /// Why the round ran: `initial`, `review` or `repair`.
    pub reason: String,
    /// The git tree the implementer left.
    pub tree: String,
    /// The failing commands with their exit codes (empty when verification passed).
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Vec<serde_json::Value>>))]
    pub failing: Vec<(Vec<String>, Option<i64>)>,
    /// The tail of the first failing command's output.
    pub output_tail: String,
}

/// The final outcome of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunResult {
    /// The terminal state the run ends in.
    pub state: RunState,
    /// Why it ended there.
    pub reason: String,
    /// The delivered branch, when delivered.
    pub branch: Option<String>,
    /// The delivered commit id, when delivered.
    pub commit: Option<String>,
    /// The tree that was verified and reviewed.
    pub tree: Option<String>,
    /// The Markdown report, suitable as a pull-request body.
    pub report: String,
    /// Warnings: from submission and from the run (review exhausted).
    pub warnings: Vec<String>,
    /// The frozen repair budget.
    pub repair_budget: u32,
    /// Completed implementer containers.
    pub implementation_rounds: u32,
    /// One record per completed implementation round.
    pub repair_history: Vec<RoundRecord>,
    /// The final review: `not_requested`, `approved`, `changes_required`, `refused` (its
    /// report failed validation) or `not_run` (the run ended before it).
    pub review: String,
    /// The delivered branch's pull request, when the forge has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_request: Option<String>,
    /// What the run's stages said they spent, summed; absent when none said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::UsageTotals>,
    /// The delivered change from the base, as a unified diff (at most [`MAX_CHANGE_BYTES`];
    /// a longer one is cut at a line and says so); absent when nothing was delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change: Option<String>,
    /// The independent final review's report, when one was accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_review: Option<crate::FinalReport>,
}

/// The most bytes of a delivered change [`RunResult::change`] carries.
pub const MAX_CHANGE_BYTES: usize = 512 * 1024;

/// `diff` cut to [`MAX_CHANGE_BYTES`] at the end of a line, with a last line saying so.
pub fn cut_change(mut diff: String) -> String {
    if diff.len() <= MAX_CHANGE_BYTES {
        return diff;
    }
    let total = diff.len();
    let mut limit = MAX_CHANGE_BYTES;
    while !diff.is_char_boundary(limit) {
        limit -= 1;
    }
    let end = diff[..limit].rfind('\n').map_or(0, |at| at + 1);
    diff.truncate(end);
    diff.push_str(&format!(
        "[forgepool: the change is {total} bytes; the first {end} are shown]\n"
    ));
    diff
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a long change kept whole in the result (and the event, and the store), or cut
    /// inside a line or a character.
    #[test]
    fn a_long_change_is_cut_at_a_line_and_says_so() {
        let short = "+ä\n".repeat(10);
        assert_eq!(cut_change(short.clone()), short);
        let long = "+ä line\n".repeat(MAX_CHANGE_BYTES / 4);
        let cut = cut_change(long.clone());
        let (kept, note) = cut.trim_end().rsplit_once('\n').unwrap();
        assert!(kept.len() < MAX_CHANGE_BYTES && long.starts_with(kept));
        assert!(kept.ends_with("+ä line"), "cut inside a line");
        assert!(
            note.contains(&format!("the change is {} bytes", long.len())),
            "{note}"
        );
    }

    #[test]
    fn events_are_tagged_and_routed_by_kind() {
        let run_id = Uuid::new_v4();
        let event = Event::new(
            run_id,
            EventKind::State {
                state: RunState::Running,
                reason: "picked up".into(),
            },
        );
        let text = serde_json::to_string(&event).unwrap();
        assert!(text.contains("\"type\":\"state\""), "{text}");
        assert!(text.contains("\"schema_version\":1"), "{text}");
        assert_eq!(event.routing_key(), format!("run.{run_id}.state"));
        let again: Event = serde_json::from_str(&text).unwrap();
        assert_eq!(again, event);
    }

    #[test]
    fn cycle_events_round_trip() {
        let content = serde_json::json!({"cycle": 1, "verdict": "rejected"});
        let event = Event::new(
            Uuid::new_v4(),
            EventKind::Cycle {
                cycle: CycleRecord {
                    step: "implement_task".into(),
                    file: "review_cycle_1.json".into(),
                    cycle: 1,
                    max_cycles: Some(3),
                    verdict: "rejected".into(),
                    feedback: "Missing tests".into(),
                    content,
                    origin: Default::default(),
                },
            },
        );
        let again: Event = serde_json::from_str(&serde_json::to_string(&event).unwrap()).unwrap();
        assert_eq!(again, event);
    }

    #[test]
    fn only_the_latest_pause_s_checkpoint_is_used() {
        let run_id = Uuid::new_v4();
        let state = |state| {
            Event::new(
                run_id,
                EventKind::State {
                    state,
                    reason: String::new(),
                },
            )
        };
        let checkpoint = |sequence| {
            Event::new(
                run_id,
                EventKind::Checkpoint {
                    checkpoint: Checkpoint {
                        resume_at: None,
                        sequence,
                        base: "b".into(),
                        tree: "t".into(),
                        patch: String::new(),
                        state: crate::checkpoint::sample_loop_state(),
                    },
                },
            )
        };
        let first = vec![
            state(RunState::Running),
            checkpoint(1),
            state(RunState::Paused),
        ];
        assert_eq!(latest_checkpoint(first.iter()).map(|c| c.sequence), Some(1));
        let mut second = first.clone();
        second.extend([
            state(RunState::Queued),
            state(RunState::Running),
            state(RunState::Paused),
        ]);
        assert_eq!(
            latest_checkpoint(second.iter()),
            None,
            "a pause that saved nothing never falls back to an older checkpoint"
        );
        let mut resumed = first.clone();
        resumed.push(state(RunState::Queued));
        assert_eq!(
            latest_checkpoint(resumed.iter()).map(|c| c.sequence),
            Some(1),
            "a resume whose job was not queued can be asked again"
        );
        assert_eq!(latest_checkpoint([state(RunState::Running)].iter()), None);
    }
}
