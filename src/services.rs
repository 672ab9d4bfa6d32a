//! `forgepool dispatcher` and `forgepool worker`: validate settings, bind, and hand over to
//! the library services with a shutdown token tied to SIGTERM and Ctrl-C.

use dispatcher::trackers::set::Trackers;
use dispatcher::webhooks::Webhooks;
use std::sync::Arc;
use std::time::Duration;

use dispatcher::service::DispatcherConfig;
use dispatcher::AgentBook;
use tokio_util::sync::CancellationToken;
use worker::docker::{DockerRuntime, Identity};
use worker::service::WorkerConfig;
use worker::{Engine, EngineConfig};

use crate::config::{
    DispatcherArgs, WorkerArgs, ENV_API_TOKEN, ENV_DISPATCHER_METRICS_ADDR, ENV_LISTEN,
};

/// Exit code for invalid configuration.
const EXIT_INVALID: i32 = 2;

/// How long the store's migrations may take in their child (an index on a big store takes a
/// while; PostgreSQL that is still starting is waited for 30 s within it).
const MIGRATION_LIMIT: Duration = Duration::from_secs(15 * 60);

/// Runs `forgepool migrate-store` as a child, with the store's URL in its environment (never
/// on its command line, where the process list would show a password), and waits for it.
async fn migrate_in_child(url: &str) -> Result<(), String> {
    let binary = std::env::current_exe().map_err(|error| {
        format!("cannot find forgepool's own binary to migrate the store: {error}")
    })?;
    let child = tokio::process::Command::new(binary)
        .arg("migrate-store")
        .env(crate::config::ENV_DATABASE_URL, url)
        // Its error is its message; its log would only repeat it.
        .env("FORGEPOOL_LOG", "off")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|error| format!("cannot start the store's migrations: {error}"))?;
    let output = tokio::time::timeout(MIGRATION_LIMIT, child.wait_with_output())
        .await
        .map_err(|_| {
            format!("the run store's migrations did not finish within {MIGRATION_LIMIT:?}")
        })?
        .map_err(|error| format!("the store's migrations: {error}"))?;
    if output.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&output.stderr);
    let said = said.trim().trim_start_matches("error: ");
    Err(if said.is_empty() {
        format!("the run store's migrations failed ({})", output.status)
    } else {
        said.to_string()
    })
}

/// `forgepool migrate-store`: brings the store named by FORGEPOOL_DATABASE_URL up to this
/// release's schema.
pub async fn migrate_store() -> i32 {
    let Ok(url) = std::env::var(crate::config::ENV_DATABASE_URL) else {
        eprintln!("error: {} is not set", crate::config::ENV_DATABASE_URL);
        return EXIT_INVALID;
    };
    match dispatcher::store::Store::open(&url).await {
        Ok(_) => 0,
        Err(error) => {
            eprintln!("error: {error}");
            1
        }
    }
}

/// Runs the dispatcher until SIGTERM or Ctrl-C.
pub async fn dispatcher(args: DispatcherArgs) -> i32 {
    if args.api_token.is_none() && !args.listen.ip().is_loopback() {
        return invalid(format!(
            "{ENV_LISTEN} is {} (not loopback) but {ENV_API_TOKEN} is unset: set a token, or listen on 127.0.0.1",
            args.listen
        ));
    }
    if args.api_token.as_deref().is_some_and(|t| t.len() < 16) {
        return invalid(format!("{ENV_API_TOKEN} must be at least 16 characters"));
    }
    if !args.skills.is_dir() {
        return invalid(format!(
            "skills directory {} does not exist; pass --skills DIR or set FORGEPOOL_SKILLS_DIR",
            args.skills.display()
        ));
    }
    let agents = match AgentBook::load(&args.agents) {
        Ok(agents) => agents,
        Err(error) => return invalid(error.to_string()),
    };
    let job_key = match args.job_key.required() {
        Ok(key) => key,
        Err(message) => return invalid(message),
    };
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            return invalid(format!(
                "{ENV_LISTEN} ({}): cannot listen: {error}",
                args.listen
            ))
        }
    };
    let metrics = match args.metrics_addr {
        None => None,
        Some(address) => match tokio::net::TcpListener::bind(address).await {
            Ok(listener) => Some(listener),
            Err(error) => {
                return invalid(format!(
                    "{ENV_DISPATCHER_METRICS_ADDR} ({address}): cannot listen: {error}"
                ))
            }
        },
    };
    let (webhooks, trackers) = match webhooks_and_trackers(&args) {
        Ok(both) => both,
        Err(message) => return invalid(message),
    };
    // The migrations run in a short-lived child: the regex engine refinery brings along (a
    // 512 KiB automaton and its Unicode tables) never lives in the dispatcher.
    if let Err(message) = migrate_in_child(&args.database).await {
        eprintln!("error: {message}");
        return 1;
    }
    let config = DispatcherConfig {
        amqp_url: args.broker.amqp_url,
        prefix: args.broker.prefix,
        database_url: args.database,
        schema: dispatcher::store::Schema::Migrated,
        skills_dir: args.skills,
        agents,
        api_token: args.api_token,
        job_key,
        allowed_schemes: args.stages.schemes(false),
        silent_after: Duration::from_secs(args.silent_run_seconds),
        job_ttl: Duration::from_secs(args.job_ttl_seconds),
        auto_resume: args.auto_resume,
        shared_store: args.shared_store,
        webhooks,
        trackers,
        retention: dispatcher::retention::Retention {
            logs: args.retain_logs.0,
            runs: args.retain_runs.0,
        },
    };
    let shutdown = shutdown_on_signal();
    // The line tests and scripts wait for: printed once the broker topology exists.
    let ready = |address| println!("dispatcher listening on {address}");
    let listeners = dispatcher::service::Listeners {
        api: listener,
        metrics,
    };
    match dispatcher::service::run(config, listeners, shutdown, ready).await {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("error: {error}");
            1
        }
    }
}

/// The host's name, the default worker id.
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "worker".into())
}

/// Prints a configuration error; the exit code for it.
fn invalid(message: String) -> i32 {
    eprintln!("error: {message}");
    EXIT_INVALID
}

/// Runs a worker until SIGTERM or Ctrl-C, then drains.
pub async fn worker(args: WorkerArgs) -> i32 {
    let installed = args
        .workspace_root()
        .and_then(|root| args.stages.install(&root).map(|()| root));
    let workspace_root = match installed {
        Ok(root) => root,
        Err(message) => return invalid(message),
    };
    let job_key = match args.job_key.required() {
        Ok(key) => key,
        Err(message) => return invalid(message),
    };
    let agents = match AgentBook::load(&args.agents) {
        Ok(agents) => agents,
        Err(error) => return invalid(error.to_string()),
    };
    let worker_id = args.worker_id.clone().unwrap_or_else(host_name);
    if let Err(message) = proto::amqp::check_worker_heartbeat(&args.broker.amqp_url)
        .and_then(|()| proto::roster::check_worker_name(&worker_id))
    {
        return invalid(message);
    }
    worker::workspace::git::set_allowed_schemes(args.stages.schemes(false));
    let metrics = match tokio::net::TcpListener::bind(args.metrics_addr).await {
        Ok(listener) => listener,
        Err(error) => {
            let addr = args.metrics_addr;
            return invalid(format!(
                "FORGEPOOL_METRICS_ADDR ({addr}): cannot listen: {error}"
            ));
        }
    };
    let runtime = match DockerRuntime::connect(
        Identity::for_worker(worker_id.clone()).in_cluster(args.broker.prefix.clone()),
    )
    .await
    {
        Ok(runtime) => runtime.with_egress_image(args.stages.egress_image.clone()),
        Err(error) => {
            eprintln!("error: {error}");
            return 1;
        }
    };
    let metrics_registry = Arc::new(telemetry::Metrics::new(telemetry::Role::Worker));
    let metered = Some(Arc::clone(&metrics_registry));
    let allotter = Arc::new(worker::amqp::allotment::AmqpAllotter::new(
        &args.broker.amqp_url,
        &args.broker.prefix,
        job_key.clone(),
    ));
    let (runtime, model_gateway) =
        match worker::model_gateway::with_gateway(runtime, &workspace_root, metered, allotter) {
            Ok(wired) => wired,
            Err(message) => return invalid(message),
        };
    let engine = Engine::new(
        Arc::clone(&runtime),
        EngineConfig {
            poll_interval: args.poll_interval,
            allow_bridge: args.stages.allow_bridge,
            cache: Some(args.stages.cache(&workspace_root)),
            gateway: Some(Arc::clone(&model_gateway.gateway)),
            ..EngineConfig::for_process(workspace_root)
        },
    );
    let address = metrics
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    println!("worker {worker_id} listening on {address}");
    let shutdown = shutdown_on_signal();
    let health_task = serve_health(metrics, Arc::clone(&metrics_registry), shutdown.clone());
    let config = WorkerConfig {
        amqp_url: args.broker.amqp_url,
        prefix: args.broker.prefix,
        concurrency: usize::from(args.concurrency),
        worker_id,
        drain: Duration::from_secs(args.drain_seconds),
        heartbeat: Duration::from_secs(10),
        publish_deadline: Duration::from_secs(600),
        job_key,
        profiles: agents.profiles().clone(),
        allowed_schemes: args.stages.schemes(false),
    };
    let code = match worker::service::run(config, engine, metrics_registry, shutdown.clone()).await
    {
        Ok(()) => 0,
        Err(error) => {
            eprintln!("error: {error}");
            1
        }
    };
    runtime.close_egress().await;
    shutdown.cancel();
    let _ = health_task.await;
    code
}

/// Serves the worker's `/healthz`, `/readyz` (503 until its jobs consumer is connected to
/// RabbitMQ, and while it is not) and `/metrics` on `listener` until `shutdown`.
fn serve_health(
    listener: tokio::net::TcpListener,
    metrics: Arc<telemetry::Metrics>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let health = axum::Router::new()
        .route(
            "/healthz",
            axum::routing::get(|| async { axum::Json(serde_json::json!({"status": "ok"})) }),
        )
        .route(
            "/readyz",
            axum::routing::get({
                let metrics = Arc::clone(&metrics);
                move || async move {
                    let broker = metrics.broker_connected();
                    let status = if broker {
                        axum::http::StatusCode::OK
                    } else {
                        axum::http::StatusCode::SERVICE_UNAVAILABLE
                    };
                    (status, axum::Json(serde_json::json!({"broker": broker})))
                }
            }),
        )
        .route(
            "/metrics",
            axum::routing::get(move || async move {
                (
                    [(axum::http::header::CONTENT_TYPE, telemetry::CONTENT_TYPE)],
                    metrics.render(),
                )
            }),
        );
    tokio::spawn(async move {
        let _ = axum::serve(listener, health)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    })
}

/// A token cancelled by the first SIGTERM or Ctrl-C; a second one exits at once.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        let Ok(mut terminate) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return;
        };
        for count in 0.. {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = terminate.recv() => {},
            }
            if count == 0 {
                eprintln!("shutting down: no new work; in-flight work gets its drain time (signal again to stop at once)");
                trigger.cancel();
            } else {
                std::process::exit(130);
            }
        }
    });
    token
}

/// `forgepool prune --older-than DURATION [--logs-only]`: deletes, once, what is stored of
/// runs that ended before then. Runs that have not ended are never touched.
pub async fn prune(args: crate::config::PruneArgs) -> i32 {
    use dispatcher::store::{RunStore, Store};
    let store = match Store::open(&args.database).await {
        Ok(store) => store,
        Err(error) => {
            eprintln!("error: cannot open the run store: {error}");
            return EXIT_INVALID;
        }
    };
    if !args.logs_only && args.older_than < dispatcher::retention::MIN_RUN_HORIZON {
        eprintln!("error: --older-than: a run is kept at least 24 hours, while a repeated submission (Idempotency-Key, message_id) must find it; use --logs-only for a shorter horizon");
        return EXIT_INVALID;
    }
    let horizon = dispatcher::retention::Retention {
        logs: Some(args.older_than),
        runs: (!args.logs_only).then_some(args.older_than),
    };
    match store
        .prune(horizon.prune_at(std::time::SystemTime::now()))
        .await
    {
        Ok(pruned) => {
            println!(
                "pruned {} runs and {} heartbeat and log events of runs that ended more than {} ago",
                pruned.runs,
                pruned.chatter,
                humantime::format_duration(args.older_than)
            );
            0
        }
        Err(error) => {
            eprintln!("error: pruning failed: {error}");
            1
        }
    }
}

/// The webhooks file and the trackers file of a dispatcher, each validated.
fn webhooks_and_trackers(
    args: &DispatcherArgs,
) -> Result<(Option<Webhooks>, Option<Arc<Trackers>>), String> {
    let webhooks = match &args.webhooks_file {
        None => None,
        Some(path) => Some(Webhooks::load(path, |n| std::env::var(n).ok())?),
    };
    let trackers = match &args.trackers_file {
        None => None,
        Some(path) => Some(Arc::new(Trackers::load(path, &|n| std::env::var(n).ok())?)),
    };
    Ok((webhooks, trackers))
}

/// `forgepool trackers check`: the file validated (secrets present), then each tracker's API
/// reached with its token; every problem printed, naming the entry and the setting.
pub async fn check_trackers(path: &std::path::Path) -> i32 {
    let file = match trackers::config::load(path, &|n| std::env::var(n).ok()) {
        Ok(file) => file,
        Err(error) => {
            eprintln!("error: {error}");
            return 1;
        }
    };
    let mut problems = Vec::new();
    let count = file.trackers.len();
    for config in file.trackers {
        match trackers::AnyTracker::new(config) {
            Ok(tracker) => problems.extend(tracker.check().await),
            Err(message) => problems.push(message),
        }
    }
    if problems.is_empty() {
        println!("trackers: {count} checked, each reached with its token; all is well");
        return 0;
    }
    for problem in &problems {
        eprintln!("error: {problem}");
    }
    1
}
