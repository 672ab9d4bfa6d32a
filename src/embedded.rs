//! Embedded mode, `forgepool run FILE`: the dispatcher's validation and store and the worker's
//! engine in one process, joined by an in-process queue and event channel.

use std::sync::Arc;
use std::time::Duration;

use dispatcher::store::{RunStore, Store};
use dispatcher::{AgentBook, Freezer};
use proto::{EventKind, RunState};
use tokio_util::sync::CancellationToken;
use worker::docker::{DockerRuntime, Identity};
use worker::ports::ledger::MemoryLedger;
use worker::ports::queue::{InMemoryQueue, JobQueue, Settlement};
use worker::ports::sink::ChannelSink;
use worker::runtime::ContainerRuntime;
use worker::{Engine, EngineConfig, RunControl};

use crate::config::{LocalArgs, RunArgs};
use crate::progress;

/// Exit code for invalid input or configuration (SPEC 10).
const EXIT_INVALID: i32 = 2;
/// Exit code for a failed run.
const EXIT_FAILED: i32 = 1;
/// Exit code for a run paused by its agent's provider.
const EXIT_PAUSED: i32 = 75;

/// Runs one request to its end and returns the process exit code.
pub async fn run(args: RunArgs) -> i32 {
    let invalid = |message: String| {
        eprintln!("error: {message}");
        EXIT_INVALID
    };
    let agents = match AgentBook::load(&args.agents) {
        Ok(agents) => agents,
        Err(error) => return invalid(error.to_string()),
    };
    if !args.skills.is_dir() {
        return invalid(format!(
            "skills directory {} does not exist; pass --skills DIR or set FORGEPOOL_SKILLS_DIR",
            args.skills.display()
        ));
    }
    let text = match std::fs::read_to_string(&args.file) {
        Ok(text) => text,
        Err(error) => {
            return invalid(format!(
                "cannot read the run request {}: {error}",
                args.file.display()
            ))
        }
    };
    let request = match dispatcher::request::from_file_text(&text) {
        Ok(request) => request,
        Err(error) => return invalid(format!("{}: {error}", args.file.display())),
    };
    let freezer = Freezer::from_process_env(&args.skills, agents)
        .with_allowed_schemes(args.local.stages.schemes(true));
    let frozen = match freezer.freeze(request) {
        Ok(frozen) => frozen,
        Err(error) => return invalid(format!("{}: {error}", args.file.display())),
    };
    for warning in &frozen.warnings {
        eprintln!("warning: {warning}");
    }
    let store = match Store::open(&args.local.database).await {
        Ok(store) => store,
        Err(error) => return invalid(error.to_string()),
    };
    let job = frozen.job;
    if let Err(error) = store.insert_run(&job).await {
        eprintln!("error: {error}");
        return EXIT_FAILED;
    }
    println!(
        "Run {} accepted: {} with skill {}",
        job.run_id, job.ticket, job.skill
    );
    execute_waiting(&store, job, &args.local).await
}

/// `forgepool resume RUN_ID --local`: continues a paused embedded run from its latest
/// checkpoint, with its original frozen job (the same budget, limits and profiles).
pub async fn resume(run_id: &str, local: &LocalArgs) -> i32 {
    let invalid = |message: String| {
        eprintln!("error: {message}");
        EXIT_INVALID
    };
    let Ok(run_id) = uuid::Uuid::parse_str(run_id) else {
        return invalid(format!("RUN_ID must be a run id (a UUID), got {run_id:?}"));
    };
    let store = match Store::open(&local.database).await {
        Ok(store) => store,
        Err(error) => return invalid(error.to_string()),
    };
    let record = match store.get_run(run_id).await {
        Ok(Some(record)) => record,
        Ok(None) => {
            return invalid(format!(
            "no run {run_id} in the run store {}; pass --database or set FORGEPOOL_DATABASE_URL",
            local.database
        ))
        }
        Err(error) => return invalid(error.to_string()),
    };
    if record.state != RunState::Paused {
        return invalid(format!("run {run_id} is {}, not paused", record.state));
    }
    match resumed_job(&store, record.job).await {
        Ok(job) => execute_waiting(&store, job, local).await,
        Err(code) => code,
    }
}

/// The paused run's job with its latest checkpoint, once its resumption is recorded; or the
/// exit code when there is nothing to resume.
async fn resumed_job(store: &Store, mut job: proto::Job) -> Result<proto::Job, i32> {
    let run_id = job.run_id;
    let checkpoint = match store.events(run_id, 0).await {
        Ok(events) => proto::latest_checkpoint(events.iter().map(|(_, event)| event)),
        Err(error) => {
            eprintln!("error: {error}");
            return Err(EXIT_INVALID);
        }
    };
    let Some(checkpoint) = checkpoint else {
        eprintln!("error: run {run_id} has no saved progress to resume from; submit a new run");
        return Err(EXIT_INVALID);
    };
    let resumed = proto::resumed_event(run_id, &checkpoint);
    if let Err(error) = store.record_event(&resumed).await {
        eprintln!("error: {error}");
        return Err(EXIT_FAILED);
    }
    println!(
        "Run {run_id} resumed from checkpoint {}: {} with skill {}",
        checkpoint.sequence, job.ticket, job.skill
    );
    job.resume = Some(checkpoint);
    Ok(job)
}

/// Executes the job; when the run pauses, waits out the pause here and resumes the run, as a
/// pool would, for at most `--pause-wait` (`FORGEPOOL_PAUSE_WAIT`) in all: every pause of the
/// run together. A pause that comes again waits at least twice as long as the one before, so
/// a provider that never recovers is not called in a loop; past the allowance the command
/// exits 75 with the command that resumes the run. SIGINT or SIGTERM during a wait cancels
/// the run.
async fn execute_waiting(store: &Store, job: proto::Job, local: &LocalArgs) -> i32 {
    let run_id = job.run_id;
    let mut code = execute(store, job, local).await;
    let (mut waited, mut last) = (Duration::ZERO, Duration::ZERO);
    while code == EXIT_PAUSED {
        let Ok(Some(record)) = store.get_run(run_id).await else {
            return code;
        };
        let events = store.events(run_id, 0).await.unwrap_or_default();
        let until = proto::latest_checkpoint(events.iter().map(|(_, event)| event))
            .and_then(|checkpoint| checkpoint.resume_at)
            .and_then(|at| proto::parse_time(&at));
        let Some(time) = until else {
            return code;
        };
        let named = time
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        let wait = named.max(last * 2).max(Duration::from_secs(1));
        let resume = format!("forgepool resume {run_id} --local");
        if waited + wait > local.pause_wait {
            println!(
                "Paused: the next wait ({} s) would pass the {} s this command waits in all (FORGEPOOL_PAUSE_WAIT, {} s waited); continue later with `{resume}`",
                wait.as_secs(),
                local.pause_wait.as_secs(),
                waited.as_secs()
            );
            return code;
        }
        println!(
            "Paused: resuming in {} s in this process (Ctrl-C or SIGTERM cancels the run; `{resume}` continues later)",
            wait.as_secs()
        );
        if wait_or_signal(wait).await {
            return cancel_paused(store, run_id).await;
        }
        (waited, last) = (waited + wait, wait);
        code = match resumed_job(store, record.job).await {
            Ok(job) => execute(store, job, local).await,
            Err(code) => code,
        };
    }
    code
}

/// Sleeps for `wait`; true when SIGINT or SIGTERM came first.
async fn wait_or_signal(wait: Duration) -> bool {
    let terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    let Ok(mut terminate) = terminate else {
        tokio::select! {
            () = tokio::time::sleep(wait) => return false,
            _ = tokio::signal::ctrl_c() => return true,
        }
    };
    tokio::select! {
        () = tokio::time::sleep(wait) => false,
        _ = tokio::signal::ctrl_c() => true,
        _ = terminate.recv() => true,
    }
}

/// Records the cancellation of a run paused in this process (no container runs).
async fn cancel_paused(store: &Store, run_id: uuid::Uuid) -> i32 {
    let reason = "cancelled by a signal while the run waited out a pause".to_string();
    let cancelled = proto::Event::new(
        run_id,
        EventKind::State {
            state: RunState::Cancelled,
            reason: reason.clone(),
        },
    );
    if let Err(error) = store.record_event(&cancelled).await {
        eprintln!("error: {error}");
    }
    println!("Run cancelled: {reason}");
    EXIT_FAILED
}

/// Runs a stored job in this process, recording and printing its events; returns the exit
/// code of its final state.
async fn execute(store: &Store, job: proto::Job, local: &LocalArgs) -> i32 {
    worker::workspace::git::set_allowed_schemes(local.stages.schemes(true));
    let run_id = job.run_id;
    let settings = local
        .workspace_root()
        .and_then(|root| Ok((load_delivery_settings(local, &root)?, root)));
    let (webhooks, workspace_root) = match settings {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("error: {message}");
            return EXIT_INVALID;
        }
    };

    // Every embedded run on a host shares one worker name, so a run removes the containers
    // that an earlier, killed run left behind (and never those of a live one).
    let identity = Identity::for_worker("embedded");
    let runtime = match DockerRuntime::connect(identity).await {
        Ok(runtime) => runtime.with_egress_image(local.stages.egress_image.clone()),
        Err(error) => return fail_run(store, run_id, error.to_string()).await,
    };
    if let Err(error) = runtime.remove_orphans().await {
        tracing::warn!(%error, "orphan cleanup failed");
    }
    // One process is the whole pool: the job's profiles' daily budgets are allotted here.
    let allotter = worker::model_gateway::local_allotter(&job);
    let (runtime, model_gateway) =
        match worker::model_gateway::with_gateway(runtime, &workspace_root, None, allotter) {
            Ok(wired) => wired,
            Err(message) => {
                eprintln!("error: {message}");
                return EXIT_INVALID;
            }
        };
    let engine = Engine::new(
        Arc::clone(&runtime),
        EngineConfig {
            poll_interval: local.poll_interval,
            allow_bridge: local.stages.allow_bridge,
            cache: Some(local.stages.cache(&workspace_root)),
            gateway: Some(Arc::clone(&model_gateway.gateway)),
            ..EngineConfig::for_process(workspace_root)
        },
    );

    let queue = Arc::new(InMemoryQueue::default());
    if let Err(error) = queue.publish(job).await {
        eprintln!("error: {error}");
        return EXIT_FAILED;
    }
    let (sink, mut events) = ChannelSink::new(1024);
    let cancel = CancellationToken::new();
    let worker = {
        let queue = Arc::clone(&queue);
        let cancel = cancel.clone();
        tokio::spawn(async move {
            let Some(delivery) = queue.next().await else {
                return;
            };
            let outcome = engine
                .execute(
                    &delivery.job,
                    &sink,
                    &MemoryLedger::default(),
                    RunControl::new(cancel, CancellationToken::new()),
                )
                .await;
            let how = if matches!(outcome, Ok(Some(_))) {
                Settlement::Ack
            } else {
                Settlement::Requeue
            };
            let _ = queue.settle(delivery, how).await;
        })
    };
    let signals = tokio::spawn(shutdown_signal(cancel.clone()));

    let final_state = record_and_print(store, &mut events, local.show_logs).await;
    let _ = worker.await;
    signals.abort();
    runtime.close_egress().await;
    if let (Some(webhooks), Some(true)) = (&webhooks, final_state.map(RunState::is_terminal)) {
        notify(store, webhooks, run_id).await;
    }
    match final_state {
        Some(state) => state.exit_code().unwrap_or(EXIT_FAILED),
        None => {
            eprintln!("error: the run ended without a final state; see the log above");
            EXIT_FAILED
        }
    }
}

/// Fails a run that could not start, in the store and on the terminal.
async fn fail_run(store: &Store, run_id: uuid::Uuid, reason: String) -> i32 {
    let state = RunState::Failed;
    let failed = proto::Event::new(
        run_id,
        EventKind::State {
            state,
            reason: reason.clone(),
        },
    );
    let _ = store.record_event(&failed).await;
    eprintln!("error: {reason}");
    println!("Run failed: {reason}");
    EXIT_FAILED
}

/// Gives forgepool's git the forges file, and loads the webhooks file, if either is given.
fn load_delivery_settings(
    local: &LocalArgs,
    workspace_root: &std::path::Path,
) -> Result<Option<dispatcher::webhooks::Webhooks>, String> {
    local.stages.install(workspace_root)?;
    local
        .webhooks_file
        .as_deref()
        .map(|path| dispatcher::webhooks::Webhooks::load(path, |n| std::env::var(n).ok()))
        .transpose()
}

/// Tells each webhook of the run's end before the command exits, recording and printing each
/// attempt.
async fn notify(store: &Store, webhooks: &dispatcher::webhooks::Webhooks, run_id: uuid::Uuid) {
    let Ok(Some(record)) = store.get_run(run_id).await else {
        return;
    };
    for hook in webhooks.hooks_for(record.state) {
        let attempt = |kind: EventKind| async move {
            if let Some(line) = progress::line(&kind) {
                println!("{line}");
            }
            if let Err(error) = store.record_event(&proto::Event::new(run_id, kind)).await {
                eprintln!("error: {error}");
            }
        };
        webhooks.notify(&hook, &record, attempt).await;
    }
}

/// Stores and prints each event of the run until its sink closes (with `show_logs`, the
/// stages' log lines too); returns its last terminal or paused state.
async fn record_and_print(
    store: &Store,
    events: &mut tokio::sync::mpsc::Receiver<proto::Event>,
    show_logs: bool,
) -> Option<RunState> {
    let mut final_state = None;
    while let Some(event) = events.recv().await {
        if let Err(error) = store.record_event(&event).await {
            eprintln!("error: {error}");
        }
        if let Some(line) = progress::line(&event.kind) {
            println!("{line}");
        } else if let (true, EventKind::Log { stage, text, .. }) = (show_logs, &event.kind) {
            for line in progress::log_lines(*stage, text) {
                println!("{line}");
            }
        }
        if let EventKind::State { state, .. } = &event.kind {
            if state.is_terminal() || *state == RunState::Paused {
                final_state = Some(*state);
            }
        }
    }
    final_state
}

/// Cancels the run on Ctrl-C or SIGTERM.
async fn shutdown_signal(cancel: CancellationToken) {
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => signal,
            Err(_) => return,
        };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = terminate.recv() => {},
    }
    eprintln!("cancelling the run; stopping its containers");
    cancel.cancel();
}
