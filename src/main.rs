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
    /// Show a run, or list the latest runs.
    Status {
        /// The run id; without it, the latest runs.
        run_id: Option<String>,
        #[command(flatten)]
        client: config::ClientArgs,
    },
    /// Cancel a run.
    Cancel {
        /// The run id.
        run_id: String,
        #[command(flatten)]
        client: config::ClientArgs,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(message) = setup_logging(&cli.log_format) {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
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
            Command::Status { run_id, client } => client::status(&client, run_id.as_deref()).await,
            Command::Cancel { run_id, client } => client::cancel(&client, &run_id).await,
        }
    });
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

fn setup_logging(format: &str) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("FORGEPOOL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
