//! Follow-up rounds (SPEC 17): a run that continues a delivered one. It starts from the
//! delivered branch as it stands, its implementer gets the feedback as `## Reviewer Feedback`,
//! the reviewer and checks run as usual, and its delivery adds a commit to the same branch
//! (the same pull request), never over a commit pushed since it started. Open to every
//! client (`POST /v1/runs/{id}/follow-up`) and to the trackers (a mention on the issue or the
//! run's pull request).

use proto::{FollowUp, RunRequest, RunState};
use uuid::Uuid;

use crate::dispatcher::{Dispatcher, Submission, SubmitFailure};
use crate::store::{RunFilter, RunStore, StoreError};

/// The most follow-ups of one ticket, unless a tracker's `max_follow_ups` says otherwise.
pub const DEFAULT_MAX_FOLLOW_UPS: u32 = 5;
/// The longest feedback taken.
pub const MAX_FEEDBACK_BYTES: usize = 60_000;

/// Why a follow-up was not started.
#[derive(Debug)]
pub enum Refused {
    /// No such run.
    Unknown,
    /// The feedback is empty or too long.
    Feedback(String),
    /// The run cannot be continued now (not delivered, another run of the ticket running,
    /// too many follow-ups).
    Conflict(String),
    /// The continuation's request was refused.
    Submit(SubmitFailure),
    /// The store failed.
    Store(StoreError),
}

impl From<StoreError> for Refused {
    fn from(error: StoreError) -> Refused {
        Refused::Store(error)
    }
}

impl Dispatcher {
    /// Starts a run continuing `run_id`'s delivered branch with `feedback`; `key` names the
    /// submission (a tracker's comment), so that the same ask twice starts one run.
    pub async fn follow_up(
        &self,
        run_id: Uuid,
        feedback: &str,
        key: Option<&str>,
        max_follow_ups: u32,
    ) -> Result<Submission, Refused> {
        let feedback = feedback.trim();
        if feedback.is_empty() || feedback.len() > MAX_FEEDBACK_BYTES {
            return Err(Refused::Feedback(format!(
                "feedback: 1 to {MAX_FEEDBACK_BYTES} bytes of text are expected"
            )));
        }
        let Some(record) = self.store.get_run(run_id).await? else {
            return Err(Refused::Unknown);
        };
        let branch = match (
            &record.state,
            record.result.as_ref().and_then(|r| r.branch.clone()),
        ) {
            (RunState::Delivered | RunState::DeliveredWithWarnings, Some(branch)) => branch,
            (state, _) => {
                return Err(Refused::Conflict(format!(
                    "run {run_id} is {state}: only a delivered run's branch can be continued"
                )))
            }
        };
        let (runs, _) = self
            .store
            .list_runs(RunFilter {
                ticket: Some(record.job.ticket.clone()),
                limit: 500,
                ..Default::default()
            })
            .await?;
        if let Some(running) = runs.iter().find(|r| !r.state.is_terminal()) {
            return Err(Refused::Conflict(format!(
                "run {} of ticket {} has not ended; a follow-up waits for it",
                running.run_id, record.job.ticket
            )));
        }
        let mut follow_ups = 0;
        for run in &runs {
            if let Some(other) = self.store.get_run(run.run_id).await? {
                follow_ups += u32::from(other.job.follow_up.is_some());
            }
        }
        if follow_ups >= max_follow_ups {
            return Err(Refused::Conflict(format!(
                "ticket {} has had {follow_ups} follow-ups, the most allowed ({max_follow_ups})",
                record.job.ticket
            )));
        }
        let job = &record.job;
        let request = RunRequest {
            schema_version: None,
            ticket: job.ticket.clone(),
            skill: job.skill.clone(),
            step: Some(job.step.clone()),
            brief: job.brief.clone(),
            repository: proto::RepositoryRef {
                url: job.repository.url.clone(),
                git_ref: Some(branch),
            },
            commands: job.commands.clone(),
            repair_attempts: Some(i64::from(job.repair_budget)),
            agents: Some(proto::AgentChoice {
                implementer: Some(job.implementer.name.clone()),
                reviewer: job.reviewer.as_ref().map(|r| r.name.clone()),
            }),
            assurance: job.final_reviewer.as_ref().map(|f| proto::Assurance {
                review_agent: Some(f.name.clone()),
            }),
            budget: job.budget.clone(),
        };
        let follow_up = FollowUp {
            of: run_id,
            feedback: feedback.to_string(),
        };
        self.submit_continuing(request, key, Some(follow_up))
            .await
            .map_err(Refused::Submit)
    }
}
