//! This worker process's beacon: every [`BEACON_INTERVAL`] it tells the dispatchers, on the
//! control exchange as `roster.{instance}` (`proto::roster`), that it is alive, on which host,
//! with how many slots busy. A beacon is one attempt: the next one replaces a lost one, and a broker outage never
//! holds anything up.

use std::sync::Arc;
use std::time::Duration;

use proto::amqp;
use proto::roster::{WorkerBeacon, BEACON_INTERVAL};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::Jobs;
use crate::runtime::ContainerRuntime;

/// How long one beacon may take to be confirmed.
const BEACON_DEADLINE: Duration = Duration::from_secs(5);

/// The host name this process reports: the kernel's (a container's or a namespace's own).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// Announces this process until `shutdown`, first at once.
pub async fn announce<R: ContainerRuntime>(jobs: Arc<Jobs<R>>, shutdown: CancellationToken) {
    let host = host_name();
    let instance = jobs.engine.runtime().instance().to_string();
    let slots = u32::try_from(jobs.config.concurrency).unwrap_or(u32::MAX);
    let (exchange, key) = (jobs.topology.control(), jobs.topology.roster_key(&instance));
    let mut every = tokio::time::interval(BEACON_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {},
            () = shutdown.cancelled() => return,
        }
        let free = u32::try_from(jobs.slots.available_permits()).unwrap_or(u32::MAX);
        let beacon = WorkerBeacon {
            schema_version: proto::SCHEMA_VERSION,
            worker: jobs.config.worker_id.clone(),
            instance: instance.clone(),
            host: host.clone(),
            slots,
            busy: slots.saturating_sub(free),
            version: env!("CARGO_PKG_VERSION").to_string(),
            sent_at: proto::roster::unix_now(),
        };
        let payload = serde_json::to_vec(&beacon).unwrap_or_default();
        let headers = amqp::signature_headers(WorkerBeacon::sign(&payload, &jobs.config.job_key));
        // No dispatcher bound (none running) is a beacon nobody needed: NO_ROUTE, debug.
        let sent = jobs
            .publisher
            .publish(&exchange, &key, &payload, Some(headers));
        match tokio::time::timeout(BEACON_DEADLINE, sent).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => debug!(%error, "beacon not published"),
            Err(_) => debug!("beacon not confirmed within {BEACON_DEADLINE:?}"),
        }
    }
}
