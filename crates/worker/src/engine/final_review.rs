//! The independent final review (SPEC 7.3), between its intent and its receipt in the
//! ledger.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    /// The independent final review (SPEC 7.3) on a fresh read-only copy of the verified tree.
    /// The final review, between its intent and its receipt in the ledger: a receipt for the
    /// same tree is reused, and every outcome but a lost worker is recorded.
    pub(super) async fn final_review<S: EventSink, L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        ledger: &L,
        cancel: &CancellationToken,
        tree: &str,
    ) -> Result<Input, PublishEvent> {
        let run_key = run.job.run_id.to_string();
        match ledger.lookup(&run_key).await {
            Ok(entry) => {
                if let Some(receipt) = entry.receipt_for(tree) {
                    info!(tree, "reusing the final review receipt for this tree");
                    let report = receipt.report.clone();
                    let (approved, reason) = (report.approved, report.summary.clone());
                    run.final_report = Some(report);
                    return Ok(Input::FinalReviewed { approved, reason });
                }
            }
            Err(error) => {
                return Ok(Input::StageFailed {
                    reason: format!("cannot read the final review ledger: {error}"),
                })
            }
        }
        if let Err(error) = ledger.intent(&run_key, tree).await {
            return Ok(Input::StageFailed {
                reason: format!(
                    "cannot record the final review's intent, so it did not start: {error}"
                ),
            });
        }
        let input = match self.final_review_stage(run, sink, cancel, tree).await {
            Ok(input) => input,
            Err(error) => {
                // This worker is alive and hands the job back: the outcome is known (no
                // report), so the next execution may review again.
                let _ = ledger.clear(&run_key).await;
                return Err(error);
            }
        };
        let recorded = match (&input, &run.final_report) {
            (Input::FinalReviewed { .. }, Some(report)) => {
                let receipt = Receipt {
                    schema_version: proto::SCHEMA_VERSION,
                    tree: tree.to_string(),
                    report: report.clone(),
                };
                ledger.receipt(&run_key, &receipt).await
            }
            _ => ledger.clear(&run_key).await,
        };
        if let Err(error) = recorded {
            warn!(%error, "cannot record the final review's outcome in the ledger");
        }
        Ok(input)
    }

    pub(super) async fn final_review_stage<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        cancel: &CancellationToken,
        tree: &str,
    ) -> Result<Input, PublishEvent> {
        let job = run.job;
        let Some(profile) = &job.final_reviewer else {
            return Ok(Input::StageFailed {
                reason: "final review phase without a final reviewer (job is inconsistent)".into(),
            });
        };
        let copy = run.root.join("final-review");
        let prompt = prompt::final_review(&job.brief, &passed_checks(run));
        let stage_dir = match run
            .review_folders(Stage::FinalReview, tree, &copy, &prompt)
            .await
        {
            Ok(dir) => dir,
            Err(error) => return Ok(Input::StageFailed { reason: error }),
        };
        let mounts = agent_mounts(&copy, true, &stage_dir);
        let round = run.rounds.last().map_or(0, |r| r.round);
        let prepared = self.prepare_stage(
            run,
            StageRequest::agent(
                StagePlace {
                    stage: Stage::FinalReview,
                    round,
                    cycle: None,
                },
                profile,
                mounts,
                profile.timeout_seconds,
                0,
                &prompt,
            ),
        );
        let output = match self.run_stage(run, sink, cancel, prepared, None).await? {
            Ok(output) => output,
            Err(input) => return Ok(input),
        };
        let input = match output.exit {
            StageExit::Cancelled => Input::Cancelled,
            StageExit::Exited(EXIT_PAUSED) => Input::StagePaused {
                reason: format!(
                    "the final reviewer paused (exit 75): {}",
                    last_line(&output.tail)
                ),
            },
            StageExit::TimedOut => Input::FinalReviewRefused {
                reason: format!(
                    "the final reviewer timed out after {} s",
                    profile.timeout_seconds
                ),
            },
            StageExit::Exited(code) if code != 0 => Input::FinalReviewRefused {
                reason: format!(
                    "the final reviewer exited with code {code}; last output:\n{}",
                    tail(&output.tail, 1024)
                ),
            },
            StageExit::Exited(_) => self.read_final_report(run, &copy, tree, &stage_dir).await,
        };
        if let Input::FinalReviewRefused { reason } = &input {
            run.final_refusal = Some(reason.clone());
        }
        let _ = remove_dir(&copy).await;
        Ok(input)
    }

    /// The final reviewer's report, validated, once its container exited 0: refused when the
    /// reviewed copy was changed or the report breaks a rule.
    async fn read_final_report(
        &self,
        run: &mut RunContext<'_>,
        copy: &Path,
        tree: &str,
        stage_dir: &Path,
    ) -> Input {
        // A layered copy's git folder is beside it (see `crate::workspace::overlay`).
        let located: Vec<String> = crate::workspace::overlay::stage_git(copy)
            .map(|git_dir| {
                vec![
                    format!("--git-dir={}", git_dir.display()),
                    format!("--work-tree={}", copy.display()),
                ]
            })
            .unwrap_or_default();
        let with = |args: &[&'static str]| {
            let mut all: Vec<&str> = located.iter().map(String::as_str).collect();
            all.extend_from_slice(args);
            all
        };
        let unchanged = git::git(
            copy,
            &with(&["status", "--porcelain", "--untracked-files=all"]),
        )
        .await
        .is_ok_and(|s| s.is_empty())
            && git::git(copy, &with(&["rev-parse", "HEAD^{tree}"]))
                .await
                .is_ok_and(|t| t == tree);
        let output_dir = stage_dir.join("output");
        let source = copy.to_path_buf();
        let validated = tokio::task::spawn_blocking(move || {
            crate::review::final_report::validate(&output_dir, &source)
        })
        .await
        .unwrap_or_else(|e| Err(format!("validation failed: {e}")));
        match (unchanged, validated) {
            (false, _) => Input::FinalReviewRefused {
                reason: "the reviewed source copy was changed".into(),
            },
            (true, Err(reason)) => Input::FinalReviewRefused { reason },
            (true, Ok(report)) => {
                let approved = report.approved;
                let summary = report.summary.clone();
                run.final_report = Some(report);
                Input::FinalReviewed {
                    approved,
                    reason: summary,
                }
            }
        }
    }
}

/// The checks that passed in the last round, as a Markdown list for the final reviewer.
fn passed_checks(run: &RunContext<'_>) -> String {
    let passed: Vec<String> = run
        .checks
        .iter()
        .filter(|c| c.exit_code == Some(0) && run.rounds.last().is_some_and(|r| r.round == c.round))
        .map(|c| format!("- `{}` (exit 0)", c.argv.join(" ")))
        .collect();
    if passed.is_empty() {
        "No verification commands were configured.".to_string()
    } else {
        passed.join("\n")
    }
}
