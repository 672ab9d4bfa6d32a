//! The implement phase: the implementer's prompt, folders and container for a round, and
//! its outcome as the machine's input.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    /// The implementer's prompt and folders for a round, and its container's spec.
    pub(super) async fn implement_spec(
        &self,
        run: &mut RunContext<'_>,
        round: u32,
        reason: &RoundReason,
        cycles_used: u32,
    ) -> Result<PreparedStage, String> {
        let job = run.job;
        let prompt = prompt::implement(&job.skill_md, &job.brief, reason);
        let stage_dir = run.stage_dirs(Stage::Implement, &prompt, None).await?;
        let profile = &job.implementer;
        let mounts = agent_mounts(&run.repo.work_tree, false, &stage_dir);
        Ok(self.prepare_stage(
            run,
            StageRequest::agent(
                StagePlace {
                    stage: Stage::Implement,
                    round,
                    cycle: None,
                },
                profile,
                mounts,
                profile.timeout_seconds,
                cycles_used + 1,
                &prompt,
            ),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn implement<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        cancel: &CancellationToken,
        round: u32,
        reason: &RoundReason,
        cycles_used: u32,
        ahead: Option<Ahead<R::Created>>,
    ) -> Result<Input, PublishEvent> {
        let job = run.job;
        let profile = &job.implementer;
        let (prepared, created) = match ahead {
            Some(ahead) => (ahead.prepared, Some(ahead.created)),
            None => match self.implement_spec(run, round, reason, cycles_used).await {
                Ok(prepared) => (prepared, None),
                Err(error) => return Ok(Input::StageFailed { reason: error }),
            },
        };
        if let Err(error) = run.write_workspace_history().await {
            return Ok(Input::StageFailed { reason: error });
        }
        let output = match self.run_stage(run, sink, cancel, prepared, created).await? {
            Ok(output) => output,
            Err(input) => return Ok(input),
        };
        Ok(match output.exit {
            StageExit::Cancelled => Input::Cancelled,
            StageExit::TimedOut => Input::StageFailed {
                reason: format!(
                    "the implementer timed out after {} s and was stopped",
                    profile.timeout_seconds
                ),
            },
            StageExit::Exited(EXIT_PAUSED) => Input::StagePaused {
                reason: format!(
                    "the implementer paused (exit 75): {}",
                    last_line(&output.tail)
                ),
            },
            StageExit::Exited(0) => match git::snapshot_tree(&run.repo).await {
                Ok(tree) => {
                    run.rounds.push(RoundRecord {
                        round,
                        reason: reason.name().into(),
                        tree: tree.clone(),
                        failing: vec![],
                        output_tail: String::new(),
                    });
                    Input::Implemented { tree }
                }
                Err(error) => Input::StageFailed {
                    reason: format!("cannot record the implementer's change: {error}"),
                },
            },
            StageExit::Exited(code) => Input::StageFailed {
                reason: format!(
                    "the implementer exited with code {code}; last output:\n{}",
                    tail(&output.tail, 2048)
                ),
            },
        })
    }
}
