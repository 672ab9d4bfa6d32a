//! The pool's rules around each agent stage: the profile's gate (caps and pauses across the
//! pool) before it, a provider's pause passed on to the pool after it, the run's budget, and
//! the pause that saves a checkpoint.

use super::*;
use crate::ports::gate::{Admission, Role};

/// How an execution of a run ended, for the worker that settles its job.
#[derive(Debug)]
pub enum Execution {
    /// The run ended or paused; its final events are confirmed.
    Ended(Box<RunResult>),
    /// The run was interrupted (a drain, a lost claim): its job goes back.
    HandedBack,
    /// The run waits for a cap slot of the profile in this role: its job waits on the broker
    /// and holds no run slot meanwhile.
    Waiting(Role),
}

/// What the phase gave, or that the run handed itself back to wait for its profile's cap.
pub(super) enum Gated {
    /// The machine's input.
    Input(Input),
    /// Every cap slot is taken: the run's progress is kept, and its job waits on the broker.
    Waiting,
}

impl<R: ContainerRuntime> Engine<R> {
    /// Runs the phase the machine is in, behind its profile's gate: a paused profile pauses
    /// the run until the pause ends; a full cap hands the run back to wait, its progress kept.
    pub(super) async fn gated_input<S: EventSink, L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        ledger: &L,
        place: (&CancellationToken, &RunMachine),
        ahead: &mut Option<Ahead<R::Created>>,
        progress: &mut Option<Checkpoint>,
    ) -> Result<Gated, PublishEvent> {
        let run_id = run.job.run_id;
        let role = Role::of_phase(&place.1.phase);
        let profile = role.and_then(|role| role.profile(run.job));
        let Some(admission) = self.admit(run_id, profile).await else {
            let input = self
                .run_phase(run, sink, ledger, place, ahead, progress, profile)
                .await?;
            return Ok(Gated::Input(input));
        };
        let name = profile.map_or("", |p| p.name.as_str());
        match admission {
            Admission::Go(ticket) => {
                let input = self
                    .run_phase(run, sink, ledger, place, ahead, progress, profile)
                    .await;
                ticket.release().await;
                Ok(Gated::Input(input?))
            }
            Admission::Paused(pause) => {
                let reason = format!(
                    "agent profile `{name}` is paused across the pool until {} ({})",
                    pause.until, pause.reason
                );
                run.resume_at = Some(pause.until);
                Ok(Gated::Input(Input::StagePaused { reason }))
            }
            Admission::Busy { max } => {
                // The run waits without its slot: what it did so far is kept first.
                keep_progress(ledger, run_id, progress.take()).await;
                let reason = proto::waiting_reason(name, max);
                let state = RunState::Queued;
                publish(sink, run_id, EventKind::State { state, reason }).await?;
                run.waiting = role;
                Ok(Gated::Waiting)
            }
        }
    }

    /// Asks the gate whether an agent stage of `profile` may start; `None` for a phase that
    /// runs no agent.
    async fn admit(&self, run_id: Uuid, profile: Option<&AgentProfile>) -> Option<Admission> {
        Some(self.config.gate.admit(run_id, profile?).await)
    }

    /// Runs the phase the machine is in while the progress of the stage before is kept, and
    /// passes a provider's pause of the stage's `profile` on to the pool.
    #[allow(clippy::too_many_arguments)]
    async fn run_phase<S: EventSink, L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        ledger: &L,
        (cancel, machine): (&CancellationToken, &RunMachine),
        ahead: &mut Option<Ahead<R::Created>>,
        progress: &mut Option<Checkpoint>,
        profile: Option<&AgentProfile>,
    ) -> Result<Input, PublishEvent> {
        let run_id = run.job.run_id;
        let stage = ahead.take();
        let (input, ()) = tokio::join!(
            self.phase_input(run, sink, ledger, cancel, machine, stage),
            keep_progress(ledger, run_id, progress.take()),
        );
        if let (Some(pause), Some(profile)) = (run.pause.take(), profile) {
            if std::mem::take(&mut run.pause_pool) {
                info!(profile = %profile.name, until = %pause.until, reason = %pause.reason, "the provider paused the profile");
                self.config.gate.pause(run_id, &profile.name, &pause).await;
            } else {
                info!(profile = %profile.name, until = %pause.until, reason = %pause.reason, "the stage's agent paused its own run; the profile goes on across the pool");
            }
            run.resume_at = Some(pause.until);
        }
        input
    }

    /// Saves a paused run's checkpoint and publishes it; returns the paused state's reason.
    pub(super) async fn pause<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        machine: &RunMachine,
        reason: &str,
        resume: Phase,
    ) -> Result<String, PublishEvent> {
        let run_id = run.job.run_id;
        match run.checkpoint(machine, resume).await {
            Ok(checkpoint) => {
                let resume_at = checkpoint.resume_at.clone();
                publish(sink, run_id, EventKind::Checkpoint { checkpoint }).await?;
                Ok(match resume_at {
                    Some(at) => format!("{reason}; the provider asked to wait until {at}: a pool resumes it then by itself (unless FORGEPOOL_AUTO_RESUME=false), or `forgepool resume {run_id}` does at any time"),
                    None => format!("{reason}; resume it with `forgepool resume {run_id}` once the provider is ready"),
                })
            }
            Err(error) => {
                warn!(%error, "cannot save the paused run's progress");
                Ok(format!("{reason}; its progress could not be saved ({error}), so it cannot be resumed: submit a new run"))
            }
        }
    }
}

/// Why the run stops before its next stage: its stages reported more cost than its budget
/// allows. A run about to deliver an approved change delivers it (delivery costs nothing).
pub(super) fn over_budget(run: &RunContext<'_>, machine: &RunMachine) -> Option<String> {
    let (budget, usage) = (run.job.budget.as_ref()?, run.usage.as_ref()?);
    let max_cost_usd = budget.max_cost_usd?;
    if usage.cost_usd <= max_cost_usd || matches!(machine.phase, Phase::Deliver { .. }) {
        return None;
    }
    Some(format!(
        "budget exceeded: the run's stages reported ${:.4}, over its budget of ${max_cost_usd:.2} (budget.max_cost_usd); no further stage was started",
        usage.cost_usd
    ))
}
