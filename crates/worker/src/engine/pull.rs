//! After delivery: the delivered branch's pull request, on a forge the forges file knows
//! (`crate::delivery::pulls`). A forge that refuses ends this step only: the run stays delivered, with a
//! warning that says why.

use super::*;
use crate::delivery::pulls::PullRequestSpec;

impl<R: ContainerRuntime> Engine<R> {
    /// Opens or updates the pull request of the branch the run delivered.
    pub(super) async fn pull_request<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        state: RunState,
        reason: &str,
    ) -> Result<(), PublishEvent> {
        let job = run.job;
        let (Some((branch, commit, _)), Some(forge)) = (
            run.delivered.clone(),
            crate::delivery::forges::forges().for_url(&job.repository.url),
        ) else {
            return Ok(());
        };
        // The body is the report as it stands now: everything but this pull request.
        let report = run.result(state, reason).report;
        let base = job
            .repository
            .git_ref
            .as_deref()
            .filter(|r| !git::looks_like_commit(r));
        let spec = PullRequestSpec {
            repository: &job.repository.url,
            branch: &branch,
            base,
            title: format!(
                "{}: {}",
                job.ticket,
                job.brief.lines().next().unwrap_or("").trim()
            ),
            body: &report,
            draft: state == RunState::DeliveredWithWarnings,
            commit: &commit,
            status: reason,
            link: crate::delivery::forges::forges().run_link(&job.run_id.to_string()),
        };
        match crate::delivery::pulls::open_or_update(forge, &spec).await {
            Ok(Some(pull)) => {
                info!(url = %pull.url, action = pull.action, "pull request");
                run.pull_request = Some(pull.url.clone());
                let kind = EventKind::PullRequest {
                    url: pull.url,
                    action: pull.action.to_string(),
                };
                publish(sink, job.run_id, kind).await?;
            }
            Ok(None) => {}
            Err(error) => {
                warn!(%error, "no pull request; the branch is delivered");
                run.pull_request_warning = Some(format!("no pull request: {error}"));
            }
        }
        Ok(())
    }
}
