//! The HTTP API's documents and the control messages (SPEC 12).

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{CycleRecord, RoundRecord, RunResult, RunState};

/// `201` answer to `POST /v1/runs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// The skill.
    #[serde(default)]
    pub skill: String,
    /// The implementer's agent profile.
    #[serde(default)]
    pub profile: String,
    /// Completed implementation rounds (known once the run ended).
    #[serde(default)]
    pub rounds: u32,
    /// Review cycle files collected so far.
    #[serde(default)]
    pub cycles: u32,
}

/// `GET /v1/pool`: the pool at a glance, as the dispatcher last sampled it (every few
/// seconds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolView {
    /// Jobs ready on the jobs queue, waiting for a free run slot.
    pub queue_depth: u32,
    /// Workers consuming the jobs queue.
    pub workers: u32,
    /// Runs in a worker's slot now (state `running`).
    pub busy_slots: u64,
    /// How many runs are in each state; states with none are left out.
    pub runs_by_state: std::collections::BTreeMap<String, u64>,
    /// Queued runs waiting for an agent profile's cap (`max_concurrent`), by profile.
    pub waiting_for_profile: std::collections::BTreeMap<String, u64>,
    /// When this was sampled (RFC 3339); absent before the first sample.
    pub sampled_at: Option<String>,
    /// The hosts of the worker processes that announced themselves within the last 35 s,
    /// by host name, each with its workers.
    #[serde(default)]
    pub hosts: Vec<crate::roster::PoolHost>,
}

/// `GET /v1/runs/{id}/timeline`: what a run page shows besides the run itself, bounded
/// whatever the run printed: its stage, state, check, cycle, cancel, pull-request and
/// webhook events (at most [`TIMELINE_EVENTS`]), and the tail of its log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunTimeline {
    /// The events, oldest first, each with its position.
    pub events: Vec<PositionedEvent>,
    /// The last `log` events (at most `log_lines`), oldest first.
    pub log_tail: Vec<PositionedEvent>,
    /// The highest position among both: pass it as `Last-Event-ID` to the event stream to
    /// get what follows.
    pub last_position: i64,
}

/// One stage's transcript: what an agent kind's CLI said and did (SPEC 16).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StageTranscript {
    /// The stage's place among the run's stages, from 1 (as `stage_started` events come).
    pub index: u32,
    /// `implement`, `review` or `final_review`.
    pub stage: String,
    /// The implementation round it belongs to.
    pub round: u32,
    /// The review cycle, for review stages.
    pub cycle: Option<u32>,
    /// The agent kind that ran.
    pub agent: String,
    /// The conversation: messages, tool calls and their results, in order.
    pub transcript: crate::Transcript,
    /// What the stage spent, as its `stage_finished` reported.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub usage: Option<crate::Usage>,
}

/// The most events [`RunTimeline::events`] holds.
pub const TIMELINE_EVENTS: u32 = 5000;

/// An event with its position in the run's stream (the `id` of its Server-Sent Event).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PositionedEvent {
    /// The position.
    pub position: i64,
    /// The event, as the event stream sends it.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub event: crate::Event,
}

/// `GET /v1/runs`: a page of runs, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunList {
    /// The runs.
    pub runs: Vec<RunSummary>,
    /// Pass as `cursor` for the next page; absent on the last page.
    pub next_cursor: Option<String>,
}

/// `202` answer to `POST /v1/runs/{id}/cancel`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CancelAnswer {
    /// The run.
    pub run_id: Uuid,
    /// `done`: the run was queued or paused and is cancelled now; `requested`: it is running
    /// and its worker stops it.
    pub cancel: CancelProgress,
}

/// How far a cancel went when it was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CancelProgress {
    /// The run is cancelled.
    Done,
    /// The run's worker was told; the run ends `cancelled` when it stops.
    Requested,
}

/// `202` answer to `POST /v1/runs/{id}/resume`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ResumeAnswer {
    /// The run.
    pub run_id: Uuid,
    /// Always `queued`.
    pub state: RunState,
    /// The checkpoint the run continues from.
    pub checkpoint: u32,
}

/// `GET /readyz`: whether the store and the broker can be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Readiness {
    /// The store answered.
    pub store: bool,
    /// The broker is connected and its queues exist.
    pub broker: bool,
}

/// The error document of every 4xx and 5xx answer: RFC 9457 problem details, served as
/// `application/problem+json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Problem {
    /// The problem type: `urn:forgepool:problem:{code}`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The HTTP status's reason phrase (`Bad Request`, `Not Found`…), the same for every
    /// occurrence of a type.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// A sentence for a person: what was wrong and what to do.
    pub detail: String,
    /// A stable code (`invalid_field`, `unknown_skill`, `not_found`, `unauthorized`…).
    pub code: String,
    /// The field (or header, or query parameter) at fault, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// The media type of [`Problem`].
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

impl Problem {
    /// A problem of `status` (its code and reason phrase) with `code`, `detail` and `field`.
    pub fn new(
        status: u16,
        title: &str,
        code: &str,
        detail: impl Into<String>,
        field: Option<&str>,
    ) -> Problem {
        Problem {
            kind: format!("urn:forgepool:problem:{code}"),
            title: title.to_string(),
            status,
            detail: detail.into(),
            code: code.to_string(),
            field: field.map(String::from),
        }
    }
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
        let problem = Problem::new(
            400,
            "Bad Request",
            "invalid_field",
            "ticket: bad",
            Some("ticket"),
        );
        let text = serde_json::to_string(&problem).unwrap();
        assert_eq!(
            text,
            r#"{"type":"urn:forgepool:problem:invalid_field","title":"Bad Request","status":400,"detail":"ticket: bad","code":"invalid_field","field":"ticket"}"#
        );
        assert_eq!(serde_json::from_str::<Problem>(&text).unwrap(), problem);
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
