//! Delivery: the verified tree committed on the base and pushed to `forge/{ticket}`.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    pub(super) async fn deliver<L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        ledger: &L,
        tree: &str,
    ) -> Input {
        let job = run.job;
        let current = match git::snapshot_tree(&run.repo).await {
            Ok(current) => current,
            Err(error) => {
                return Input::DeliveryFailed {
                    reason: format!("cannot read the workspace before delivery: {error}"),
                }
            }
        };
        if current != tree {
            return Input::DeliveryFailed {
                reason: format!("delivery refused: the source changed after it was verified and reviewed (tree {} was checked, {} is present)", short(tree), short(&current)),
            };
        }
        let branch = delivery_branch(job);
        // The remote branch is the commit point: an earlier execution of this run that pushed
        // has delivered it, and another run's delivery that has not finished is waited for.
        let seen = match self.branch_to_replace(run, ledger, &branch).await {
            Ok(seen) => seen,
            Err(reason) => return Input::DeliveryFailed { reason },
        };
        if let Some((commit, Some(owner))) = &seen {
            if *owner == job.run_id.to_string() {
                info!(%branch, %commit, "already delivered by an earlier execution");
                run.delivered = Some((branch, commit.clone(), tree.to_string()));
                return Input::Delivered;
            }
        }
        let message = format!(
            "{}: {}\n\nDelivered by forgepool run {}.\n\n{}: {}",
            job.ticket,
            job.brief.lines().next().unwrap_or("").trim(),
            job.run_id,
            git::RUN_TRAILER,
            job.run_id
        );
        let commit =
            match git::commit_tree(&run.repo, tree, &run.base, &message, &job.submitted_at).await {
                Ok(commit) => commit,
                Err(error) => {
                    return Input::DeliveryFailed {
                        reason: format!("cannot commit the change: {error}"),
                    }
                }
            };
        let mut replaces = seen.as_ref().map(|(commit, _)| commit.as_str());
        if job.follow_up.is_some() {
            // A follow-up adds a commit on the head it started from, and only there: a commit
            // pushed to the branch since (a person's, another run's) is never overwritten.
            if replaces.is_some_and(|head| head != run.base) {
                return Input::DeliveryFailed {
                    reason: format!("{branch} moved after this follow-up started from {} (a commit was pushed to it meanwhile); the commit is kept and this round's change is not pushed: ask again to start from the new head", short(&run.base)),
                };
            }
            replaces = Some(run.base.as_str());
        }
        crate::fault::point("before-push");
        let pushed = git::push(&run.repo, &job.repository.url, &commit, &branch, replaces).await;
        if pushed.is_ok() {
            crate::fault::point("pushed");
        }
        if let Err(error) = pushed {
            // Another execution of this run may have pushed since the branch was read.
            let now = git::remote_delivery(&run.repo, &job.repository.url, &branch).await;
            if let Ok(Some((commit, Some(owner)))) = now {
                if owner == job.run_id.to_string() {
                    info!(%branch, %commit, "delivered by another execution meanwhile");
                    run.delivered = Some((branch, commit, tree.to_string()));
                    return Input::Delivered;
                }
            }
            return Input::DeliveryFailed {
                reason: format!("cannot push {branch}: {error}"),
            };
        }
        info!(%branch, %commit, "delivered");
        run.delivered = Some((branch, commit, tree.to_string()));
        Input::Delivered
    }
}

/// How long a delivery waits for another run whose unfinished delivery holds the branch.
const UNFINISHED_PATIENCE: Duration = Duration::from_secs(600);

impl<R: ContainerRuntime> Engine<R> {
    /// What the branch holds, once it may be replaced: its commit and the run that commit
    /// names. A commit of another run that has not finished (it is executing, or keeps
    /// progress: it pushed and its final events are not in yet) is never overwritten: the
    /// delivery waits for that run for up to [`UNFINISHED_PATIENCE`], then fails saying so.
    async fn branch_to_replace<L: ReviewLedger>(
        &self,
        run: &RunContext<'_>,
        ledger: &L,
        branch: &str,
    ) -> Result<Option<(String, Option<String>)>, String> {
        let job = run.job;
        let started = tokio::time::Instant::now();
        loop {
            let seen = git::remote_delivery(&run.repo, &job.repository.url, branch)
                .await
                .map_err(|error| format!("cannot read {branch} before pushing: {error}"))?;
            let other = match &seen {
                Some((_, Some(owner))) if *owner != job.run_id.to_string() => owner.clone(),
                _ => return Ok(seen),
            };
            let unfinished = ledger.run_unfinished(&other).await.unwrap_or_else(|error| {
                warn!(%error, run = %other, "cannot tell whether the branch's run finished");
                true
            });
            if !unfinished {
                return Ok(seen);
            }
            if started.elapsed() >= UNFINISHED_PATIENCE {
                return Err(format!(
                    "{branch} holds the delivery of run {other}, which has not finished after {} s; it is never overwritten. Submit again once it ends",
                    UNFINISHED_PATIENCE.as_secs()
                ));
            }
            info!(%branch, run = %other, "waiting for the run whose delivery holds the branch");
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }
}

/// The branch a run delivers to: `forge/{ticket, lowercased}`.
pub(super) fn delivery_branch(job: &Job) -> String {
    format!("forge/{}", job.ticket.to_ascii_lowercase())
}
