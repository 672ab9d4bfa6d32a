//! The verify phase: every verification command, in order, in a container over a fresh
//! copy of the implemented tree.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    pub(super) async fn verify<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        cancel: &CancellationToken,
        round: u32,
        tree: &str,
    ) -> Result<Input, PublishEvent> {
        let job = run.job;
        if job.commands.is_empty() {
            return Ok(Input::Verified);
        }
        let copy = run.root.join(format!("verify-{round}"));
        if let Err(error) = run.fresh_copy(tree, &copy).await {
            return Ok(Input::StageFailed { reason: error });
        }
        self.hand_over(&copy).await;
        let mut signature: FailureSignature = Vec::new();
        let mut report = String::new();
        for command in &job.commands {
            let mounts = workspace_mounts(&copy, false);
            let mut prepared = self.prepare_stage(
                run,
                StageRequest {
                    place: StagePlace {
                        stage: Stage::Verify,
                        round,
                        cycle: None,
                    },
                    profile: &job.implementer,
                    command: command.argv.clone(),
                    mounts,
                    network: Network::None,
                    timeout_seconds: command.timeout,
                    forge_cycle: 0,
                    agent: None,
                },
            );
            // Checks run the implementer's image without its secrets.
            prepared.spec.env.retain(|e| e.starts_with("FORGE_"));
            prepared.spec.redact.clear();
            let output = match self.run_stage(run, sink, cancel, prepared, None).await? {
                Ok(output) => output,
                Err(input) => return Ok(input),
            };
            let exit_code = match output.exit {
                StageExit::Cancelled => return Ok(Input::Cancelled),
                StageExit::TimedOut => None,
                StageExit::Exited(code) => Some(code),
            };
            let result = CheckResult {
                round,
                argv: command.argv.clone(),
                exit_code,
                duration_seconds: output.duration.as_secs_f64(),
                output_tail: tail(&output.tail, 2048).to_string(),
            };
            publish(
                sink,
                job.run_id,
                EventKind::Check {
                    result: result.clone(),
                },
            )
            .await?;
            if exit_code != Some(0) {
                signature.push((command.argv.clone(), exit_code));
                let code = exit_code
                    .map_or(format!("timed out after {} s", command.timeout), |c| {
                        format!("exited with code {c}")
                    });
                report.push_str(&format!(
                    "### `{}` {code}\n\n```\n{}\n```\n\n",
                    command.argv.join(" "),
                    tail(&output.tail, 2048).trim_end()
                ));
            }
            run.checks.push(result);
        }
        let _ = remove_dir(&copy).await;
        if signature.is_empty() {
            return Ok(Input::Verified);
        }
        if let Some(record) = run.rounds.iter_mut().rev().find(|r| r.round == round) {
            record.failing = signature.clone();
            record.output_tail = tail(&report, TAIL_FOR_PROMPT).to_string();
        }
        run.history.push(serde_json::json!({"round": round, "stage": "verify", "failed_checks": tail(&report, TAIL_FOR_PROMPT)}));
        Ok(Input::ChecksFailed { signature, report })
    }
}
