//! Running one stage: its container's spec, the container with its output forwarded and
//! `.forge/` polled, the disk allowance watched, and the sweep after it exits.

use super::outputs::settle_outputs;
use super::*;
use crate::agents::{Invocation, Role};

/// What a phase asks of one stage.
#[derive(Debug)]
pub(super) struct StageRequest<'p> {
    pub(super) place: StagePlace,
    /// The profile whose image, user, limits and secrets the container gets.
    pub(super) profile: &'p AgentProfile,
    pub(super) command: Vec<String>,
    pub(super) mounts: Vec<Mount>,
    pub(super) network: Network,
    pub(super) timeout_seconds: u64,
    /// `FORGE_CYCLE` in the container: the review cycle the stage belongs to (0 for none).
    pub(super) forge_cycle: u32,
    /// For a profile of an agent kind: the CLI's environment (its command is `command`).
    pub(super) agent: Option<Invocation>,
}

impl<'p> StageRequest<'p> {
    /// A request to run an agent on its network: `profile`'s own command, or for an agent
    /// kind the kind's command line with `prompt`.
    pub(super) fn agent(
        place: StagePlace,
        profile: &'p AgentProfile,
        mounts: Vec<Mount>,
        timeout_seconds: u64,
        forge_cycle: u32,
        prompt: &str,
    ) -> StageRequest<'p> {
        // With a provider, the CLI's base URL is the worker's model gateway.
        let agent = match super::model::gateway_base_url(profile) {
            Some(url) => {
                let mut through_gateway = profile.clone();
                through_gateway.base_url = Some(url);
                crate::agents::invocation(&through_gateway, Role::of(place.stage), prompt)
            }
            None => crate::agents::invocation(profile, Role::of(place.stage), prompt),
        };
        StageRequest {
            place,
            profile,
            command: agent
                .as_ref()
                .map_or_else(|| profile.command.clone(), |a| a.command.clone()),
            mounts,
            network: profile.network,
            timeout_seconds,
            forge_cycle,
            agent,
        }
    }
}

/// A stage ready to run: its container's spec and its place in the run.
#[derive(Debug)]
pub(super) struct PreparedStage {
    pub(super) spec: StageSpec,
    pub(super) place: StagePlace,
    /// The stage's pass to the model gateway (its profile has a `provider`).
    pub(super) pass: Option<gateway::Pass>,
    /// Why the stage cannot run (no pass could be made): it fails with this reason.
    pub(super) refused: Option<String>,
}

impl<R: ContainerRuntime> Engine<R> {
    /// The container's spec for a request: forgepool's variables, the profile's secrets, its
    /// user and limits, the labels and a unique name.
    pub(super) fn prepare_stage(
        &self,
        run: &RunContext<'_>,
        request: StageRequest<'_>,
    ) -> PreparedStage {
        let StageRequest {
            place,
            profile,
            command,
            mounts,
            network,
            timeout_seconds,
            forge_cycle: cycle,
            agent,
        } = request;
        let (stage, round) = (place.stage, place.round);
        let job = run.job;
        let max_cycles = job.review.as_ref().map_or(0, |r| r.max_cycles);
        let mut env = vec![
            format!("FORGE_STAGE={}", stage.as_str()),
            format!("FORGE_RUN_ID={}", job.run_id),
            format!("FORGE_TICKET={}", job.ticket),
            format!("FORGE_SKILL={}", job.skill),
            format!("FORGE_STEP={}", job.step),
            format!("FORGE_CYCLE={cycle}"),
            format!("FORGE_MAX_CYCLES={max_cycles}"),
            format!("FORGE_ROUND={round}"),
            "FORGE_PROMPT_FILE=/forge/input/prompt.md".to_string(),
            "HOME=/tmp".to_string(),
        ];
        let kind = agent.map(|invocation| {
            // The CLI's home is its own, under /tmp.
            env.retain(|e| !e.starts_with("HOME="));
            env.extend(invocation.env);
            profile.kind
        });
        let mut redact = Vec::new();
        for name in &profile.env {
            match std::env::var(name) {
                Ok(value) => {
                    env.push(format!("{name}={value}"));
                    redact.push(value);
                }
                Err(_) => {
                    warn!(profile = %profile.name, variable = %name, "the profile names an environment variable the worker does not have")
                }
            }
        }
        let name = format!(
            "forgepool-{}-{}-{}",
            &job.run_id.simple().to_string()[..12],
            stage.as_str().replace('_', "-"),
            Uuid::new_v4().simple().to_string().get(..8).unwrap_or("x")
        );
        let (pass, refused) = match stage {
            Stage::Verify => (None, None),
            _ => self.grant_pass(
                run,
                profile,
                (&name, timeout_seconds),
                &mut env,
                &mut redact,
            ),
        };
        let user = profile.user.clone().unwrap_or_else(|| {
            format!("{}:{}", self.config.stage_user.0, self.config.stage_user.1)
        });
        let mut labels = HashMap::new();
        labels.insert(LABEL_RUN.to_string(), job.run_id.to_string());
        labels.insert(LABEL_STAGE.to_string(), stage.as_str().to_string());
        let spec = StageSpec {
            gateway: pass.is_some(),
            name,
            image: profile.image.clone(),
            command,
            env,
            mounts,
            network,
            memory_bytes: profile.memory_bytes,
            cpus: profile.cpus,
            pids_limit: self.config.pids_limit,
            read_only_root: profile.read_only_root,
            disk_bytes: profile.disk_bytes,
            egress: profile.egress.clone(),
            user: Some(user),
            workdir: Some("/workspace".into()),
            timeout: Duration::from_secs(timeout_seconds),
            labels,
            redact,
            agent: kind,
        };
        PreparedStage {
            spec,
            place,
            pass,
            refused,
        }
    }

    /// Runs one stage container while forwarding its output and polling `.forge/`, then sweeps
    /// once more. A runtime error ends the run: `Err(input)` is that ending.
    pub(super) async fn run_stage<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        cancel: &CancellationToken,
        prepared: PreparedStage,
        created: Option<R::Created>,
    ) -> Result<Result<StageOutput, Input>, PublishEvent> {
        let PreparedStage {
            spec,
            place,
            pass,
            refused,
        } = prepared;
        if let Some(reason) = refused {
            return Ok(Err(Input::StageFailed {
                reason: format!("{} stage: {reason}", place.stage.as_str()),
            }));
        }
        tracing::Span::current().record("stage", place.stage.as_str());
        for mount in spec.mounts.iter().filter(|m| !m.read_only) {
            self.hand_over(&mount.source).await;
        }
        tracing::info!(round = place.round, cycle = ?place.cycle, "stage started");
        self.run_container(run, sink, cancel, (spec, place, pass), created)
            .await
    }

    /// [`Engine::run_stage`] once the stage may run: its container, its output and cycle
    /// files forwarded, its disk watched, and its pass to the gateway closed at its end.
    async fn run_container<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
        cancel: &CancellationToken,
        (spec, place, pass): (StageSpec, StagePlace, Option<gateway::Pass>),
        created: Option<R::Created>,
    ) -> Result<Result<StageOutput, Input>, PublishEvent> {
        // The gateway halts the stage when its budget is spent or its provider rate-limits it.
        let halted = pass
            .as_ref()
            .map_or_else(CancellationToken::new, |p| p.halted());
        let StagePlace {
            stage,
            round,
            cycle,
        } = place;
        let run_id = run.job.run_id;
        let output_dir = spec
            .mounts
            .iter()
            .find(|m| m.target == "/forge/output")
            .map(|m| m.source.clone());
        // The container is created while the broker confirms `stage_started`; nothing else of
        // the stage (a log line, a cycle file) is published before that confirm.
        let started = publish(
            sink,
            run_id,
            EventKind::StageStarted {
                stage,
                round,
                cycle,
            },
        );
        tokio::pin!(started);
        let mut announced = false;
        let (log_sender, mut log_receiver) = mpsc::channel::<LogChunk>(256);
        // The profile's disk allowance covers what the stage adds to its writable folders; the
        // stage stops when it is exceeded (its /tmp is a tmpfs of the same size).
        let disk = DiskWatch::new(&spec).await;
        let stage_stop = cancel.child_token();
        let container = self.start_container(spec, created, log_sender, stage_stop.clone());
        let mut disk_ticker = tokio::time::interval(DISK_CHECK);
        disk_ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut disk_exceeded: Option<String> = None;
        tokio::pin!(container);
        let mut ticker = tokio::time::interval(self.config.poll_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut logs_open = true;
        let outcome = loop {
            tokio::select! {
                confirmed = &mut started, if !announced => {
                    confirmed?;
                    announced = true;
                }
                outcome = &mut container => {
                    if !announced {
                        (&mut started).await?;
                    }
                    break outcome;
                }
                chunk = log_receiver.recv(), if logs_open && announced => match chunk {
                    Some(chunk) => publish(sink, run_id, EventKind::Log { stage, stream: chunk.stream, text: chunk.text }).await?,
                    None => logs_open = false,
                },
                _ = ticker.tick(), if announced => self.sweep(run, sink).await?,
                () = halted.cancelled(), if !stage_stop.is_cancelled() => {
                    stage_stop.cancel();
                    self.halted_by_gateway(run_id, pass.as_ref()).await;
                }
                _ = disk_ticker.tick(), if announced && disk_exceeded.is_none() => {
                    if let Some(reason) = disk.exceeded().await {
                        warn!(%reason, "stopping the stage");
                        disk_exceeded = Some(reason);
                        stage_stop.cancel();
                    }
                }
            }
        };
        if disk_exceeded.is_none() {
            disk_exceeded = disk.exceeded().await;
        }
        flush_logs(sink, run_id, stage, &mut log_receiver).await?;
        self.sweep(run, sink).await?;
        let meter = pass.map(gateway::Pass::close);
        let metered = meter.as_ref().and_then(super::model::metered_usage);
        let (mut outcome, usage) =
            settle_outputs(run, sink, place, output_dir, outcome, metered).await?;
        let verdict = meter.and_then(|m| super::model::gateway_verdict(run, &m, &mut outcome));
        disk_exceeded = disk_exceeded.or(verdict);
        self.finish_stage(sink, run_id, place, outcome, disk_exceeded, usage)
            .await
    }

    /// Runs the stage's container: the one created ahead, or a new one.
    async fn start_container(
        &self,
        spec: StageSpec,
        created: Option<R::Created>,
        logs: mpsc::Sender<LogChunk>,
        stop: CancellationToken,
    ) -> Result<StageOutput, RuntimeError> {
        match created {
            Some(created) => self.runtime.run_created(created, logs, stop).await,
            None => self.runtime.run_stage(spec, logs, stop).await,
        }
    }

    /// Publishes how a stage ended, and returns its output, or the input that ends the run
    /// (a runtime error, a disk allowance exceeded).
    async fn finish_stage<S: EventSink>(
        &self,
        sink: &S,
        run_id: Uuid,
        place: StagePlace,
        outcome: Result<StageOutput, RuntimeError>,
        disk_exceeded: Option<String>,
        usage: Option<proto::Usage>,
    ) -> Result<Result<StageOutput, Input>, PublishEvent> {
        let StagePlace {
            stage,
            round,
            cycle,
        } = place;
        let (exit_code, outcome_name, duration) = finished_as(&outcome, disk_exceeded.is_some());
        tracing::info!(
            outcome = outcome_name.as_str(),
            exit_code,
            seconds = duration.as_secs_f64(),
            "stage finished"
        );
        publish(
            sink,
            run_id,
            EventKind::StageFinished {
                usage,
                stage,
                round,
                cycle,
                exit_code,
                duration_seconds: duration.as_secs_f64(),
                outcome: outcome_name,
            },
        )
        .await?;
        if let Some(reason) = disk_exceeded {
            return Ok(Err(Input::StageFailed {
                reason: format!("{} stage: {reason}", stage.as_str()),
            }));
        }
        Ok(outcome.map_err(|error| Input::StageFailed {
            reason: format!("{} stage: {error}", stage.as_str()),
        }))
    }

    /// Scans `.forge/` and publishes every new or changed cycle file.
    pub(super) async fn sweep<S: EventSink>(
        &self,
        run: &mut RunContext<'_>,
        sink: &S,
    ) -> Result<(), PublishEvent> {
        let mut collector = std::mem::take(&mut run.collector);
        let (collector, found) = tokio::task::spawn_blocking(move || {
            let found = collector.scan();
            (collector, found)
        })
        .await
        .map_err(|e| PublishEvent(format!("cycle scan failed: {e}")))?;
        run.collector = collector;
        for cycle in found {
            if !run.record_cycle(cycle.clone()) {
                continue;
            }
            publish(sink, run.job.run_id, EventKind::Cycle { cycle }).await?;
        }
        Ok(())
    }

    /// Gives a folder to the stage user, so that root-owned leftovers of an earlier round
    /// never block the next one.
    pub(super) async fn hand_over(&self, dir: &Path) {
        if !self.config.can_chown {
            return;
        }
        let (uid, gid) = self.config.stage_user;
        let dir = dir.to_path_buf();
        let _ =
            tokio::task::spawn_blocking(move || match crate::workspace::overlay::upper_of(&dir) {
                // A layered folder: only what was written in it can be another's (the cached
                // checkout below is the stage user's already), so only that is walked.
                Some(upper) => chown_written(&upper, &dir, uid, gid),
                None => chown_tree(&dir, uid, gid),
            })
            .await;
    }
}

/// Publishes the log lines a finished stage's container left in the channel.
async fn flush_logs<S: EventSink>(
    sink: &S,
    run_id: Uuid,
    stage: Stage,
    logs: &mut mpsc::Receiver<LogChunk>,
) -> Result<(), PublishEvent> {
    while let Ok(LogChunk { stream, text }) = logs.try_recv() {
        publish(
            sink,
            run_id,
            EventKind::Log {
                stage,
                stream,
                text,
            },
        )
        .await?;
    }
    Ok(())
}

/// How often a running stage's writable folders are measured against its disk allowance.
const DISK_CHECK: Duration = Duration::from_secs(2);

/// The most entries measured in a stage's writable folders; more counts as over the limit.
const DISK_ENTRIES: usize = 2_000_000;

/// A stage's writable folders, their size when it started, and its allowance.
struct DiskWatch {
    folders: Vec<PathBuf>,
    baseline: u64,
    limit: u64,
}

impl DiskWatch {
    async fn new(spec: &StageSpec) -> DiskWatch {
        let folders: Vec<PathBuf> = spec
            .mounts
            .iter()
            .filter(|m| !m.read_only)
            // A layered folder's use is its upper layer: a copied-up file costs its whole
            // size there, and removing a file of the cached checkout frees nothing.
            .map(|m| {
                crate::workspace::overlay::upper_of(&m.source).unwrap_or_else(|| m.source.clone())
            })
            .collect();
        let baseline = Self::measure(folders.clone()).await.unwrap_or(0);
        DiskWatch {
            folders,
            baseline,
            limit: spec.disk_bytes,
        }
    }

    async fn measure(folders: Vec<PathBuf>) -> Option<u64> {
        tokio::task::spawn_blocking(move || {
            folders.iter().try_fold(0u64, |total, folder| {
                crate::workspace::confined::disk_usage(folder, DISK_ENTRIES)
                    .map(|used| total + used)
            })
        })
        .await
        .ok()
        .flatten()
    }

    /// Why the stage is over its allowance, if it is.
    async fn exceeded(&self) -> Option<String> {
        if self.folders.is_empty() {
            return None;
        }
        let added = match Self::measure(self.folders.clone()).await {
            Some(used) => used.saturating_sub(self.baseline),
            None => {
                return Some(format!(
                    "it created more than {DISK_ENTRIES} files and folders; it was stopped"
                ))
            }
        };
        (added > self.limit).then(|| {
            format!(
                "it wrote {} MiB to its workspace, over the profile's disk limit of {} MiB; it was stopped",
                added >> 20,
                self.limit >> 20
            )
        })
    }
}

/// The mounts of an agent stage: the source at `/workspace`, its inputs read-only at
/// `/forge/input`, and a writable `/forge/output`.
pub(super) fn agent_mounts(source: &Path, read_only: bool, stage_dir: &Path) -> Vec<Mount> {
    let mut mounts = workspace_mounts(source, read_only);
    mounts.extend([
        Mount {
            source: stage_dir.join("input"),
            target: "/forge/input".into(),
            read_only: true,
        },
        Mount {
            source: stage_dir.join("output"),
            target: "/forge/output".into(),
            read_only: false,
        },
    ]);
    mounts
}

/// The source at `/workspace`, and for a layered source its stages' git folder at
/// `/workspace/.git` (see [`crate::workspace::overlay`]).
pub(super) fn workspace_mounts(source: &Path, read_only: bool) -> Vec<Mount> {
    let mut mounts = vec![Mount {
        source: source.to_path_buf(),
        target: "/workspace".into(),
        read_only,
    }];
    if let Some(git) = crate::workspace::overlay::stage_git(source) {
        mounts.push(Mount {
            source: git,
            target: "/workspace/.git".into(),
            read_only,
        });
    }
    mounts
}

/// Gives the stage user each path of the layered folder `folder` that its upper layer
/// `upper` holds, changing it through the overlay (the layers are never written directly
/// while mounted).
fn chown_written(upper: &Path, folder: &Path, uid: u32, gid: u32) {
    use std::os::unix::fs::MetadataExt;
    let mut pending = vec![PathBuf::new()];
    while let Some(relative) = pending.pop() {
        let Ok(written) = std::fs::symlink_metadata(upper.join(&relative)) else {
            continue;
        };
        if written.is_dir() {
            if let Ok(entries) = std::fs::read_dir(upper.join(&relative)) {
                pending.extend(entries.flatten().map(|e| relative.join(e.file_name())));
            }
        }
        let path = folder.join(&relative);
        let Ok(metadata) = std::fs::symlink_metadata(&path) else {
            continue; // a whiteout: the path was removed
        };
        let shared = metadata.is_file() && metadata.nlink() > 1;
        if !shared && (metadata.uid() != uid || metadata.gid() != gid) {
            let _ = std::os::unix::fs::lchown(&path, Some(uid), Some(gid));
        }
    }
}

fn chown_tree(dir: &Path, uid: u32, gid: u32) {
    use std::os::unix::fs::MetadataExt;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        let Ok(metadata) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        // A regular file with other links shares its content with a folder of the worker (a
        // git object linked from the run's repository or the cache): it stays the worker's,
        // read-only, so a stage can never change it.
        let shared = metadata.is_file() && metadata.nlink() > 1;
        if !shared && (metadata.uid() != uid || metadata.gid() != gid) {
            let _ = std::os::unix::fs::lchown(&path, Some(uid), Some(gid));
        }
        if metadata.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                pending.extend(entries.flatten().map(|e| e.path()));
            }
        }
    }
}

/// How a stage ended, for its `stage_finished` event: its exit code, its outcome (a stage
/// stopped for its disk allowance failed), and its duration.
fn finished_as(
    outcome: &Result<StageOutput, RuntimeError>,
    disk_exceeded: bool,
) -> (Option<i64>, StageOutcome, Duration) {
    let (exit_code, finished, duration) = match outcome {
        Ok(output) => match output.exit {
            StageExit::Exited(0) => (Some(0), StageOutcome::Completed, output.duration),
            StageExit::Exited(EXIT_PAUSED) => {
                (Some(EXIT_PAUSED), StageOutcome::Paused, output.duration)
            }
            StageExit::Exited(code) => (Some(code), StageOutcome::Failed, output.duration),
            StageExit::TimedOut => (None, StageOutcome::TimedOut, output.duration),
            StageExit::Cancelled => (None, StageOutcome::Cancelled, output.duration),
        },
        Err(_) => (None, StageOutcome::Failed, Duration::ZERO),
    };
    if disk_exceeded {
        return (exit_code, StageOutcome::Failed, duration);
    }
    (exit_code, finished, duration)
}
