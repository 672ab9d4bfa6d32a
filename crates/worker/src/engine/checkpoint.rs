//! Pauses and resumes: what a checkpoint keeps of a paused run, and how a fresh clone is put
//! back where it stopped.

use proto::LoopState;

use super::*;

impl RunContext<'_> {
    /// Saves where a paused run stopped. `phase` is the phase to repeat on resume; the source is
    /// the tree that phase starts from (a paused implementer's partial work is not kept: the
    /// round was not spent).
    pub(super) async fn checkpoint(
        &self,
        machine: &RunMachine,
        phase: Phase,
    ) -> Result<Checkpoint, String> {
        let tree = match &phase {
            Phase::Verify { tree, .. }
            | Phase::Review { tree, .. }
            | Phase::FinalReview { tree }
            | Phase::Deliver { tree } => tree.clone(),
            _ => match self.rounds.last() {
                Some(round) => round.tree.clone(),
                None => self
                    .repo
                    .git(&["rev-parse", &format!("{}^{{tree}}", self.base)])
                    .await
                    .map_err(|e| e.to_string())?,
            },
        };
        let patch = git::checkpoint_patch(&self.repo, &self.base, &tree)
            .await
            .map_err(|e| e.to_string())?;
        if patch.len() > MAX_CHECKPOINT_PATCH_BYTES {
            return Err(format!(
                "the change is {} bytes, over the checkpoint limit of {MAX_CHECKPOINT_PATCH_BYTES}",
                patch.len()
            ));
        }
        let mut machine = machine.state().clone();
        machine.phase = phase;
        let state = LoopState {
            usage: self.usage.clone(),
            machine,
            history: self.history.clone(),
            rounds: self.rounds.clone(),
            checks: self.checks.clone(),
            cycles: self.cycles.clone(),
            stage_count: self.stage_count,
        };
        let checkpoint = Checkpoint {
            resume_at: self.resume_at.clone(),
            sequence: self.job.resume.as_ref().map_or(1, |c| c.sequence + 1),
            base: self.base.clone(),
            tree,
            patch,
            state,
        };
        // The resumed job must still be a job a worker accepts.
        let mut resumed = self.job.clone();
        resumed.resume = Some(checkpoint.clone());
        let size = serde_json::to_vec(&resumed).map_or(usize::MAX, |bytes| bytes.len());
        if size > proto::MAX_JOB_BYTES {
            return Err(format!(
                "the resumed job would be {size} bytes, over the job limit of {}",
                proto::MAX_JOB_BYTES
            ));
        }
        Ok(checkpoint)
    }

    /// Puts a freshly cloned workspace back where `checkpoint` left it: the base commit, the
    /// change replayed and checked against the saved tree, the cycle files and the history.
    /// The loop's limits come from the job, never from the checkpoint.
    pub(super) async fn restore(&mut self, checkpoint: &Checkpoint) -> Result<RunMachine, String> {
        let snapshot = checkpoint.state.clone();
        let failed = |e: git::GitError| e.to_string();
        self.repo
            .git_in_tree(&["checkout", "--quiet", "--detach", &checkpoint.base])
            .await
            .map_err(|e| format!("the base commit {} is gone: {e}", checkpoint.base))?;
        self.repo
            .git(&["branch", "--force", "base", &checkpoint.base])
            .await
            .map_err(failed)?;
        self.base = checkpoint.base.clone();
        let tree = git::apply_checkpoint(&self.repo, &checkpoint.patch)
            .await
            .map_err(|e| format!("the saved change does not apply: {e}"))?;
        if tree != checkpoint.tree {
            return Err(format!(
                "the saved change gives tree {tree}, not the saved {}",
                checkpoint.tree
            ));
        }
        for cycle in &snapshot.cycles {
            if cycle.origin == CycleOrigin::Forgepool {
                self.collector.own(&cycle.step, &cycle.file);
            }
            self.write_cycle_file(cycle).await?;
        }
        // The restored files are known: they are not reported again.
        let mut collector = std::mem::take(&mut self.collector);
        self.collector = tokio::task::spawn_blocking(move || {
            collector.scan();
            collector
        })
        .await
        .map_err(|e| e.to_string())?;
        self.history = snapshot.history;
        self.rounds = snapshot.rounds;
        self.checks = snapshot.checks;
        self.cycles = snapshot.cycles;
        self.stage_count = snapshot.stage_count;
        self.usage = snapshot.usage;
        self.write_workspace_history().await?;
        let machine = RunMachine::restored(snapshot.machine, self.limits());
        self.implementation_rounds = machine.implementation_rounds;
        self.review_exhausted = machine.review_exhausted;
        Ok(machine)
    }
}

/// Keeps a run's `progress` in the ledger, if there is any.
pub(super) async fn keep_progress<L: ReviewLedger>(
    ledger: &L,
    run_id: Uuid,
    progress: Option<Checkpoint>,
) {
    let Some(checkpoint) = progress else {
        return;
    };
    match ledger.keep_progress(&run_id.to_string(), &checkpoint).await {
        Ok(()) => crate::fault::point("progress-kept"),
        Err(error) => warn!(%error, "cannot keep the run's progress"),
    }
}
