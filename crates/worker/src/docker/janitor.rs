//! Cleaning up: containers of earlier instances of this worker, overdue containers of any
//! worker, and the containers of worker instances known to be gone.

use std::collections::{HashMap, HashSet};

use bollard::query_parameters::ListContainersOptions;

use super::{bounded, process_alive, unix_now, DockerRuntime, API_TIMEOUT};
use crate::runtime::{
    RuntimeError, LABEL_CLUSTER, LABEL_DEADLINE, LABEL_HOST, LABEL_INSTANCE, LABEL_MANAGED,
    LABEL_PID, LABEL_WORKER,
};

/// Whether what carries these owner labels was left by a process that is gone: another
/// instance than this one, and either on another host (the same worker name moved) or of a
/// process of this host that no longer runs, or whose pid this process now has. A live
/// process's things are never taken for leftovers, even under the same worker name (every
/// `forgepool run` on a host is the worker `embedded`).
pub(super) fn left_behind(identity: &super::Identity, labels: &HashMap<String, String>) -> bool {
    let label = |key: &str| labels.get(key).map(String::as_str).unwrap_or("");
    label(LABEL_INSTANCE) != identity.instance
        && (label(LABEL_HOST) != identity.host
            || label(LABEL_PID) == identity.pid.to_string()
            || !process_alive(label(LABEL_PID)))
}

impl DockerRuntime {
    pub(super) async fn remove_orphans_and_overdue(&self) -> Result<usize, RuntimeError> {
        let containers = self.managed_containers().await?;
        let now = unix_now();
        let mut removed = 0;
        for container in containers {
            let labels = container.labels.unwrap_or_default();
            let label = |key: &str| labels.get(key).map(String::as_str).unwrap_or("");
            let ours_from_before =
                label(LABEL_WORKER) == self.identity.worker && left_behind(&self.identity, &labels);
            let overdue = label(LABEL_DEADLINE)
                .parse::<u64>()
                .is_ok_and(|deadline| deadline < now);
            if ours_from_before || overdue {
                if let Some(id) = container.id {
                    self.remove(&id).await?;
                    tracing::info!(container = %id, overdue, "removed orphaned stage container");
                    removed += 1;
                }
            }
        }
        self.remove_orphan_networks().await;
        Ok(removed)
    }

    /// The instances of this cluster, other than this one, that own containers on this engine.
    pub(super) async fn instances_elsewhere(&self) -> Result<HashSet<String>, RuntimeError> {
        let containers = self.managed_containers().await?;
        Ok(containers
            .into_iter()
            .filter_map(|c| c.labels)
            .filter(|labels| labels.get(LABEL_CLUSTER) == Some(&self.identity.cluster))
            .filter_map(|mut labels| labels.remove(LABEL_INSTANCE))
            .filter(|instance| *instance != self.identity.instance)
            .collect())
    }

    /// Removes every container of a worker instance that is known to be gone.
    pub(super) async fn remove_containers_of(&self, instance: &str) -> Result<usize, RuntimeError> {
        let mut removed = 0;
        for container in self.managed_containers().await? {
            let owner = container
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_INSTANCE))
                .map(String::as_str);
            if owner == Some(instance) {
                if let Some(id) = container.id {
                    self.remove(&id).await?;
                    tracing::info!(container = %id, %instance, "removed a container of a dead worker");
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    async fn managed_containers(
        &self,
    ) -> Result<Vec<bollard::models::ContainerSummary>, RuntimeError> {
        let mut filters = HashMap::new();
        filters.insert("label".to_string(), vec![format!("{LABEL_MANAGED}=true")]);
        let options = ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        };
        bounded(
            "list containers",
            API_TIMEOUT,
            self.docker.list_containers(Some(options)),
        )
        .await?
        .map_err(|e| RuntimeError::Cleanup(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::left_behind;
    use crate::docker::Identity;
    use crate::runtime::{LABEL_HOST, LABEL_INSTANCE, LABEL_PID};

    fn labels(instance: &str, host: &str, pid: u32) -> HashMap<String, String> {
        HashMap::from([
            (LABEL_INSTANCE.to_string(), instance.to_string()),
            (LABEL_HOST.to_string(), host.to_string()),
            (LABEL_PID.to_string(), pid.to_string()),
        ])
    }

    /// Catches: two `forgepool run` processes on one host (both the worker `embedded`) taking
    /// each other's egress network for a leftover, which failed the other run's stage with
    /// "network forgepool-egress-… not found".
    #[test]
    fn a_live_process_of_the_same_worker_name_is_not_left_behind() {
        let us = Identity::for_worker("embedded");
        let parent = std::os::unix::process::parent_id();
        assert!(!left_behind(&us, &labels("other", &us.host, parent)));
        assert!(!left_behind(&us, &labels(&us.instance, &us.host, 1)));
    }

    /// Catches: leftovers of a killed run, or of the same worker on another host, kept forever.
    #[test]
    fn a_gone_process_or_another_host_is_left_behind() {
        let us = Identity::for_worker("embedded");
        assert!(left_behind(&us, &labels("old", &us.host, u32::MAX - 1)));
        assert!(left_behind(
            &us,
            &labels("old", "elsewhere", std::process::id())
        ));
        assert!(left_behind(
            &us,
            &labels("old", &us.host, std::process::id())
        ));
    }
}
