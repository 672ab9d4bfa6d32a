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
        let message = format!(
            "{}: {}\n\nDelivered by forgepool run {}.",
            job.ticket,
            job.brief.lines().next().unwrap_or("").trim(),
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
        let branch = format!("forge/{}", job.ticket.to_ascii_lowercase());
        if let Err(error) = git::push(&run.repo, &job.repository.url, &commit, &branch).await {
            return Input::DeliveryFailed {
                reason: format!("cannot push {branch}: {error}"),
            };
        }
        info!(%branch, %commit, "delivered");
        run.delivered = Some((branch, commit, tree.to_string()));
        Input::Delivered
    }
}
