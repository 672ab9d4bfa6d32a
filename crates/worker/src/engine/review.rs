//! The review phase: the reviewer's container over a read-only copy, its verdict, and
//! forgepool's own record of the cycle.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    pub(super) async fn review<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        cancel: &CancellationToken,
        round: u32,
        cycle: u32,
        tree: &str,
    ) -> Result<Input, PublishEvent> {
        let job = run.job;
        let (Some(review), Some(profile)) = (&job.review, &job.reviewer) else {
            return Ok(Input::StageFailed {
                reason: "review phase without a reviewer (job is inconsistent)".into(),
            });
        };
        tracing::Span::current().record("cycle", cycle);
        let copy = run.root.join(format!("review-{cycle}"));
        let prompt = prompt::review(&review.instructions, &job.brief);
        let stage_dir = match run
            .review_folders(Stage::Review, tree, &copy, &prompt)
            .await
        {
            Ok(dir) => dir,
            Err(error) => return Ok(Input::StageFailed { reason: error }),
        };
        let mounts = agent_mounts(&copy, true, &stage_dir);
        let prepared = self.prepare_stage(
            run,
            StageRequest::agent(
                StagePlace {
                    stage: Stage::Review,
                    round,
                    cycle: Some(cycle),
                },
                profile,
                mounts,
                review.timeout_seconds,
                cycle,
                &prompt,
            ),
        );
        let started = Instant::now();
        let output = match self.run_stage(run, sink, cancel, prepared, None).await? {
            Ok(output) => output,
            Err(input) => return Ok(input),
        };
        let _ = remove_dir(&copy).await;
        let verdict = match output.exit {
            StageExit::Cancelled => return Ok(Input::Cancelled),
            StageExit::Exited(EXIT_PAUSED) => {
                return Ok(Input::StagePaused {
                    reason: format!("the reviewer paused (exit 75): {}", last_line(&output.tail)),
                })
            }
            StageExit::Exited(0) => verdict::parse(&output.stdout),
            StageExit::TimedOut => Verdict::rejected(format!(
                "Reviewer timed out after {} seconds and was stopped",
                review.timeout_seconds
            )),
            StageExit::Exited(code) => Verdict::rejected(format!(
                "Reviewer crashed: it exited with code {code}; last output:\n{}",
                tail(&output.tail, 2048)
            )),
        };
        let record = cycle_record(job, review, cycle, &verdict, started.elapsed());
        let file_name = record.file.clone();
        run.collector.own(&job.step, &file_name);
        if let Err(error) = run.write_cycle_file(&record).await {
            return Ok(Input::StageFailed { reason: error });
        }
        run.record_cycle(record.clone());
        publish(sink, job.run_id, EventKind::Cycle { cycle: record }).await?;
        self.sweep(run, sink).await?;
        run.history.push(serde_json::json!({"round": round, "stage": "review", "cycle": cycle, "verdict": verdict.word(), "feedback": verdict.feedback}));
        Ok(Input::Reviewed {
            approved: verdict.approved,
            feedback: verdict.feedback,
        })
    }
}

/// Forgepool's own record of a review cycle (SPEC 8's fields), made from the stage it ran: it
/// is published from here, and the copy in the workspace (for the implementer's next round)
/// is never read back.
fn cycle_record(
    job: &Job,
    review: &proto::ReviewConfig,
    cycle: u32,
    verdict: &Verdict,
    elapsed: Duration,
) -> CycleRecord {
    let content = serde_json::json!({
        "cycle": cycle,
        "max_cycles": review.max_cycles,
        "verdict": verdict.word(),
        "feedback": verdict.feedback,
        "skill": job.skill,
        "elapsed_seconds": (elapsed.as_secs_f64() * 10.0).round() / 10.0,
        "timestamp": proto::timestamp_now(),
        "run_id": job.run_id,
        "ticket": job.ticket,
        "step": job.step,
    });
    CycleRecord {
        step: job.step.clone(),
        file: format!("review_cycle_{cycle}.json"),
        cycle,
        max_cycles: Some(review.max_cycles),
        verdict: verdict.word().to_string(),
        feedback: verdict.feedback.clone(),
        content,
        origin: CycleOrigin::Forgepool,
    }
}
