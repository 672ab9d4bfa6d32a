//! Cleaning up: containers of earlier instances of this worker, overdue containers of any
//! worker, and the containers of worker instances known to be gone.

use std::collections::{HashMap, HashSet};

use bollard::query_parameters::ListContainersOptions;

use super::{bounded, process_alive, unix_now, DockerRuntime, API_TIMEOUT};
use crate::runtime::{
    RuntimeError, LABEL_CLUSTER, LABEL_DEADLINE, LABEL_HOST, LABEL_INSTANCE, LABEL_MANAGED,
    LABEL_PID, LABEL_WORKER,
};

impl DockerRuntime {
    pub(super) async fn remove_orphans_and_overdue(&self) -> Result<usize, RuntimeError> {
        let containers = self.managed_containers().await?;
        let now = unix_now();
        let mut removed = 0;
        for container in containers {
            let labels = container.labels.unwrap_or_default();
            let label = |key: &str| labels.get(key).map(String::as_str).unwrap_or("");
            let ours_from_before = label(LABEL_WORKER) == self.identity.worker
                && label(LABEL_INSTANCE) != self.identity.instance
                && (label(LABEL_HOST) != self.identity.host
                    || label(LABEL_PID) == self.identity.pid.to_string()
                    || !process_alive(label(LABEL_PID)));
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
