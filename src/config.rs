//! Settings of the commands, read from flags and the environment and checked before any work
//! starts. Every variable name is a constant here.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

/// The run store.
pub const ENV_DATABASE_URL: &str = "FORGEPOOL_DATABASE_URL";
/// The skills directory.
pub const ENV_SKILLS_DIR: &str = "FORGEPOOL_SKILLS_DIR";
/// The agents file.
pub const ENV_AGENTS_FILE: &str = "FORGEPOOL_AGENTS_FILE";
/// Where workspaces live.
pub const ENV_WORKSPACE_DIR: &str = "FORGEPOOL_WORKSPACE_DIR";
/// Compatibility: the cycle-file poll interval in seconds.
pub const ENV_POLL_INTERVAL: &str = "AUTO_REVIEW_POLL_INTERVAL";

/// `forgepool run FILE`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The run request: a TOML or JSON file.
    pub file: PathBuf,
    /// The skills directory.
    #[arg(long, env = ENV_SKILLS_DIR, default_value = "./skills")]
    pub skills: PathBuf,
    /// The agent profiles file.
    #[arg(long, env = ENV_AGENTS_FILE, default_value = "./agents.toml")]
    pub agents: PathBuf,
    /// The run store: a SQLite file path or `sqlite://PATH`.
    #[arg(long, env = ENV_DATABASE_URL, default_value = "./forgepool.db")]
    pub database: String,
    /// Where run workspaces are created (default: a folder under the system temp dir).
    #[arg(long, env = ENV_WORKSPACE_DIR)]
    pub workspace: Option<PathBuf>,
    /// Seconds between scans of `.forge/` while a stage runs.
    #[arg(long, env = ENV_POLL_INTERVAL, default_value = "0.1", value_parser = parse_poll_interval)]
    pub poll_interval: Duration,
}

impl RunArgs {
    /// The workspace root, made absolute so that it can be bind-mounted.
    pub fn workspace_root(&self) -> Result<PathBuf, String> {
        let root = self
            .workspace
            .clone()
            .unwrap_or_else(|| std::env::temp_dir().join("forgepool"));
        std::fs::create_dir_all(&root).map_err(|e| {
            format!(
                "{ENV_WORKSPACE_DIR} ({}): cannot create it: {e}",
                root.display()
            )
        })?;
        root.canonicalize()
            .map_err(|e| format!("{ENV_WORKSPACE_DIR} ({}): {e}", root.display()))
    }
}

fn parse_poll_interval(text: &str) -> Result<Duration, String> {
    match text.trim().parse::<f64>() {
        Ok(seconds) if (0.01..=60.0).contains(&seconds) => Ok(Duration::from_secs_f64(seconds)),
        _ => Err(format!(
            "{ENV_POLL_INTERVAL} must be a number of seconds from 0.01 to 60, got {text:?}"
        )),
    }
}
