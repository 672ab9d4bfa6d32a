//! The container-runtime seam: run one stage container to completion.
//!
//! Only this module and [`crate::docker`] know about containers. The engine describes a stage
//! with a [`StageSpec`] and gets back a [`StageOutput`]; the Docker implementation creates,
//! starts, streams, waits for, kills on timeout and always removes the container. Beside the
//! seam: the egress proxy a stage with `network = "egress"` goes out through ([`egress`]),
//! and the scripted runtime of the engine's tests (`fake`).
//!
//! The seam is whole in `mod.rs`: `create_stage` and `run_created` (or both at once with
//! `run_stage`), and the cleanup the worker service needs (`remove_orphans`, `instance`,
//! `other_instances`, `remove_instance`, `close`); beside it `StageSpec`, the labels, and
//! redaction (every byte read back from a container passes `redact`).

pub mod egress;
#[cfg(test)]
pub(crate) mod fake;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use proto::{LogStream, Network};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The label every forgepool container carries.
pub const LABEL_MANAGED: &str = "forgepool.managed";
/// The label naming the run.
pub const LABEL_RUN: &str = "forgepool.run_id";
/// The label naming the stage.
pub const LABEL_STAGE: &str = "forgepool.stage";
/// The label naming the worker.
pub const LABEL_WORKER: &str = "forgepool.worker";
/// The label naming the worker process instance.
pub const LABEL_INSTANCE: &str = "forgepool.instance";
/// The label naming the host the worker runs on.
pub const LABEL_HOST: &str = "forgepool.host";
/// The label naming the cluster (queue prefix) of the worker.
pub const LABEL_CLUSTER: &str = "forgepool.cluster";
/// The label holding the worker's process id.
pub const LABEL_PID: &str = "forgepool.pid";
/// The label holding the Unix time after which the container is overdue and may be removed
/// by any worker.
pub const LABEL_DEADLINE: &str = "forgepool.deadline";

/// Everything needed to run one stage container.
#[derive(Debug, Clone)]
pub struct StageSpec {
    /// The container name.
    pub name: String,
    /// The image.
    pub image: String,
    /// The command; the image's default when empty.
    pub command: Vec<String>,
    /// Environment as `NAME=value`.
    pub env: Vec<String>,
    /// Bind mounts.
    pub mounts: Vec<Mount>,
    /// The network.
    pub network: Network,
    /// With [`Network::Egress`]: the `host:port`s the stage may reach through its proxy.
    pub egress: Vec<String>,
    /// The stage reaches the worker's model gateway (its profile has a `provider`): it joins
    /// the internal network where the gateway's relay is.
    pub gateway: bool,
    /// Memory limit in bytes (swap is not allowed beyond it).
    pub memory_bytes: u64,
    /// CPU limit in cores.
    pub cpus: f64,
    /// Maximum number of processes.
    pub pids_limit: i64,
    /// The root filesystem is read-only; `/tmp` is a tmpfs of `disk_bytes`.
    pub read_only_root: bool,
    /// The most the stage may write to `/tmp`, and the largest file it may write.
    pub disk_bytes: u64,
    /// The user to run as, `uid:gid`.
    pub user: Option<String>,
    /// The working directory inside the container.
    pub workdir: Option<String>,
    /// The time limit; the container is killed and removed when it is exceeded.
    pub timeout: Duration,
    /// Labels naming the run, the stage and the worker.
    pub labels: HashMap<String, String>,
    /// Secret values to replace with `[REDACTED]` in everything read from the container.
    pub redact: Vec<String>,
    /// The agent kind whose CLI the stage runs: its stdout is read by the kind's
    /// [`crate::agents::AgentReader`] (log lines, transcript, usage, outcome). `None` for the
    /// `command` kind and for verification commands, whose output is logged as it is.
    pub agent: Option<proto::AgentKind>,
}

/// A host directory mounted into a stage container.
#[derive(Debug, Clone)]
pub struct Mount {
    /// The host path.
    pub source: PathBuf,
    /// The path inside the container.
    pub target: String,
    /// Mounted read-only.
    pub read_only: bool,
}

/// How a stage container ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageExit {
    /// It exited with this code.
    Exited(i64),
    /// It ran past its time limit and was killed.
    TimedOut,
    /// The run was cancelled and the container was killed.
    Cancelled,
}

/// What a finished stage container left.
#[derive(Debug, Clone)]
pub struct StageOutput {
    /// How it ended.
    pub exit: StageExit,
    /// Its standard output, capped at [`MAX_CAPTURED_STDOUT`] bytes, secrets redacted.
    pub stdout: String,
    /// The last lines of stdout and stderr together, secrets redacted.
    pub tail: String,
    /// Wall time from create to removal.
    pub duration: Duration,
    /// For a stage of an agent kind: what its CLI reported ([`StageSpec::agent`]).
    pub agent: Option<crate::agents::AgentReport>,
}

/// The most stdout kept for a stage (the reviewer's verdict is read from it).
pub const MAX_CAPTURED_STDOUT: usize = 1024 * 1024;
/// The most log bytes of one stage forwarded as events and stored; the rest is counted and
/// summarised in one last chunk.
pub const MAX_LOG_BYTES: usize = 1024 * 1024;
/// The most log lines of one stage forwarded as events and stored.
pub const MAX_LOG_LINES: usize = 10_000;
/// The longest partial line held while waiting for its end; a longer one is forwarded in
/// pieces.
pub const MAX_PARTIAL_LINE: usize = 64 * 1024;
/// The size of the output tail kept for failure reports.
pub const TAIL_BYTES: usize = 4096;

/// A chunk of output lines from a stage, sent while it runs.
#[derive(Debug, Clone)]
pub struct LogChunk {
    /// The stream.
    pub stream: LogStream,
    /// One or more complete lines, secrets redacted.
    pub text: String,
}

/// A failed runtime operation. Each says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The engine cannot be reached.
    #[error("cannot reach the Docker engine at {endpoint}: {detail}; start it (`dockerd &` or `systemctl start docker`) or point DOCKER_HOST at a running engine")]
    Unreachable {
        /// Where it was looked for.
        endpoint: String,
        /// The cause.
        detail: String,
    },
    /// The image is not on the engine and could not be pulled.
    #[error("image `{image}` is not on the Docker engine and could not be pulled ({detail}); build or load it there first, for example with `docker build -t {image} DIR` or `docker load`")]
    ImageMissing {
        /// The image.
        image: String,
        /// The pull error.
        detail: String,
    },
    /// Creating the container failed.
    #[error("cannot create container for image `{image}`: {detail}")]
    CreateContainer {
        /// The image.
        image: String,
        /// The cause.
        detail: String,
    },
    /// Starting the container failed.
    #[error("cannot start container {name}: {detail}")]
    StartContainer {
        /// The container.
        name: String,
        /// The cause.
        detail: String,
    },
    /// Waiting for the container failed.
    #[error("lost track of container {name}: {detail}")]
    WaitContainer {
        /// The container.
        name: String,
        /// The cause.
        detail: String,
    },
    /// A Docker API call did not answer in time.
    #[error("the Docker engine did not answer `{operation}` within {seconds} s; check its health (`docker info`)")]
    Timeout {
        /// The operation.
        operation: &'static str,
        /// The limit.
        seconds: u64,
    },
    /// Listing or removing containers failed.
    #[error("cannot clean up containers: {0}")]
    Cleanup(String),
}

/// Runs stage containers.
pub trait ContainerRuntime: Send + Sync + 'static {
    /// A stage container created and not started yet. Dropping it removes the container.
    type Created: Send + Sync + 'static;

    /// Creates a stage's container without starting it, so that the creation can overlap
    /// other work (the run's clone). Its mounts' sources need not be filled yet.
    fn create_stage(
        &self,
        spec: StageSpec,
    ) -> impl Future<Output = Result<Self::Created, RuntimeError>> + Send;

    /// Starts a created stage and runs it to completion, sending its output while it runs.
    /// The container is removed afterwards whatever happens, including timeouts and
    /// cancellation.
    fn run_created(
        &self,
        created: Self::Created,
        logs: mpsc::Sender<LogChunk>,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<StageOutput, RuntimeError>> + Send;

    /// Creates a stage's container and runs it to completion (see [`Self::run_created`]).
    fn run_stage(
        &self,
        spec: StageSpec,
        logs: mpsc::Sender<LogChunk>,
        cancel: CancellationToken,
    ) -> impl Future<Output = Result<StageOutput, RuntimeError>> + Send {
        async move {
            let created = self.create_stage(spec).await?;
            self.run_created(created, logs, cancel).await
        }
    }

    /// Removes containers left by earlier instances of this worker, and overdue containers of
    /// any worker. Returns how many were removed.
    fn remove_orphans(&self) -> impl Future<Output = Result<usize, RuntimeError>> + Send;

    /// This process's instance id, carried by everything it makes.
    fn instance(&self) -> &str;

    /// The instances of this worker's cluster, other than this one, that own containers here.
    fn other_instances(&self)
        -> impl Future<Output = Result<HashSet<String>, RuntimeError>> + Send;

    /// Removes everything a worker instance known to be gone left. Returns how many
    /// containers were removed.
    fn remove_instance(
        &self,
        instance: &str,
    ) -> impl Future<Output = Result<usize, RuntimeError>> + Send;

    /// Releases what this process made beside its stage containers (egress proxies and their
    /// network), at shutdown.
    fn close(&self) -> impl Future<Output = ()> + Send;
}

/// Replaces every secret value in `text` with `[REDACTED]`.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut text = text.to_string();
    for secret in secrets.iter().filter(|s| s.len() >= 4) {
        if text.contains(secret.as_str()) {
            text = text.replace(secret.as_str(), "[REDACTED]");
        }
    }
    text
}

/// Keeps the last `limit` bytes of `text` on a character boundary.
pub fn tail(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut start = text.len() - limit;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_replaces_every_secret() {
        let secrets = vec!["sk-live-123456".to_string(), "abc".to_string()];
        assert_eq!(
            redact("key=sk-live-123456 again sk-live-123456", &secrets),
            "key=[REDACTED] again [REDACTED]"
        );
        assert_eq!(
            redact("abc stays: too short to be a secret", &secrets),
            "abc stays: too short to be a secret"
        );
    }

    #[test]
    fn tails_respect_char_boundaries() {
        assert_eq!(tail("hello", 10), "hello");
        assert_eq!(tail("hello", 3), "llo");
        assert_eq!(tail("héllo", 4), "llo");
    }
}
