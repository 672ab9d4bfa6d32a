//! The run engine: performs one job from clone to delivery, publishing every event.
//!
//! It drives [`RunMachine`] by running the stage each phase asks for in a container through the
//! [`ContainerRuntime`] seam, polls the [`CycleCollector`] while stages run and sweeps after each
//! exits, and reports through the [`EventSink`] seam. The same engine serves `forgepool run`
//! and `forgepool worker`; only the sink and the queue differ.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::{
    AgentProfile, CheckResult, Checkpoint, CycleOrigin, CycleRecord, Event, EventKind, Job,
    Network, RoundRecord, RunResult, RunState, Stage, StageOutcome, MAX_CHECKPOINT_PATCH_BYTES,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn, Instrument};
use uuid::Uuid;

use crate::delivery::report::{self, ReportInput};
use crate::engine::machine::{FailureSignature, Input, Limits, Phase, RoundReason, RunMachine};
use crate::ports::gate::{LocalGate, ProfileGate};
use crate::ports::ledger::{Receipt, ReviewLedger};
use crate::ports::sink::{EventSink, PublishEvent};
use crate::ports::sink::{Redacting, Stamped};
use crate::review::collector::{write_atomically, CycleCollector};
use crate::review::final_report::FinalReport;
use crate::review::verdict::{self, Verdict};
use crate::runtime::{
    tail, ContainerRuntime, LogChunk, Mount, RuntimeError, StageExit, StageOutput, StageSpec,
    LABEL_RUN, LABEL_STAGE,
};
use crate::workspace::git;
use crate::workspace::leftovers;

mod agent;
mod checkpoint;
use checkpoint::keep_progress;
mod context;
mod control;
pub use control::RunControl;
mod deliver;
mod final_review;
mod gated;
mod implement;
pub mod machine;
mod model;
mod outputs;
mod prompt;
mod pull;
mod refusal;
mod review;
mod stage;
#[cfg(test)]
mod tests;
mod verify;

use context::RunContext;
pub use gated::Execution;
use gated::{over_budget, Gated};
use stage::{agent_mounts, workspace_mounts, PreparedStage, StageRequest};

pub use crate::agents::EXIT_PAUSED;

/// Where a stage stands in its run: its kind, its round and, for a review, its cycle.
#[derive(Debug, Clone, Copy)]
struct StagePlace {
    stage: Stage,
    round: u32,
    cycle: Option<u32>,
}

/// The default interval between scans of `.forge/` while a stage runs.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(100);
/// The user stage containers run as when the worker runs as root: `nobody`.
pub const DEFAULT_STAGE_USER: (u32, u32) = (65_534, 65_534);
/// The default pids limit of a stage container.
pub const DEFAULT_PIDS_LIMIT: i64 = 512;
/// Feedback and failure text cut for history entries.
const TAIL_FOR_PROMPT: usize = 8 * 1024;

/// How the engine works; the same for every run.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Where run workspaces are created; each run gets `{root}/{run_id}` and it is removed at
    /// the end.
    pub workspace_root: PathBuf,
    /// How often `.forge/` is scanned while a stage runs.
    pub poll_interval: Duration,
    /// The `uid:gid` stage containers run as, unless a profile names a user.
    pub stage_user: (u32, u32),
    /// Whether the worker may change file ownership (it runs as root).
    pub can_chown: bool,
    /// The pids limit of every stage container.
    pub pids_limit: i64,
    /// Whether the operator lets profiles with `network = "bridge"` run
    /// (`FORGEPOOL_ALLOW_BRIDGE_NETWORK`).
    pub allow_bridge: bool,
    /// The repository cache runs clone through (`FORGEPOOL_CACHE_DIR`); `None` clones
    /// directly.
    pub cache: Option<crate::workspace::cache::RepoCache>,
    /// What decides whether an agent stage may start (profile caps and pauses).
    pub gate: Arc<dyn ProfileGate>,
    /// The worker's model gateway, which stages of a profile with a `provider` reach their
    /// model through; without it such a stage fails saying so.
    pub gateway: Option<Arc<gateway::Gateway>>,
}

impl EngineConfig {
    /// A configuration for this process: root workers run stages as `nobody` and hand the
    /// workspace to that user; other workers run stages as themselves.
    pub fn for_process(workspace_root: PathBuf) -> EngineConfig {
        let (uid, gid) = process_owner();
        let can_chown = uid == 0;
        EngineConfig {
            poll_interval: DEFAULT_POLL_INTERVAL,
            stage_user: if can_chown {
                DEFAULT_STAGE_USER
            } else {
                (uid, gid)
            },
            can_chown,
            pids_limit: DEFAULT_PIDS_LIMIT,
            allow_bridge: false,
            cache: Some(crate::workspace::cache::RepoCache::new(
                workspace_root.join(".cache"),
                crate::workspace::cache::DEFAULT_CACHE_BYTES,
            )),
            gate: Arc::new(LocalGate::default()),
            gateway: None,
            workspace_root,
        }
    }
}

/// Runs jobs.
#[derive(Debug)]
pub struct Engine<R> {
    runtime: Arc<R>,
    config: EngineConfig,
}

impl<R: ContainerRuntime> Engine<R> {
    /// An engine over a runtime.
    pub fn new(runtime: Arc<R>, config: EngineConfig) -> Engine<R> {
        Engine { runtime, config }
    }

    /// The same engine asking `gate` before every agent stage.
    pub fn with_gate(mut self, gate: Arc<dyn ProfileGate>) -> Engine<R> {
        self.config.gate = gate;
        self
    }

    /// The runtime.
    pub fn runtime(&self) -> &Arc<R> {
        &self.runtime
    }

    /// Where run folders are made.
    pub fn workspace_root(&self) -> &Path {
        &self.config.workspace_root
    }

    /// Performs a job to its end and returns the result. The final `result` and `state`
    /// events are published before this returns; an error means they could not be, and the
    /// job must be handed back.
    ///
    /// `control.cancel` is a user's cancel: the run ends `cancelled`. `control.interrupt` is a
    /// worker shutting down or losing its claim: the run's containers are stopped, no final
    /// event is published, and `Ok(None)` says the job must be handed back to the queue.
    pub async fn execute<S: EventSink, L: ReviewLedger>(
        &self,
        job: &Job,
        sink: &S,
        ledger: &L,
        control: RunControl,
    ) -> Result<Option<RunResult>, PublishEvent> {
        Ok(
            match self.execute_in_pool(job, sink, ledger, control).await? {
                Execution::Ended(result) => Some(*result),
                Execution::HandedBack | Execution::Waiting(_) => None,
            },
        )
    }

    /// Like [`Engine::execute`], and tells a hand-back from a run that waits for its
    /// profile's cap.
    pub async fn execute_in_pool<S: EventSink, L: ReviewLedger>(
        &self,
        job: &Job,
        sink: &S,
        ledger: &L,
        control: RunControl,
    ) -> Result<Execution, PublishEvent> {
        let RunControl {
            cancel,
            interrupt,
            again,
            handover,
        } = control;
        self.attempt(job, sink, ledger, (cancel, interrupt, handover), again)
            .await
    }

    async fn attempt<S: EventSink, L: ReviewLedger>(
        &self,
        job: &Job,
        sink: &S,
        ledger: &L,
        (cancel, interrupt, handover): (CancellationToken, CancellationToken, CancellationToken),
        again: bool,
    ) -> Result<Execution, PublishEvent> {
        let span = tracing::info_span!("run", run_id = %job.run_id, ticket = %job.ticket, stage = tracing::field::Empty, cycle = tracing::field::Empty);
        async {
            // Every event of the run leaves through the redacting sink: a secret an agent wrote
            // into a file, or that git printed, is never stored or shown.
            let sink = &Redacting::new(sink, run_secrets(job));
            // Each execution draws its epoch: the dispatcher ignores a superseded one.
            let sink = &Stamped::new(sink, Uuid::new_v4());
            let root = self.config.workspace_root.join(job.run_id.to_string());
            let owned = leftovers::own(&self.config.workspace_root, &job.run_id.to_string()).await;
            let mut run = RunContext::new(job, &root);
            run.again = again;
            run.handover = handover;
            // Stages stop on either token; the loop tells the two apart.
            let stop = CancellationToken::new();
            let relay = {
                let (stop, cancel, interrupt) = (stop.clone(), cancel.clone(), interrupt.clone());
                tokio::spawn(async move {
                    tokio::select! {
                        () = cancel.cancelled() => {},
                        () = interrupt.cancelled() => {},
                    }
                    stop.cancel();
                })
            };
            let performed = self
                .perform(&mut run, sink, ledger, &cancel, &interrupt, &stop)
                .await;
            relay.abort();
            // The run's end is published before its workspace is removed: a big repository's
            // work tree takes seconds to delete, and the run is over for its user already.
            let ended = async {
                let Some((state, reason)) = performed? else {
                    if let Some(role) = run.waiting {
                        info!(
                            ?role,
                            "the run waits for its profile's cap; handing it back"
                        );
                        return Ok(Execution::Waiting(role));
                    }
                    info!("run interrupted; handing it back");
                    return Ok(Execution::HandedBack);
                };
                let mut result = run.result(state, &reason);
                result.change = run.change().await;
                // The run ended or paused (with a checkpoint of its own): its progress is done
                // with, and is forgotten while the result is published.
                let run_key = job.run_id.to_string();
                let (cleared, published) = tokio::join!(
                    ledger.clear_progress(&run_key),
                    publish(
                        sink,
                        job.run_id,
                        EventKind::Result {
                            result: result.clone(),
                        },
                    )
                );
                if let Err(error) = cleared {
                    warn!(%error, "cannot forget the run's progress");
                }
                published?;
                publish(sink, job.run_id, EventKind::State { state, reason }).await?;
                info!(state = %result.state, rounds = result.implementation_rounds, "run ended");
                Ok(Execution::Ended(Box::new(result)))
            }
            .await;
            if let Err(error) = remove_dir(&root).await {
                warn!(%error, path = %root.display(), "cannot remove the run workspace");
            }
            drop(owned);
            ended
        }
        .instrument(span)
        .await
    }

    async fn perform<S: EventSink, L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        ledger: &L,
        cancel: &CancellationToken,
        interrupt: &CancellationToken,
        stop: &CancellationToken,
    ) -> Result<Option<(RunState, String)>, PublishEvent> {
        // Every execution says first that it runs the run: the dispatcher makes it the run's
        // current execution (SPEC 11), so even one that ends at once is heard. The workspace
        // is prepared while the broker confirms it: neither waits for the other, and no stage
        // starts before both are done.
        let started = publish(
            sink,
            run.job.run_id,
            EventKind::State {
                state: RunState::Running,
                reason: "a worker started the run".into(),
            },
        );
        // A copy that may follow an earlier execution reads the progress kept on the broker,
        // meanwhile too; a first copy has none.
        let (job, again) = (run.job, run.again);
        let kept = async move {
            if !again {
                return Ok(None);
            }
            ledger.progress(&job.run_id.to_string()).await
        };
        let (started, prepared, kept) =
            tokio::join!(started, self.checked_prepare(run, ledger), kept);
        started?;
        let mut ahead = match prepared {
            Ok(ahead) => ahead,
            Err(ended) => return Ok(ended),
        };
        crate::fault::point("started");
        let cancel_user = cancel;
        let cancel = stop;
        let (mut machine, continued) = match self.start_from(run, kept).await {
            Ok(started) => started,
            Err(reason) => return Ok(Some((RunState::Failed, reason))),
        };
        // An execution that continues kept progress (kept before the delivery), or whose job
        // the broker delivered again, may follow one that pushed: it reads the branch before
        // running anything. A first execution leaves that to the check before its push.
        if continued || run.again {
            if let Some(ended) = self.delivered_earlier(run).await {
                return Ok(Some(ended));
            }
        }
        let mut progress = None;
        loop {
            if let Some((state, reason)) = machine.finished() {
                if matches!(state, RunState::Delivered | RunState::DeliveredWithWarnings) {
                    self.pull_request(run, sink, state, reason).await?;
                }
                return Ok(Some((state, reason.to_string())));
            }
            if interrupt.is_cancelled() {
                return Ok(None);
            }
            if run.hands_over_before(&machine.phase) {
                // The stage that just ended is kept first: the next execution goes on from it.
                keep_progress(ledger, run.job.run_id, progress.take()).await;
                return Ok(None);
            }
            if let Some(reason) = over_budget(run, &machine) {
                return Ok(Some((RunState::Failed, reason)));
            }
            let input = if cancel_user.is_cancelled() {
                Input::Cancelled
            } else if let Phase::Paused { reason, resume } = &machine.phase {
                let reason = self
                    .pause(run, sink, &machine, reason, (**resume).clone())
                    .await?;
                return Ok(Some((RunState::Paused, reason)));
            } else {
                let place = (cancel, &machine);
                match self
                    .gated_input(run, sink, ledger, place, &mut ahead, &mut progress)
                    .await?
                {
                    Gated::Input(input) => input,
                    Gated::Waiting => return Ok(None),
                }
            };
            if interrupt.is_cancelled() {
                return Ok(None);
            }
            machine = match machine.step(input) {
                Ok(next) => next,
                Err(error) => return Ok(Some((RunState::Failed, error.to_string()))),
            };
            run.review_exhausted = machine.review_exhausted;
            run.implementation_rounds = machine.implementation_rounds;
            progress = self.progress(run, &machine).await;
        }
    }

    /// Runs the phase the machine is in and returns what happened, as the machine's input.
    async fn phase_input<S: EventSink, L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        ledger: &L,
        cancel: &CancellationToken,
        machine: &RunMachine,
        ahead: Option<Ahead<R::Created>>,
    ) -> Result<Input, PublishEvent> {
        match machine.phase.clone() {
            Phase::Implement { round, reason } => {
                // The container made ahead is round 1's: a run continuing from saved progress
                // starts elsewhere, and it is dropped (and removed).
                let ahead = ahead.filter(|_| round == 1 && reason == RoundReason::Initial);
                let cycles_used = machine.cycles_used;
                self.implement(run, sink, cancel, round, &reason, cycles_used, ahead)
                    .await
            }
            Phase::Verify { round, tree } => self.verify(run, sink, cancel, round, &tree).await,
            Phase::Review { round, cycle, tree } => {
                self.review(run, sink, cancel, round, cycle, &tree).await
            }
            Phase::FinalReview { tree } => {
                self.final_review(run, sink, ledger, cancel, &tree).await
            }
            Phase::Deliver { tree } => Ok(self.deliver(run, ledger, &tree).await),
            Phase::Paused { .. } | Phase::Finished { .. } => {
                unreachable!("the loop ends the run in these phases")
            }
        }
    }

    /// With a final reviewer: the ending of a run whose earlier execution died during its
    /// final review (an unknown outcome is never reviewed again blindly), or a hand-back when
    /// the ledger cannot be read (`Some(None)`).
    async fn earlier_final_review<L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        ledger: &L,
    ) -> Option<Option<(RunState, String)>> {
        run.job.final_reviewer.as_ref()?;
        match ledger.lookup(&run.job.run_id.to_string()).await {
            Ok(entry) => {
                let tree = entry.unknown_outcome()?;
                run.final_unknown = true;
                Some(Some((
                    RunState::Blocked,
                    format!(
                        "unknown outcome: an earlier execution of this run died during the final review of tree {tree}, and a final review is never repeated blindly. Inspect the run's events and the final reviewer's side (its provider may have done the work), then submit a new run"
                    ),
                )))
            }
            Err(error) => {
                warn!(%error, "cannot read the final review ledger; handing the job back");
                // Not at once: every delivery counts towards the queue's delivery limit.
                tokio::time::sleep(Duration::from_secs(5)).await;
                Some(None)
            }
        }
    }

    /// Where the run starts (`true` with kept progress): the checkpoint of a resume, else the
    /// progress an earlier execution `kept` (after a hand-over or a lost worker: completed
    /// stages are not run again, and the budget counts across executions), else round 1.
    /// `Err` is why it cannot.
    async fn start_from(
        &self,
        run: &mut RunContext<'_>,
        kept: Result<Option<Checkpoint>, crate::ports::ledger::LedgerError>,
    ) -> Result<(RunMachine, bool), String> {
        // A resumed job's own executions keep progress numbered after its checkpoint; older
        // progress (from before the pause) is not its own.
        let resumed_at = run.job.resume.as_ref().map(|c| c.sequence);
        let kept = kept
            .map(|kept| kept.filter(|progress| resumed_at.is_none_or(|at| progress.sequence > at)));
        let (checkpoint, what) = match (run.job.resume.clone(), kept) {
            (_, Ok(Some(progress))) => (progress, "progress"),
            (Some(checkpoint), _) => (checkpoint, "checkpoint"),
            (None, kept) => match kept {
                Ok(Some(progress)) => (progress, "progress"),
                Ok(None) => return Ok((RunMachine::for_job(run.limits(), run.job), false)),
                Err(error) => {
                    warn!(%error, "cannot read the run's progress; starting from round 1");
                    return Ok((RunMachine::for_job(run.limits(), run.job), false));
                }
            },
        };
        match run.restore(&checkpoint).await {
            Ok(machine) => {
                info!(
                    sequence = checkpoint.sequence,
                    what,
                    phase = machine.phase.name(),
                    "continuing from saved progress"
                );
                Ok((machine, what == "progress"))
            }
            Err(error) => Err(format!(
                "cannot resume from {what} {}: {error}",
                checkpoint.sequence
            )),
        }
    }

    /// After a completed stage, where the run stands, for a later execution to continue from
    /// (kept while the next phase runs). `None` at the end, at a pause, or when it cannot be
    /// made (that only costs a later execution the stages since the last).
    async fn progress(&self, run: &RunContext<'_>, machine: &RunMachine) -> Option<Checkpoint> {
        if machine.finished().is_some() || matches!(machine.phase, Phase::Paused { .. }) {
            return None;
        }
        run.checkpoint(machine, machine.phase.clone())
            .await
            .map_err(|error| warn!(%error, "cannot save the run's progress"))
            .ok()
    }

    /// The run's refusals and the final review ledger, then its workspace (with a fresh run's
    /// first implementer container made during the clone). `Err` is how the run ends instead:
    /// `Some` state, or `None` to hand it back.
    async fn checked_prepare<L: ReviewLedger>(
        &self,
        run: &mut RunContext<'_>,
        ledger: &L,
    ) -> Result<Option<Ahead<R::Created>>, Option<(RunState, String)>> {
        if let Some(ended) = self.earlier_final_review(run, ledger).await {
            return Err(ended);
        }
        if let Some(reason) = self.refusal(run.job) {
            return Err(Some((RunState::Failed, reason)));
        }
        let fresh = run.job.resume.is_none();
        self.prepare(run, fresh).await.map_err(|error| {
            Some((
                RunState::Failed,
                format!("cannot prepare the workspace: {error}"),
            ))
        })
    }

    /// The ending of a run an earlier execution already delivered: the remote branch holds a
    /// commit with this run's trailer, so nothing runs or is pushed again. An unreadable
    /// branch is checked again before the push.
    async fn delivered_earlier(&self, run: &mut RunContext<'_>) -> Option<(RunState, String)> {
        let job = run.job;
        let branch = deliver::delivery_branch(job);
        let seen = git::remote_delivery(&run.repo, &job.repository.url, &branch).await;
        let (commit, owner) = match seen {
            Ok(Some(seen)) => seen,
            Ok(None) => return None,
            Err(error) => {
                warn!(%error, "cannot read the delivery branch before running");
                return None;
            }
        };
        if owner.as_deref() != Some(job.run_id.to_string().as_str()) {
            return None;
        }
        let tree = run
            .repo
            .git(&["rev-parse", &format!("{commit}^{{tree}}")])
            .await
            .unwrap_or_default();
        info!(%branch, %commit, "already delivered by an earlier execution");
        let reason = format!("an earlier execution of this run delivered commit {commit} to {branch}; nothing ran again");
        run.delivered = Some((branch, commit, tree));
        Some((RunState::Delivered, reason))
    }

    /// Makes the run's folder and clones the repository into it. With `ahead`, the first
    /// implementer's container is created while the clone runs, and returned.
    async fn prepare(
        &self,
        run: &mut RunContext<'_>,
        ahead: bool,
    ) -> Result<Option<Ahead<R::Created>>, String> {
        remove_dir(&run.root).await.map_err(|e| e.to_string())?;
        tokio::fs::create_dir_all(&run.root)
            .await
            .map_err(|e| format!("{}: {e}", run.root.display()))?;
        let repository = &run.job.repository;
        let repo = run.repo.clone();
        // The container made ahead mounts the stages' git folder of a layered work tree.
        let layered = crate::workspace::overlay::enabled() && self.config.cache.is_some();
        let stage_git = crate::workspace::overlay::layer_dir(&repo.work_tree).join("git");
        if layered {
            tokio::fs::create_dir_all(&stage_git)
                .await
                .map_err(|e| format!("{}: {e}", stage_git.display()))?;
        }
        let clone = async {
            let (url, reference) = (&repository.url, repository.git_ref.as_deref());
            match &self.config.cache {
                // Layered workspaces are owned by the stage user from the start.
                Some(cache) => {
                    let layered =
                        crate::workspace::overlay::enabled().then_some(self.config.stage_user);
                    cache.clone_layered(url, reference, &repo, layered).await
                }
                None => git::clone_at(url, reference, &repo)
                    .await
                    .map(|c| (c, None)),
            }
        };
        let began = Instant::now();
        let (cloned, mut created) = if ahead {
            tokio::join!(clone, self.create_first_implementer(run))
        } else {
            (clone.await, None)
        };
        (run.base, run.base_tree) = cloned.map_err(|e| e.to_string())?;
        if layered && run.base_tree.is_none() {
            // Checked out after all: the container made ahead would mount the wrong `.git`.
            let _ =
                tokio::fs::remove_dir_all(crate::workspace::overlay::layer_dir(&repo.work_tree))
                    .await;
            created = None;
        }
        repo.make_disposable_copy()
            .await
            .map_err(|e| format!("cannot give the stages their git copy: {e}"))?;
        // A container's deadline label allows one GIT_TIMEOUT between its creation and its
        // start: after a clone that long, it is dropped (and removed), and made again.
        if began.elapsed() > git::GIT_TIMEOUT / 2 {
            return Ok(None);
        }
        Ok(created)
    }

    /// The first round's implementer: its folders, spec and container. `None` when either
    /// cannot be made now; the round then makes them again, under a new stage number (a
    /// create that timed out may still have made a container of that name), and reports the
    /// error.
    async fn create_first_implementer(
        &self,
        run: &mut RunContext<'_>,
    ) -> Option<Ahead<R::Created>> {
        // A stage token lives from its stage's start: a gateway profile's stage is made then.
        if run.job.implementer.provider.is_some() {
            return None;
        }
        let prepared = self
            .implement_spec(run, 1, &RoundReason::Initial, 0)
            .await
            .ok()?;
        let created = self
            .runtime
            .create_stage(prepared.spec.clone())
            .await
            .ok()?;
        Some(Ahead { prepared, created })
    }
}

/// The first implementer of a fresh run, prepared while its repository is cloned: its spec
/// (its folders are written) and its container, not started.
struct Ahead<C> {
    prepared: PreparedStage,
    created: C,
}

async fn publish<S: EventSink>(
    sink: &S,
    run_id: Uuid,
    kind: EventKind,
) -> Result<(), PublishEvent> {
    sink.publish(Event::new(run_id, kind)).await
}

async fn remove_dir(path: &Path) -> std::io::Result<()> {
    crate::workspace::overlay::remove_folder(path).await
}

/// The effective uid and gid of this process.
fn process_owner() -> (u32, u32) {
    let (uid, gid) = (rustix::process::geteuid(), rustix::process::getegid());
    (uid.as_raw(), gid.as_raw())
}

/// The values of every secret the run's profiles name, from the worker's environment.
fn run_secrets(job: &Job) -> Vec<String> {
    [
        Some(&job.implementer),
        job.reviewer.as_ref(),
        job.final_reviewer.as_ref(),
    ]
    .into_iter()
    .flatten()
    .flat_map(|profile| profile.env.iter())
    .filter_map(|name| std::env::var(name).ok())
    .chain(crate::delivery::forges::forges().secrets())
    .collect()
}

fn last_line(text: &str) -> &str {
    text.trim_end().lines().last().unwrap_or("").trim()
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}
