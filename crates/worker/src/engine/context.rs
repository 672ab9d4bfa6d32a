//! One run's working state: its folders and repository, history, rounds, checks, cycles
//! and what the result and the report are built from.

use super::*;

/// One run's working state: folders, history and what the report needs.
#[derive(Debug)]
pub(super) struct RunContext<'a> {
    pub(super) job: &'a Job,
    pub(super) root: PathBuf,
    /// The run's repository: a private git folder and the work tree (`{root}/src`) that the
    /// implementer changes.
    pub(super) repo: git::Repo,
    pub(super) base: String,
    /// The cached checkout of `base` the work tree and the copies are laid over (SPEC 14),
    /// held for the run; `None` when they are checked out.
    pub(super) base_tree: Option<crate::workspace::cache::BaseTree>,
    pub(super) stage_count: u32,
    pub(super) collector: CycleCollector,
    pub(super) history: Vec<serde_json::Value>,
    pub(super) rounds: Vec<RoundRecord>,
    pub(super) checks: Vec<CheckResult>,
    pub(super) cycles: Vec<CycleRecord>,
    pub(super) review_exhausted: bool,
    pub(super) implementation_rounds: u32,
    pub(super) delivered: Option<(String, String, String)>,
    /// The job was delivered again: an earlier execution may have run it.
    pub(super) again: bool,
    pub(super) final_report: Option<FinalReport>,
    pub(super) final_refusal: Option<String>,
    /// An earlier execution died during the final review: its outcome is unknown.
    pub(super) final_unknown: bool,
    /// What the stages said they spent (`usage.json`), summed across executions.
    pub(super) usage: Option<proto::UsageTotals>,
    /// The provider's pause the last paused stage asked for (`pause.json`), or the pause of
    /// its profile across the pool: the run resumes by itself at its end.
    pub(super) pause: Option<proto::PauseRequest>,
    /// Whether [`Self::pause`] pauses the profile across the pool: only the gateway's own view
    /// of a provider's answer does, or an agent's claim for a profile without a `provider`
    /// (SPEC 6). An agent's claim for a gateway profile pauses its own run only.
    pub(super) pause_pool: bool,
    /// When a pause of the run's profile ends: the paused run resumes by itself then.
    pub(super) resume_at: Option<String>,
    /// The delivered branch's pull request.
    pub(super) pull_request: Option<String>,
    /// Why the pull request could not be opened or updated (the branch stays delivered).
    pub(super) pull_request_warning: Option<String>,
    /// The role whose profile's cap the run waits for, once it handed itself back.
    pub(super) waiting: Option<crate::ports::gate::Role>,
    /// Fired when the worker drains: the run is handed back before its next stage (the one
    /// running is never stopped for it), unless all that is left is its delivery.
    pub(super) handover: tokio_util::sync::CancellationToken,
}

impl<'a> RunContext<'a> {
    pub(super) fn new(job: &'a Job, root: &Path) -> RunContext<'a> {
        let src = root.join("src");
        RunContext {
            base_tree: None,
            job,
            root: root.to_path_buf(),
            collector: CycleCollector::new(&src),
            repo: git::Repo::new(root.join("repo.git"), src),
            base: String::new(),
            stage_count: 0,
            history: Vec::new(),
            rounds: Vec::new(),
            checks: Vec::new(),
            cycles: Vec::new(),
            review_exhausted: false,
            implementation_rounds: 0,
            delivered: None,
            again: false,
            final_report: None,
            final_refusal: None,
            final_unknown: false,
            usage: None,
            pause: None,
            pause_pool: false,
            resume_at: None,
            waiting: None,
            pull_request: None,
            pull_request_warning: None,
            handover: tokio_util::sync::CancellationToken::new(),
        }
    }

    /// Whether a drain hands the run back before `phase`: before each stage container, with
    /// its progress kept, so the next execution continues from it. What needs no container
    /// (verifying without commands, delivering) is short: it is done here.
    pub(super) fn hands_over_before(&self, phase: &crate::engine::machine::Phase) -> bool {
        use crate::engine::machine::Phase;
        let stage_next = match phase {
            Phase::Implement { .. } | Phase::Review { .. } | Phase::FinalReview { .. } => true,
            Phase::Verify { .. } => !self.job.commands.is_empty(),
            _ => false,
        };
        stage_next && self.handover.is_cancelled()
    }

    pub(super) fn limits(&self) -> Limits {
        Limits {
            max_cycles: self.job.review.as_ref().map_or(0, |r| r.max_cycles),
            block_on_failure: self.job.review.as_ref().is_some_and(|r| r.block_on_failure),
            repair_budget: self.job.repair_budget,
            final_review: self.job.final_reviewer.is_some(),
        }
    }

    /// Keeps a cycle record for the report; `false` when it was dropped because it would
    /// replace forgepool's own record of the same file with a container's.
    pub(super) fn record_cycle(&mut self, cycle: CycleRecord) -> bool {
        match self
            .cycles
            .iter_mut()
            .find(|c| c.step == cycle.step && c.file == cycle.file)
        {
            Some(existing)
                if existing.origin == CycleOrigin::Forgepool
                    && cycle.origin != CycleOrigin::Forgepool =>
            {
                return false
            }
            Some(existing) => *existing = cycle,
            None => self.cycles.push(cycle),
        }
        self.cycles
            .sort_by(|a, b| (&a.step, a.cycle).cmp(&(&b.step, b.cycle)));
        true
    }

    /// Writes forgepool's cycle file into the workspace's `.forge/{step}/`, never through a
    /// symlink the agent placed there.
    pub(super) async fn write_cycle_file(&self, record: &CycleRecord) -> Result<(), String> {
        let workspace = self.repo.work_tree.clone();
        let relative = PathBuf::from(".forge")
            .join(&record.step)
            .join(&record.file);
        let bytes = serde_json::to_vec_pretty(&record.content).unwrap_or_default();
        let shown = relative.display().to_string();
        tokio::task::spawn_blocking(move || write_atomically(&workspace, &relative, &bytes))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| {
                format!("cannot write the review cycle file {shown} in the workspace: {e}")
            })
    }

    /// Creates `{root}/stages/{n}-{stage}/{input,output}` with the input files.
    pub(super) async fn stage_dirs(
        &mut self,
        stage: Stage,
        prompt: &str,
        diff: Option<&str>,
    ) -> Result<PathBuf, String> {
        self.stage_count += 1;
        let dir = self
            .root
            .join("stages")
            .join(format!("{}-{}", self.stage_count, stage.as_str()));
        let input = dir.join("input");
        let output = dir.join("output");
        let history = serde_json::to_vec_pretty(&self.history).unwrap_or_default();
        let job = serde_json::to_vec_pretty(self.job).unwrap_or_default();
        let mut files: Vec<(&str, Vec<u8>)> = vec![
            ("prompt.md", prompt.as_bytes().to_vec()),
            ("brief.md", self.job.brief.as_bytes().to_vec()),
            ("history.json", history),
            ("job.json", job),
        ];
        if let Some(diff) = diff {
            files.push(("diff.patch", diff.as_bytes().to_vec()));
        }
        let write = async {
            tokio::fs::create_dir_all(&input).await?;
            tokio::fs::create_dir_all(&output).await?;
            for (name, bytes) in files {
                tokio::fs::write(input.join(name), bytes).await?;
            }
            Ok::<(), std::io::Error>(())
        };
        write
            .await
            .map_err(|e| format!("cannot write stage inputs in {}: {e}", dir.display()))?;
        Ok(dir)
    }

    /// Writes `.forge/history/{ticket}.json` in the working copy.
    pub(super) async fn write_workspace_history(&self) -> Result<(), String> {
        let workspace = self.repo.work_tree.clone();
        let relative = PathBuf::from(".forge/history").join(format!("{}.json", self.job.ticket));
        let bytes = serde_json::to_vec_pretty(&self.history).unwrap_or_default();
        tokio::task::spawn_blocking(move || write_atomically(&workspace, &relative, &bytes))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("cannot write the history file: {e}"))
    }

    /// Commits `tree` on the base and makes a fresh copy of it at `dest`; returns the commit.
    /// What a reviewer gets: a fresh copy of `tree` at `copy` (mounted read-only), and its
    /// stage folders with `prompt` and the change from the base as a diff. Returns the
    /// stage folder.
    pub(super) async fn review_folders(
        &mut self,
        stage: Stage,
        tree: &str,
        copy: &Path,
        prompt: &str,
    ) -> Result<PathBuf, String> {
        let commit = self.read_only_copy(tree, copy).await?;
        let diff = git::diff(&self.repo, &self.base, &commit)
            .await
            .unwrap_or_default();
        self.stage_dirs(stage, prompt, Some(&format!("{diff}\n")))
            .await
    }

    /// A reviewer's copy of `tree` at `dest` (mounted read-only): linked from the work tree
    /// when it holds `tree` as recorded, else checked out. Returns the candidate commit.
    async fn read_only_copy(&self, tree: &str, dest: &Path) -> Result<String, String> {
        let _ = remove_dir(dest).await;
        let commit = self.candidate(tree).await?;
        if self.lay_copy(&commit, dest).await {
            return Ok(commit);
        }
        match crate::workspace::linkcopy::link_copy(&self.repo, &commit, tree, &self.base, dest)
            .await
        {
            Ok(true) => return Ok(commit),
            Ok(false) => {}
            // A fallback that works is no warning (the run goes on as fast as without links).
            Err(error) => debug!(%error, "cannot link a reviewer's copy; checking one out"),
        }
        let _ = remove_dir(dest).await;
        git::copy_at(&self.repo, &commit, &self.base, dest)
            .await
            .map_err(|e| e.to_string())?;
        Ok(commit)
    }

    /// The candidate commit of `tree` on the base, dated with the submission (the same inputs
    /// give the same commit).
    async fn candidate(&self, tree: &str) -> Result<String, String> {
        let message = format!("forgepool candidate for {}", self.job.ticket);
        git::commit_tree(
            &self.repo,
            tree,
            &self.base,
            &message,
            &self.job.submitted_at,
        )
        .await
        .map_err(|e| e.to_string())
    }

    /// A writable copy of `tree` at `dest`, checked out (nothing shared with the work tree).
    /// Returns the candidate commit.
    pub(super) async fn fresh_copy(&self, tree: &str, dest: &Path) -> Result<String, String> {
        let _ = remove_dir(dest).await;
        let commit = self.candidate(tree).await?;
        if self.lay_copy(&commit, dest).await {
            return Ok(commit);
        }
        git::copy_at(&self.repo, &commit, &self.base, dest)
            .await
            .map_err(|e| e.to_string())?;
        Ok(commit)
    }

    /// A copy of `commit` at `dest` laid over the run's cached checkout, when it has one:
    /// `false` (and nothing left at `dest`) when it has none or the copy fails.
    async fn lay_copy(&self, commit: &str, dest: &Path) -> bool {
        let Some(base_tree) = &self.base_tree else {
            return false;
        };
        match base_tree.lay_copy(&self.repo, commit, dest).await {
            Ok(()) => true,
            Err(error) => {
                debug!(%error, "cannot lay a copy over the cached checkout; checking one out");
                let _ = remove_dir(dest).await;
                false
            }
        }
    }

    /// The `review` field of the result and the report's final review section.
    pub(super) fn final_review_summary(&self) -> (&'static str, String) {
        if self.job.final_reviewer.is_none() {
            return ("not_requested", "Not requested.".into());
        }
        if let Some(reason) = &self.final_refusal {
            return ("refused", format!("The report was refused: {reason}"));
        }
        if self.final_unknown {
            return (
                "unknown",
                "Unknown: an earlier execution died during the final review; it was not repeated."
                    .into(),
            );
        }
        let Some(report) = &self.final_report else {
            return ("not_run", "Requested, but the run ended before it.".into());
        };
        let mut text = format!(
            "Verdict: **{}**. {}\n",
            if report.approved {
                "approved"
            } else {
                "changes_required"
            },
            report.summary.trim()
        );
        for finding in &report.findings {
            text.push_str(&format!(
                "\n- **{}** `{}:{}`: {}\n  > {}",
                finding.severity,
                finding.path,
                finding.line,
                finding.summary.trim(),
                finding.evidence.trim()
            ));
        }
        (
            if report.approved {
                "approved"
            } else {
                "changes_required"
            },
            text,
        )
    }

    pub(super) fn result(&self, state: RunState, reason: &str) -> RunResult {
        let mut warnings = self.job.warnings.clone();
        if self.review_exhausted {
            warnings.push(format!(
                "review was exhausted without approval after {} cycle(s)",
                self.cycles
                    .iter()
                    .filter(|c| c.origin == CycleOrigin::Forgepool)
                    .count()
            ));
        }
        warnings.extend(self.pull_request_warning.clone());
        let (final_review, final_text) = self.final_review_summary();
        let report = report::render(&ReportInput {
            job: self.job,
            state,
            reason,
            checks: &self.checks,
            cycles: &self.cycles,
            rounds: &self.rounds,
            review_exhausted: self.review_exhausted && state == RunState::DeliveredWithWarnings,
            final_review: &final_text,
            warnings: &warnings,
            usage: self.usage.as_ref(),
            pull_request: self.pull_request.as_deref(),
        });
        let (branch, commit, tree) = match &self.delivered {
            Some((branch, commit, tree)) => (
                Some(branch.clone()),
                Some(commit.clone()),
                Some(tree.clone()),
            ),
            None => (None, None, self.rounds.last().map(|r| r.tree.clone())),
        };
        RunResult {
            usage: self.usage.clone(),
            pull_request: self.pull_request.clone(),
            state,
            reason: reason.to_string(),
            branch,
            commit,
            tree,
            report,
            warnings,
            repair_budget: self.job.repair_budget,
            implementation_rounds: self.implementation_rounds,
            repair_history: self.rounds.clone(),
            review: final_review.to_string(),
            change: None,
            final_review: self.final_report.clone(),
        }
    }

    /// The delivered change from the base as a diff, cut to [`proto::MAX_CHANGE_BYTES`];
    /// `None` when nothing was delivered or git could not tell.
    pub(super) async fn change(&self) -> Option<String> {
        let (_, commit, _) = self.delivered.as_ref()?;
        let diff = git::diff(&self.repo, &self.base, commit).await.ok()?;
        Some(proto::cut_change(diff))
    }
}
