//! Embedded mode, `forgepool run FILE`: the dispatcher's validation and store and the worker's
//! engine in one process, joined by an in-process queue and event channel.

use std::sync::Arc;

use dispatcher::store::{RunStore, Store};
use dispatcher::{AgentBook, Freezer};
use proto::{EventKind, RunState};
use tokio_util::sync::CancellationToken;
use worker::docker::{DockerRuntime, Identity};
use worker::queue::{InMemoryQueue, JobQueue, Settlement};
use worker::runtime::ContainerRuntime;
use worker::sink::ChannelSink;
use worker::{Engine, EngineConfig};

use crate::config::RunArgs;
use crate::progress;

/// Exit code for invalid input or configuration (SPEC 10).
const EXIT_INVALID: i32 = 2;
/// Exit code for a failed run.
const EXIT_FAILED: i32 = 1;

/// Runs one request to its end and returns the process exit code.
pub async fn run(args: RunArgs) -> i32 {
    let invalid = |message: String| {
        eprintln!("error: {message}");
        EXIT_INVALID
    };
    let workspace_root = match args.workspace_root() {
        Ok(root) => root,
        Err(message) => return invalid(message),
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
    let frozen = match Freezer::from_process_env(&args.skills, agents).freeze(request) {
        Ok(frozen) => frozen,
        Err(error) => return invalid(format!("{}: {error}", args.file.display())),
    };
    for warning in &frozen.warnings {
        eprintln!("warning: {warning}");
    }
    let store = match Store::open(&args.database).await {
        Ok(store) => store,
        Err(error) => return invalid(error.to_string()),
    };
    let job = frozen.job;
    let run_id = job.run_id;
    if let Err(error) = store.insert_run(&job).await {
        eprintln!("error: {error}");
        return EXIT_FAILED;
    }
    println!(
        "Run {run_id} accepted: {} with skill {}",
        job.ticket, job.skill
    );

    // Every embedded run on a host shares one worker name, so a run removes the containers
    // that an earlier, killed run left behind (and never those of a live one).
    let identity = Identity::for_worker("embedded");
    let runtime = match DockerRuntime::connect(identity).await {
        Ok(runtime) => Arc::new(runtime),
        Err(error) => {
            let reason = error.to_string();
            let failed = proto::Event::new(
                run_id,
                EventKind::State {
                    state: RunState::Failed,
                    reason: reason.clone(),
                },
            );
            let _ = store.record_event(&failed).await;
            eprintln!("error: {reason}");
            println!("Run failed: {reason}");
            return EXIT_FAILED;
        }
    };
    if let Err(error) = runtime.remove_orphans().await {
        tracing::warn!(%error, "orphan cleanup failed");
    }
    let engine = Engine::new(
        runtime,
        EngineConfig {
            poll_interval: args.poll_interval,
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
                .execute(&delivery.job, &sink, cancel, CancellationToken::new())
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

    let mut final_state = None;
    while let Some(event) = events.recv().await {
        if let Err(error) = store.record_event(&event).await {
            eprintln!("error: {error}");
        }
        if let Some(line) = progress::line(&event.kind) {
            println!("{line}");
        }
        if let EventKind::State { state, .. } = &event.kind {
            if state.is_terminal() || *state == RunState::Paused {
                final_state = Some(*state);
            }
        }
    }
    let _ = worker.await;
    signals.abort();
    match final_state {
        Some(state) => state.exit_code().unwrap_or(EXIT_FAILED),
        None => {
            eprintln!("error: the run ended without a final state; see the log above");
            EXIT_FAILED
        }
    }
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
