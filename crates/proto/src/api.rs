//! The HTTP API's documents and the control messages (SPEC 12).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{CycleRecord, RoundRecord, RunResult, RunState};

/// `201` answer to `POST /v1/runs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubmitResponse {
    /// The new run's id.
    pub run_id: Uuid,
    /// Always `queued`.
    pub state: RunState,
    /// Warnings found while freezing the request.
    pub warnings: Vec<String>,
}

/// One state change in a run's history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateChange {
    /// The state entered.
    pub state: RunState,
    /// Why.
    pub reason: String,
    /// When (RFC 3339).
    pub time: String,
}

/// `GET /v1/runs/{id}`: everything about a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunView {
    /// The run id.
    pub run_id: Uuid,
    /// The ticket.
    pub ticket: String,
    /// The skill.
    pub skill: String,
    /// The step.
    pub step: String,
    /// The current state.
    pub state: RunState,
    /// Every state change.
    pub states: Vec<StateChange>,
    /// Warnings from submission.
    pub warnings: Vec<String>,
    /// The frozen repair budget.
    pub repair_budget: u32,
    /// Completed implementation rounds (from the result, once there is one).
    pub implementation_rounds: u32,
    /// One record per completed implementation round.
    pub repair_history: Vec<RoundRecord>,
    /// Every review cycle file.
    pub cycles: Vec<CycleRecord>,
    /// The result, once the run ended.
    pub result: Option<RunResult>,
    /// The Markdown report, once the run ended.
    pub report: Option<String>,
    /// The agent profile whose cap (`max_concurrent`) the queued run waits for.
    #[serde(default)]
    pub waiting_for_profile: Option<String>,
    /// What the run's stages said they spent (`usage.json`), once the run ended or paused.
    #[serde(default)]
    pub usage: Option<crate::UsageTotals>,
    /// The run's spending limit, from the request.
    #[serde(default)]
    pub budget: Option<crate::Budget>,
}

/// One entry of `GET /v1/runs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSummary {
    /// The run id.
    pub run_id: Uuid,
    /// The ticket.
    pub ticket: String,
    /// The current state.
    pub state: RunState,
    /// When it was accepted.
    pub created_at: String,
    /// When it last changed.
    pub updated_at: String,
}

/// `GET /v1/runs`: a page of runs, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunList {
    /// The runs.
    pub runs: Vec<RunSummary>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// The error document of every 4xx and 5xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// The error.
    pub error: ApiErrorBody,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiErrorBody {
    /// A stable code (`invalid_field`, `unknown_skill`, `not_found`, `unauthorized`…).
    pub code: String,
    /// A sentence for a person.
    pub message: String,
    /// The field at fault, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// A control message from the dispatcher to the workers, on `cancel.{run_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Control {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The run.
    pub run_id: Uuid,
    /// What to do.
    pub action: ControlAction,
}

/// What a control message asks of the worker running a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ControlAction {
    /// Stop the run's containers; the run ends `cancelled`.
    Cancel,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_documents_round_trip() {
        let error = ApiError {
            error: ApiErrorBody {
                code: "invalid_field".into(),
                message: "ticket: bad".into(),
                field: Some("ticket".into()),
            },
        };
        let text = serde_json::to_string(&error).unwrap();
        assert_eq!(
            text,
            r#"{"error":{"code":"invalid_field","message":"ticket: bad","field":"ticket"}}"#
        );
        assert_eq!(serde_json::from_str::<ApiError>(&text).unwrap(), error);
        let control = Control {
            schema_version: 1,
            run_id: Uuid::new_v4(),
            action: ControlAction::Cancel,
        };
        let again: Control =
            serde_json::from_str(&serde_json::to_string(&control).unwrap()).unwrap();
        assert_eq!(again, control);
    }
}
