//! The worker's settings.

use std::time::Duration;

/// The worker's settings, validated before it starts.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// RabbitMQ URL.
    pub amqp_url: String,
    /// Prefix of queue and exchange names.
    pub prefix: String,
    /// Run slots.
    pub concurrency: usize,
    /// This worker's stable name.
    pub worker_id: String,
    /// How long in-flight runs may finish after SIGTERM before they are handed back.
    pub drain: Duration,
    /// How often a running run reports a heartbeat.
    pub heartbeat: Duration,
    /// How long publishing one event may keep retrying (a broker restart in between).
    pub publish_deadline: Duration,
    /// The key every job must be signed with (`FORGEPOOL_JOB_KEY`).
    pub job_key: proto::JobKey,
    /// The worker's own agent profiles: a job's frozen profiles must be the same.
    pub profiles: std::collections::BTreeMap<String, proto::AgentProfile>,
    /// The repository URL schemes accepted (`FORGEPOOL_ALLOWED_URL_SCHEMES`).
    pub allowed_schemes: Vec<String>,
}
