//! Delivery: the verified tree committed on the base and pushed to `forge/{ticket}`.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    pub(super) async fn deliver(&self, run: &mut RunContext<'_>, tree: &str) -> Input {
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
        // has delivered it.
        let seen = match git::remote_delivery(&run.repo, &job.repository.url, &branch).await {
            Ok(seen) => seen,
            Err(error) => {
                return Input::DeliveryFailed {
                    reason: format!("cannot read {branch} before pushing: {error}"),
                }
            }
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
        let replaces = seen.as_ref().map(|(commit, _)| commit.as_str());
        let pushed = git::push(&run.repo, &job.repository.url, &commit, &branch, replaces);
        if let Err(error) = pushed.await {
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

/// The branch a run delivers to: `forge/{ticket, lowercased}`.
pub(super) fn delivery_branch(job: &Job) -> String {
    format!("forge/{}", job.ticket.to_ascii_lowercase())
}
