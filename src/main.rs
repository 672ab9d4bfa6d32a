//! The `forgepool` binary: parses the command line, sets up logging, and hands over to the
//! library code of the chosen command. It holds no logic of its own beyond that.

mod client;
mod config;
mod embedded;
mod progress;
mod services;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// forgepool runs AI coding-agent jobs with bounded review loops.
#[derive(Debug, Parser)]
#[command(name = "forgepool", version, about)]
struct Cli {
    /// Log format on stderr: `text` or `json`.
    #[arg(
        long,
        global = true,
        env = "FORGEPOOL_LOG_FORMAT",
        default_value = "text"
    )]
    log_format: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum TrackersAction {
    /// Read the trackers file and reach each tracker's API with its token: says what is wrong,
    /// naming the entry and the setting (exit 1), or that all is well.
    Check {
        /// The trackers file.
        #[arg(long = "trackers", env = config::ENV_TRACKERS_FILE)]
        file: std::path::PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one request on this machine: dispatcher and worker in one process (embedded mode).
    Run(config::RunArgs),
    /// The dispatcher service: HTTP API, run store, submission and events consumers.
    Dispatcher(config::DispatcherArgs),
    /// A worker service: takes jobs from RabbitMQ and runs their stages in Docker.
    Worker(config::WorkerArgs),
    /// Submit a run request file to the dispatcher.
    Submit {
        /// The run request: a TOML or JSON file.
        file: std::path::PathBuf,
        /// Wait for the run to end, printing its progress, and exit with its code.
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// Print a run's progress until it ends, and exit with its code.
    Watch {
        /// The run id.
        run_id: String,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// Show a run, or list the latest runs (newest first, with column headers).
    Status {
        /// The run id; without it, the latest runs.
        run_id: Option<String>,
        /// List only runs in this state (queued, running, paused, delivered,
        /// delivered_with_warnings, blocked, failed, cancelled).
        #[arg(long)]
        state: Option<String>,
        /// List only runs of this ticket.
        #[arg(long)]
        ticket: Option<String>,
        /// List only runs of this skill.
        #[arg(long)]
        skill: Option<String>,
        /// List at most this many runs (1 to 500).
        #[arg(long, default_value = "20", value_parser = clap::value_parser!(u32).range(1..=500))]
        limit: u32,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// Resume a paused run from its latest checkpoint, with its original frozen job.
    Resume {
        /// The run id.
        run_id: String,
        /// Wait for the run to end, printing its progress, and exit with its code.
        #[arg(long)]
        wait: bool,
        /// Resume an embedded run (`forgepool run`) in this process, from the local run store,
        /// instead of asking the dispatcher.
        #[arg(long)]
        local: bool,
        #[command(flatten)]
        store: config::LocalArgs,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// Delete what the run store keeps of runs that ended long ago (the dispatcher also does it
    /// by itself: FORGEPOOL_RETAIN_LOGS, FORGEPOOL_RETAIN_RUNS).
    Prune(config::PruneArgs),
    /// The egress proxy of `network = "egress"` stages; workers start it in its own container.
    #[command(hide = true)]
    EgressProxy,
    /// The relay between stage containers and the worker's model gateway; workers start it in
    /// its own container.
    #[command(hide = true)]
    GatewayRelay,
    /// Brings the run store named by FORGEPOOL_DATABASE_URL up to this release's schema, then
    /// exits; `forgepool dispatcher` runs it as a short-lived child.
    #[command(hide = true)]
    MigrateStore,
    /// Continue a delivered run's branch with feedback: a new run whose delivery adds a commit
    /// to the same branch and pull request.
    FollowUp {
        /// The delivered run.
        run_id: String,
        /// What the implementer is asked to change.
        #[arg(long)]
        feedback: String,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// The issue trackers of FORGEPOOL_TRACKERS_FILE (SPEC 17).
    Trackers {
        #[command(subcommand)]
        action: TrackersAction,
    },
    /// Cancel a run.
    Cancel {
        /// The run id.
        run_id: String,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// Print a completion script for a shell, e.g. `forgepool completions bash >
    /// /etc/bash_completion.d/forgepool`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), e.g. `forgepool man | man -l -`.
    Man,
}

/// Writes the manual page on stdout.
fn manual() -> i32 {
    let command = <Cli as clap::CommandFactory>::command();
    let mut page = Vec::new();
    if let Err(error) = clap_mangen::Man::new(command).render(&mut page) {
        eprintln!("error: cannot make the manual page: {error}");
        return 1;
    }
    page.extend_from_slice(EXIT_STATUS_SECTION.as_bytes());
    use std::io::Write;
    match std::io::stdout().write_all(&page) {
        Ok(()) => 0,
        Err(_) => 1,
    }
}

/// The manual's exit codes, after clap's sections.
const EXIT_STATUS_SECTION: &str = r#".SH "EXIT STATUS"
.TP
0
the run was delivered (with or without warnings), or the command did what it was asked
.TP
1
the run failed or was cancelled, or the dispatcher failed the request
.TP
2
invalid input or configuration (a field, a file, a setting), or the dispatcher refused the request
.TP
3
the run is blocked
.TP
69
the dispatcher cannot be reached (no connection, or no answer within \fB--timeout\fR)
.TP
75
the run is paused (resume it with \fBforgepool resume\fR)
"#;

/// The stack of each of the runtime's worker threads.
const RUNTIME_STACK_BYTES: usize = 8 * 1024 * 1024;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(message) = setup_logging(&cli.log_format) {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    // Worker threads get the main thread's 8 MiB of stack rather than tokio's 2 MiB: a run's
    // engine is one deeply nested future, whose polls take far more stack in unoptimised
    // builds (the test build overflowed 2 MiB entering a final review). Untouched stack costs
    // no memory.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(RUNTIME_STACK_BYTES)
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::from(1);
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => embedded::run(args).await,
            Command::Dispatcher(args) => services::dispatcher(args).await,
            Command::Worker(args) => services::worker(args).await,
            Command::Submit { file, wait, client } => client::submit(&client, &file, wait).await,
            Command::Watch { run_id, client } => client::watch(&client, &run_id).await,
            Command::Status {
                run_id,
                state,
                ticket,
                skill,
                limit,
                client,
            } => {
                let filter = client::ListFilter {
                    state,
                    ticket,
                    skill,
                    limit,
                };
                client::status(&client, run_id.as_deref(), &filter).await
            }
            Command::Resume {
                run_id,
                wait,
                local,
                store,
                client,
            } => {
                if local {
                    embedded::resume(&run_id, &store).await
                } else {
                    client::resume(&client, &run_id, wait).await
                }
            }
            Command::Cancel { run_id, client } => client::cancel(&client, &run_id).await,
            Command::FollowUp {
                run_id,
                feedback,
                client,
            } => client::follow_up(&client, &run_id, &feedback).await,
            Command::Trackers {
                action: TrackersAction::Check { file },
            } => services::check_trackers(&file).await,
            Command::Prune(args) => services::prune(args).await,
            Command::MigrateStore => services::migrate_store().await,
            Command::EgressProxy => {
                worker::runtime::egress::run_from_env(services::shutdown_on_signal()).await
            }
            Command::GatewayRelay => {
                worker::model_gateway::relay_from_env(services::shutdown_on_signal()).await
            }
            Command::Completions { shell } => {
                let mut command = <Cli as clap::CommandFactory>::command();
                clap_complete::generate(shell, &mut command, "forgepool", &mut std::io::stdout());
                0
            }
            Command::Man => manual(),
        }
    });
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// `filter` with every directive for a [`BODY_LOGGING_TARGETS`] library capped at `info`, and
/// an `info` cap added for those it does not name (a quieter setting is kept).
fn capped_filter(filter: &str) -> String {
    let mut directives: Vec<String> = Vec::new();
    let mut named = Vec::new();
    for directive in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let target = BODY_LOGGING_TARGETS
            .iter()
            .find(|t| directive.split(['=', '[', ':']).next() == Some(**t));
        match (target, directive.rsplit_once('=')) {
            (Some(target), Some((_, level))) => {
                named.push(*target);
                let quiet =
                    ["off", "error", "warn", "info"].contains(&level.to_lowercase().as_str());
                directives.push(if quiet {
                    directive.to_string()
                } else {
                    format!("{target}=info")
                });
            }
            _ => directives.push(directive.to_string()),
        }
    }
    for target in BODY_LOGGING_TARGETS {
        if !named.contains(&target) {
            directives.push(format!("{target}=info"));
        }
    }
    directives.join(",")
}

/// Libraries whose debug output carries request bodies: bollard logs a container's whole
/// configuration, environment (and so secret values) included. They are capped at `info`
/// whatever `FORGEPOOL_LOG` asks for, so that no filter can put a secret in a log line.
const BODY_LOGGING_TARGETS: [&str; 3] = ["bollard", "hyper", "reqwest"];

fn setup_logging(format: &str) -> Result<(), String> {
    let requested = std::env::var("FORGEPOOL_LOG").unwrap_or_else(|_| "warn".into());
    let filter = tracing_subscriber::EnvFilter::try_new(capped_filter(&requested))
        .map_err(|error| format!("FORGEPOOL_LOG ({requested:?}) is not a log filter: {error}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour(
            std::io::IsTerminal::is_terminal(&std::io::stderr()),
            std::env::var_os("NO_COLOR").as_deref(),
        ))
        .with_writer(std::io::stderr);
    match format {
        "text" => builder.init(),
        "json" => builder.json().init(),
        other => {
            return Err(format!(
                "FORGEPOOL_LOG_FORMAT (--log-format) must be `text` or `json`, got {other:?}"
            ))
        }
    }
    Ok(())
}

/// Whether log lines are coloured: only on a terminal, and never when `NO_COLOR` is set to
/// anything but the empty string (no-color.org).
fn colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(|value| value.is_empty())
}

#[cfg(test)]
mod tests {
    use super::{capped_filter, colour};

    /// Catches: escape codes in logs redirected to a file, and `NO_COLOR` ignored.
    #[test]
    fn logs_are_coloured_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some(std::ffi::OsStr::new(""))));
        assert!(!colour(true, Some(std::ffi::OsStr::new("1"))));
        assert!(!colour(false, None));
    }

    #[test]
    fn no_log_filter_lets_request_bodies_through() {
        assert_eq!(
            capped_filter("debug"),
            "debug,bollard=info,hyper=info,reqwest=info"
        );
        assert_eq!(
            capped_filter("info,bollard=trace,hyper=off"),
            "info,bollard=info,hyper=off,reqwest=info"
        );
    }
}
