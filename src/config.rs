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
/// The key that signs and checks job messages.
pub const ENV_JOB_KEY: &str = "FORGEPOOL_JOB_KEY";
/// The repository URL schemes accepted.
pub const ENV_ALLOWED_URL_SCHEMES: &str = "FORGEPOOL_ALLOWED_URL_SCHEMES";
/// The operator's permission for profiles with `network = "bridge"`.
pub const ENV_ALLOW_BRIDGE: &str = "FORGEPOOL_ALLOW_BRIDGE_NETWORK";
/// The image of the egress proxies.
pub const ENV_EGRESS_IMAGE: &str = "FORGEPOOL_EGRESS_IMAGE";
/// The repository cache.
pub const ENV_CACHE_DIR: &str = "FORGEPOOL_CACHE_DIR";
/// The repository cache's size limit.
pub const ENV_CACHE_MAX_GIB: &str = "FORGEPOOL_CACHE_MAX_GIB";
/// Compatibility: the cycle-file poll interval in seconds.
pub const ENV_POLL_INTERVAL: &str = "AUTO_REVIEW_POLL_INTERVAL";
/// Layered workspaces (SPEC 14).
pub const ENV_OVERLAY_WORKSPACES: &str = "FORGEPOOL_OVERLAY_WORKSPACES";
/// How forgepool's git reaches each repository host (SPEC 9).
pub const ENV_FORGES_FILE: &str = "FORGEPOOL_FORGES_FILE";

/// `forgepool run FILE`.
/// The trackers file's variable.
pub const ENV_TRACKERS_FILE: &str = "FORGEPOOL_TRACKERS_FILE";

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
    #[command(flatten)]
    pub local: LocalArgs,
}

/// What the trust boundary lets in, for every command that runs or accepts runs.
#[derive(Debug, Args)]
pub struct StageArgs {
    /// Repository URL schemes accepted (comma-separated; of https, http, ssh, git, file).
    /// Default: `https,ssh` for the dispatcher and workers (a `file://` URL would reach the
    /// worker's own repositories), `https,ssh,file` for `forgepool run`.
    #[arg(long = "allowed-url-schemes", env = ENV_ALLOWED_URL_SCHEMES, value_parser = parse_schemes)]
    pub allowed_schemes: Option<AllowedSchemes>,
    /// Let profiles with `network = "bridge"` run (unrestricted network for their stages).
    #[arg(long = "allow-bridge-network", env = ENV_ALLOW_BRIDGE, default_value = "false", value_parser = clap::builder::BoolishValueParser::new())]
    pub allow_bridge: bool,
    /// The image egress proxies run (forgepool's own image, `forgepool egress-proxy`).
    #[arg(long = "egress-image", env = ENV_EGRESS_IMAGE, default_value = worker::docker::DEFAULT_EGRESS_IMAGE)]
    pub egress_image: String,
    /// The repository cache: one mirror per repository URL (default: `.cache` in the
    /// workspace folder).
    #[arg(long = "cache-dir", env = ENV_CACHE_DIR)]
    pub cache_dir: Option<PathBuf>,
    /// The repository cache's size limit in GiB; the least recently used mirrors go first.
    #[arg(long = "cache-max-gib", env = ENV_CACHE_MAX_GIB, default_value = "20")]
    pub cache_max_gib: u64,
    /// Layered workspaces (overlays of cached checkouts): `auto` (a root worker outside a
    /// container, when overlays mount), `true` or `false`.
    #[arg(long = "overlay-workspaces", env = ENV_OVERLAY_WORKSPACES, default_value = "auto")]
    pub overlay_workspaces: worker::workspace::overlay::Setting,
    /// The forges file: credentials (HTTPS tokens, SSH deploy keys, CA files) per repository
    /// host for forgepool's own git; unset, git pushes with no credentials of forgepool's.
    #[arg(long = "forges", env = ENV_FORGES_FILE)]
    pub forges_file: Option<PathBuf>,
}

impl StageArgs {
    /// The schemes accepted: the configured ones, else the default of the embedded mode
    /// (`embedded`, which may use local repositories) or of the services.
    pub fn schemes(&self, embedded: bool) -> Vec<String> {
        match &self.allowed_schemes {
            Some(schemes) => schemes.0.clone(),
            None if embedded => proto::names::default_allowed_schemes(),
            None => proto::names::SERVICE_ALLOWED_SCHEMES
                .iter()
                .map(|s| s.to_string())
                .collect(),
        }
    }

    /// Decides on layered workspaces (a probe mount in the cache folder), then loads the
    /// forges file (an error names the file, the entry and the key) and gives it to
    /// forgepool's git, with its ssh configuration under `workspace_root`.
    pub fn install(&self, workspace_root: &std::path::Path) -> Result<(), String> {
        let cache = self.cache(workspace_root);
        worker::workspace::overlay::configure(self.overlay_workspaces, cache.dir())?;
        let Some(path) = &self.forges_file else {
            return Ok(());
        };
        let mut forges =
            worker::delivery::forges::Forges::load(path, |name| std::env::var(name).ok())?;
        forges
            .write_ssh_config(&workspace_root.join(".forgepool-ssh"))
            .map_err(|e| {
                format!(
                    "forges file {}: cannot write the ssh configuration under {}: {e}",
                    path.display(),
                    workspace_root.display()
                )
            })?;
        worker::delivery::forges::set_forges(forges);
        Ok(())
    }

    /// The repository cache for runs under `workspace_root`.
    pub fn cache(&self, workspace_root: &std::path::Path) -> worker::workspace::cache::RepoCache {
        let dir = self
            .cache_dir
            .clone()
            .unwrap_or_else(|| workspace_root.join(".cache"));
        worker::workspace::cache::RepoCache::new(dir, self.cache_max_gib.saturating_mul(1 << 30))
    }
}

/// The repository URL schemes accepted (one value, so that clap keeps the list whole).
#[derive(Debug, Clone)]
pub struct AllowedSchemes(pub Vec<String>);

fn parse_schemes(text: &str) -> Result<AllowedSchemes, String> {
    proto::names::parse_schemes(text)
        .map(AllowedSchemes)
        .map_err(|e| format!("{ENV_ALLOWED_URL_SCHEMES} {e}"))
}

/// The job key, required by both services in distributed mode.
#[derive(Debug, Args)]
pub struct JobKeyArgs {
    /// The key dispatcher and workers share to sign and check job messages (16+ characters).
    #[arg(long = "job-key", env = ENV_JOB_KEY, hide_env_values = true, value_parser = parse_job_key)]
    pub job_key: Option<proto::JobKey>,
}

impl JobKeyArgs {
    /// The key, or the message that says how to set it.
    pub fn required(&self) -> Result<proto::JobKey, String> {
        self.job_key.clone().ok_or_else(|| {
            format!("{ENV_JOB_KEY} is unset: dispatcher and workers need the same secret key (16 or more characters, for example from `openssl rand -hex 32`) to sign and check jobs")
        })
    }
}

fn parse_job_key(text: &str) -> Result<proto::JobKey, String> {
    proto::JobKey::new(text).map_err(|e| format!("{ENV_JOB_KEY} {e}"))
}

/// Where an embedded run keeps its records and workspaces (`run`, `resume --local`).
#[derive(Debug, Args)]
pub struct LocalArgs {
    /// The run store: a SQLite file path, `sqlite://PATH` or a `postgres://` URL.
    #[arg(long, env = ENV_DATABASE_URL, default_value = "./forgepool.db", hide_env_values = true)]
    pub database: String,
    /// Where run workspaces are created (default: a folder under the system temp dir).
    #[arg(long, env = ENV_WORKSPACE_DIR)]
    pub workspace: Option<PathBuf>,
    /// Seconds between scans of `.forge/` while a stage runs.
    #[arg(long, env = ENV_POLL_INTERVAL, default_value = "0.1", value_parser = parse_poll_interval)]
    pub poll_interval: Duration,
    /// The webhooks told of the run's end (SPEC 9).
    #[arg(long = "webhooks", env = "FORGEPOOL_WEBHOOKS_FILE")]
    pub webhooks_file: Option<PathBuf>,
    /// The longest provider pause (a rate limit with its reset time) this process waits out
    /// before it resumes the run by itself, in seconds; a longer pause, or one that names no
    /// end, ends the command with exit 75 (`forgepool resume RUN_ID --local` continues it).
    /// 0 never waits.
    #[arg(long, env = ENV_PAUSE_WAIT, default_value = "900", value_parser = parse_pause_wait)]
    pub pause_wait: Duration,
    /// Also print what each stage's container prints, line by line (for an agent kind, its
    /// readable log: the messages and the tools it calls).
    #[arg(long = "show-logs", env = "FORGEPOOL_SHOW_LOGS", default_value = "false", value_parser = clap::builder::BoolishValueParser::new())]
    pub show_logs: bool,
    #[command(flatten)]
    pub stages: StageArgs,
}

/// The longest pause `forgepool run` waits out in process.
pub const ENV_PAUSE_WAIT: &str = "FORGEPOOL_PAUSE_WAIT";

fn parse_pause_wait(text: &str) -> Result<Duration, String> {
    match text.trim().parse::<u64>() {
        Ok(seconds) if seconds <= 86_400 => Ok(Duration::from_secs(seconds)),
        _ => Err(format!(
            "{ENV_PAUSE_WAIT} must be a number of seconds from 0 to 86400, got {text:?}"
        )),
    }
}

impl LocalArgs {
    /// The workspace root, made absolute so that it can be bind-mounted.
    pub fn workspace_root(&self) -> Result<PathBuf, String> {
        workspace_root(self.workspace.as_deref())
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

/// RabbitMQ URL.
pub const ENV_AMQP_URL: &str = "FORGEPOOL_AMQP_URL";
/// Prefix of queue and exchange names.
pub const ENV_AMQP_PREFIX: &str = "FORGEPOOL_AMQP_PREFIX";
/// The dispatcher's HTTP address.
pub const ENV_LISTEN: &str = "FORGEPOOL_LISTEN";
/// How long a running run may go unheard before the dispatcher queues it again.
pub const ENV_SILENT_RUN_SECONDS: &str = "FORGEPOOL_SILENT_RUN_SECONDS";
/// The API bearer token.
pub const ENV_API_TOKEN: &str = "FORGEPOOL_API_TOKEN";
/// Where clients find the dispatcher.
pub const ENV_DISPATCHER_URL: &str = "FORGEPOOL_DISPATCHER_URL";
/// Worker run slots.
pub const ENV_CONCURRENCY: &str = "FORGEPOOL_CONCURRENCY";
/// The worker's `/metrics` and `/healthz` address.
pub const ENV_METRICS_ADDR: &str = "FORGEPOOL_METRICS_ADDR";
/// The dispatcher's `/metrics` address, apart from the API (a variable of its own, so that one
/// environment file can serve a dispatcher and a worker on one host).
pub const ENV_DISPATCHER_METRICS_ADDR: &str = "FORGEPOOL_DISPATCHER_METRICS_ADDR";
/// The worker's stable name.
pub const ENV_WORKER_ID: &str = "FORGEPOOL_WORKER_ID";
/// Seconds in-flight runs get to finish after SIGTERM.
pub const ENV_DRAIN_SECONDS: &str = "FORGEPOOL_DRAIN_SECONDS";

/// The default RabbitMQ URL.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A retention horizon: how long something is kept; `None` is for ever.
#[derive(Debug, Clone, Copy)]
pub struct Horizon(pub Option<Duration>);

/// `forgepool prune`.
#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Delete runs that ended more than this long ago (`30d`, `36h`…, at least a day; with
    /// `--logs-only`, at least an hour), with everything stored of them.
    #[arg(long = "older-than", value_parser = |v: &str| dispatcher::retention::parse_horizon("--older-than", v).and_then(|h| h.ok_or_else(|| "--older-than: give a duration; `never` prunes nothing".to_string())))]
    pub older_than: Duration,
    /// Delete only the heartbeat and log events of those runs, and keep the runs.
    #[arg(long = "logs-only")]
    pub logs_only: bool,
    /// The run store: a SQLite file path, `sqlite://PATH` or a `postgres://` URL.
    #[arg(long, env = ENV_DATABASE_URL, default_value = "./forgepool.db", hide_env_values = true)]
    pub database: String,
}

/// Settings shared by the services.
#[derive(Debug, Args)]
pub struct BrokerArgs {
    /// RabbitMQ URL.
    #[arg(long = "amqp-url", env = ENV_AMQP_URL, default_value = DEFAULT_AMQP_URL, hide_env_values = true)]
    pub amqp_url: String,
    /// Prefix of queue and exchange names.
    #[arg(long = "amqp-prefix", env = ENV_AMQP_PREFIX, default_value = "forgepool", value_parser = parse_prefix)]
    pub prefix: String,
}

/// `forgepool dispatcher`.
#[derive(Debug, Args)]
pub struct DispatcherArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// HTTP address for the API and `/metrics`.
    #[arg(long, env = ENV_LISTEN, default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,
    /// Serve `/metrics` (with `/healthz` and `/readyz`) here, apart from the API, instead of
    /// on the API's address.
    #[arg(long = "metrics-addr", env = ENV_DISPATCHER_METRICS_ADDR)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The run store: a SQLite file path or `sqlite://PATH`.
    #[arg(long, env = ENV_DATABASE_URL, default_value = "./forgepool.db", hide_env_values = true)]
    pub database: String,
    /// The skills directory.
    #[arg(long, env = ENV_SKILLS_DIR, default_value = "./skills")]
    pub skills: PathBuf,
    /// The agent profiles file.
    #[arg(long, env = ENV_AGENTS_FILE, default_value = "./agents.toml")]
    pub agents: PathBuf,
    /// The bearer token clients must send; unset means no authentication (loopback only).
    #[arg(long = "api-token", env = ENV_API_TOKEN, hide_env_values = true)]
    pub api_token: Option<String>,
    /// How long a running run may go unheard (no heartbeat, state or stage) before its job is
    /// queued again, to continue from its last completed stage.
    #[arg(long = "silent-run-seconds", env = ENV_SILENT_RUN_SECONDS, default_value = "300", value_parser = clap::value_parser!(u64).range(30..))]
    pub silent_run_seconds: u64,
    /// How long a published job stays valid, in seconds: a copy older than this is
    /// dead-lettered unread (its run fails with the reason) instead of run.
    #[arg(long = "job-ttl-seconds", env = "FORGEPOOL_JOB_TTL", default_value = "604800", value_parser = clap::value_parser!(u64).range(60..))]
    pub job_ttl_seconds: u64,
    /// Whether paused runs resume by themselves when the pause their provider gave
    /// (`pause.json`) ends; `false` leaves them to `forgepool resume`.
    #[arg(long = "auto-resume", env = "FORGEPOOL_AUTO_RESUME", default_value = "true", action = clap::ArgAction::Set)]
    pub auto_resume: bool,
    /// Whether other dispatchers store events in the same store (more than one replica on
    /// PostgreSQL): event streams then read what is stored instead of taking live events from
    /// this dispatcher alone.
    #[arg(long = "shared-store", env = "FORGEPOOL_SHARED_STORE", default_value = "false", action = clap::ArgAction::Set)]
    pub shared_store: bool,
    /// The webhooks told of runs that end (SPEC 9).
    #[arg(long = "webhooks", env = "FORGEPOOL_WEBHOOKS_FILE")]
    pub webhooks_file: Option<PathBuf>,
    /// The issue trackers tickets come from and progress goes back to (SPEC 17).
    #[arg(long = "trackers", env = ENV_TRACKERS_FILE)]
    pub trackers_file: Option<PathBuf>,
    /// How long the heartbeat and log events of a run that ended are kept (`7d`, `36h`…, at
    /// least an hour, or `never` to keep them for ever).
    #[arg(long = "retain-logs", env = "FORGEPOOL_RETAIN_LOGS", default_value = "7d", value_parser = |v: &str| dispatcher::retention::parse_horizon("FORGEPOOL_RETAIN_LOGS", v).map(Horizon))]
    pub retain_logs: Horizon,
    /// How long a run that ended is kept, with everything stored of it (`90d`…, or `never`).
    #[arg(long = "retain-runs", env = "FORGEPOOL_RETAIN_RUNS", default_value = "never", value_parser = |v: &str| dispatcher::retention::parse_run_horizon("FORGEPOOL_RETAIN_RUNS", v).map(Horizon))]
    pub retain_runs: Horizon,
    #[command(flatten)]
    pub job_key: JobKeyArgs,
    #[command(flatten)]
    pub stages: StageArgs,
}

/// `forgepool worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Run slots.
    #[arg(long, env = ENV_CONCURRENCY, default_value = "1", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub concurrency: u16,
    /// Where run workspaces are created.
    #[arg(long, env = ENV_WORKSPACE_DIR)]
    pub workspace: Option<PathBuf>,
    /// Address of `/metrics` and `/healthz`.
    #[arg(long = "metrics-addr", env = ENV_METRICS_ADDR, default_value = "127.0.0.1:9090")]
    pub metrics_addr: std::net::SocketAddr,
    /// This worker's stable name (default: the host name).
    #[arg(long = "worker-id", env = ENV_WORKER_ID)]
    pub worker_id: Option<String>,
    /// Seconds in-flight runs get to finish after SIGTERM before they are handed back.
    #[arg(long = "drain-seconds", env = ENV_DRAIN_SECONDS, default_value = "30")]
    pub drain_seconds: u64,
    /// Seconds between scans of `.forge/` while a stage runs.
    #[arg(long, env = ENV_POLL_INTERVAL, default_value = "0.1", value_parser = parse_poll_interval)]
    pub poll_interval: Duration,
    /// The agent profiles file: a job's profiles must be the same as the worker's own.
    #[arg(long, env = ENV_AGENTS_FILE, default_value = "./agents.toml")]
    pub agents: PathBuf,
    #[command(flatten)]
    pub job_key: JobKeyArgs,
    #[command(flatten)]
    pub stages: StageArgs,
}

impl WorkerArgs {
    /// The workspace root, made absolute so that it can be bind-mounted.
    pub fn workspace_root(&self) -> Result<PathBuf, String> {
        workspace_root(self.workspace.as_deref())
    }
}

/// Settings of the clients.
#[derive(Debug, Args)]
pub struct ClientArgs {
    /// The dispatcher's URL.
    #[arg(long = "dispatcher-url", env = ENV_DISPATCHER_URL, default_value = "http://127.0.0.1:8080")]
    pub dispatcher_url: String,
    /// The bearer token.
    #[arg(long = "api-token", env = ENV_API_TOKEN, hide_env_values = true)]
    pub api_token: Option<String>,
    /// What to print: `text` for people, `json` for scripts (one JSON document; JSON lines,
    /// one event each, for `watch`).
    #[arg(long, short = 'o', value_enum, default_value = "text")]
    pub output: OutputFormat,
    /// Put each progress line's time (UTC) in front of it.
    #[arg(long)]
    pub timestamps: bool,
    /// The longest a request to the dispatcher may take, in seconds (an event stream may stay
    /// open longer: it only has to send something every this many seconds).
    #[arg(long = "timeout", env = "FORGEPOOL_CLIENT_TIMEOUT", default_value = "30", value_parser = parse_client_timeout)]
    pub timeout: Duration,
}

/// What the clients print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Lines for people: a spinner and colours on a terminal, plain lines elsewhere.
    Text,
    /// JSON for scripts.
    Json,
}

fn parse_client_timeout(text: &str) -> Result<Duration, String> {
    match text.parse::<u64>() {
        Ok(seconds) if (1..=3600).contains(&seconds) => Ok(Duration::from_secs(seconds)),
        _ => Err(format!("--timeout must be 1 to 3600 seconds, got {text:?}")),
    }
}

fn parse_prefix(text: &str) -> Result<String, String> {
    let ok = !text.is_empty()
        && text.len() <= 64
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{ENV_AMQP_PREFIX} must be 1 to 64 letters, digits, '-', '_' or '.', got {text:?}"
        ))
    }
}

/// The workspace root (`FORGEPOOL_WORKSPACE_DIR`, else a folder under the system temp dir),
/// created and made absolute so that it can be bind-mounted into stage containers.
fn workspace_root(configured: Option<&std::path::Path>) -> Result<PathBuf, String> {
    let root = configured.map_or_else(|| std::env::temp_dir().join("forgepool"), PathBuf::from);
    std::fs::create_dir_all(&root).map_err(|e| {
        format!(
            "{ENV_WORKSPACE_DIR} ({}): cannot create it: {e}",
            root.display()
        )
    })?;
    root.canonicalize()
        .map_err(|e| format!("{ENV_WORKSPACE_DIR} ({}): {e}", root.display()))
}
