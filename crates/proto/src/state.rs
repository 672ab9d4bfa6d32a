//! Run states (SPEC 10) and what they mean to a waiting CLI.

use serde::{Deserialize, Serialize};

/// The state of a run. Every change is an event stored with its time and reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Accepted and waiting for a worker.
    Queued,
    /// A worker is running its stages.
    Running,
    /// A provider paused the run (exit 75); it continues on resume.
    Paused,
    /// Delivered with every review approved.
    Delivered,
    /// Delivered although review was exhausted without approval.
    DeliveredWithWarnings,
    /// Stopped by a rule (rejections with `block_on_failure`, failed checks, final review).
    Blocked,
    /// Stopped by an error (a stage crashed, an image is missing, delivery failed).
    Failed,
    /// Cancelled by a user.
    Cancelled,
}

impl RunState {
    /// All states, in lifecycle order.
    pub const ALL: [RunState; 8] = [
        RunState::Queued,
        RunState::Running,
        RunState::Paused,
        RunState::Delivered,
        RunState::DeliveredWithWarnings,
        RunState::Blocked,
        RunState::Failed,
        RunState::Cancelled,
    ];

    /// Whether the run can never change state again.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            RunState::Delivered
                | RunState::DeliveredWithWarnings
                | RunState::Blocked
                | RunState::Failed
                | RunState::Cancelled
        )
    }

    /// Whether a run in this state may move to `next`: the one transition rule both stores
    /// apply. A terminal state is never left (a late or duplicated event of an execution that
    /// ended is kept as history, and changes nothing); every other state may move to any.
    pub fn accepts(self, next: RunState) -> bool {
        let _ = next;
        !self.is_terminal()
    }

    /// The CLI exit code for a run that ended in this state (SPEC 10); `None` while it is live.
    ///
    /// A paused run is reported with 75 (`EX_TEMPFAIL`), the same code a provider uses to pause.
    pub fn exit_code(self) -> Option<i32> {
        match self {
            RunState::Delivered | RunState::DeliveredWithWarnings => Some(0),
            RunState::Blocked => Some(3),
            RunState::Failed | RunState::Cancelled => Some(1),
            RunState::Paused => Some(75),
            RunState::Queued | RunState::Running => None,
        }
    }

    /// The snake_case name used on the wire and in the store.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Queued => "queued",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Delivered => "delivered",
            RunState::DeliveredWithWarnings => "delivered_with_warnings",
            RunState::Blocked => "blocked",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
        }
    }

    /// Parses the snake_case name.
    pub fn parse(name: &str) -> Option<RunState> {
        RunState::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_terminal_state_is_never_left_and_a_live_one_goes_anywhere() {
        use RunState::*;
        for from in RunState::ALL {
            for to in RunState::ALL {
                let expected = matches!(from, Queued | Running | Paused);
                assert_eq!(from.accepts(to), expected, "{from} -> {to}");
            }
        }
    }
    use super::*;

    #[test]
    fn names_round_trip_through_serde_and_parse() {
        for state in RunState::ALL {
            let json = serde_json::to_string(&state).unwrap();
            assert_eq!(json, format!("\"{}\"", state.as_str()));
            assert_eq!(RunState::parse(state.as_str()), Some(state));
        }
    }

    #[test]
    fn exit_codes_follow_spec_10() {
        assert_eq!(RunState::Delivered.exit_code(), Some(0));
        assert_eq!(RunState::DeliveredWithWarnings.exit_code(), Some(0));
        assert_eq!(RunState::Blocked.exit_code(), Some(3));
        assert_eq!(RunState::Failed.exit_code(), Some(1));
        assert_eq!(RunState::Cancelled.exit_code(), Some(1));
        assert_eq!(RunState::Running.exit_code(), None);
    }
}
