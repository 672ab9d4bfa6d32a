//! Egress proxies: for `network = "egress"` stages, one proxy container per allowlist on this
//! process's internal network (see [`crate::runtime::egress`] for the proxy itself).

use std::time::Instant;

use bollard::models::ContainerCreateBody as Config;
use bollard::models::HostConfig;
use bollard::query_parameters::{CreateContainerOptions, ListNetworksOptions, LogsOptions};
use futures_util::StreamExt;

use super::short_instance;
use crate::runtime::{
    LABEL_CLUSTER, LABEL_HOST, LABEL_INSTANCE, LABEL_MANAGED, LABEL_PID, LABEL_STAGE, LABEL_WORKER,
};
use std::collections::HashMap;
use std::time::Duration;

use super::{bounded, DockerRuntime, API_TIMEOUT};
use crate::runtime::RuntimeError;

/// What this runtime made for `network = "egress"` stages.
#[derive(Debug, Default)]
pub(super) struct EgressState {
    pub(super) network: bool,
    /// Allowlist → (proxy container name, token).
    pub(super) proxies: HashMap<Vec<String>, (String, String)>,
    /// The model gateway's relay container, once started.
    pub(super) relay: Option<String>,
}

/// How long a new egress proxy may take to listen.
const PROXY_READY: Duration = Duration::from_secs(15);

/// The image egress proxies run unless `FORGEPOOL_EGRESS_IMAGE` names another.
pub const DEFAULT_EGRESS_IMAGE: &str = "forgepool:dev";

impl DockerRuntime {
    /// The same runtime with egress proxies running `image`.
    pub fn with_egress_image(mut self, image: impl Into<String>) -> DockerRuntime {
        self.egress_image = image.into();
        self
    }

    /// The internal network of this process's egress proxies and the gateway's relay: no
    /// route out, and no address of the host on it (`inhibit_ipv4`). No stage is on it: each
    /// stage has its own network, which the proxy or relay it needs joins.
    pub fn egress_network(&self) -> String {
        format!(
            "forgepool-egress-{}",
            short_instance(&self.identity.instance)
        )
    }

    /// The proxy URL for a stage allowed `hosts`, and the proxy's container: the egress
    /// network exists and a proxy for exactly that allowlist runs on it (made on first use,
    /// then shared; each stage's own network is joined to it by [`super::stage_network`]).
    pub(super) async fn egress_proxy(
        &self,
        hosts: &[String],
    ) -> Result<(String, String), RuntimeError> {
        let mut key = hosts.to_vec();
        key.sort();
        key.dedup();
        let mut state = self.egress.lock().await;
        if !state.network {
            self.create_egress_network().await?;
            state.network = true;
        }
        if let Some((name, token)) = state.proxies.get(&key) {
            if self.running(name).await {
                return Ok((proxy_url(name, token), name.clone()));
            }
            // It died (or was removed): made again below.
            tracing::warn!(proxy = %name, "the egress proxy is gone; starting it again");
            let _ = self.remove(name).await;
            state.proxies.remove(&key);
        }
        self.ensure_image(&self.egress_image).await?;
        let token = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let name = format!(
            "forgepool-egress-{}-{}",
            short_instance(&self.identity.instance),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        self.start_proxy(&name, &token, &key).await?;
        let url = proxy_url(&name, &token);
        state.proxies.insert(key, (name.clone(), token));
        Ok((url, name))
    }

    /// Whether a container is running. Only a clear answer counts as gone (no such container,
    /// or stopped); an engine that did not answer leaves it be.
    pub(super) async fn running(&self, name: &str) -> bool {
        match bounded(
            "inspect container",
            API_TIMEOUT,
            self.docker.inspect_container(name, None),
        )
        .await
        {
            Ok(Ok(inspected)) => inspected.state.as_ref().and_then(|s| s.running) != Some(false),
            Ok(Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            })) => false,
            _ => true,
        }
    }

    /// The labels that say which worker process owns a container or network, so that the
    /// orphan sweeps can tell a live owner from a gone one.
    pub(super) fn owner_labels(&self) -> HashMap<String, String> {
        [
            (LABEL_MANAGED, "true".to_string()),
            (LABEL_WORKER, self.identity.worker.clone()),
            (LABEL_INSTANCE, self.identity.instance.clone()),
            (LABEL_HOST, self.identity.host.clone()),
            (LABEL_PID, self.identity.pid.to_string()),
            (LABEL_CLUSTER, self.identity.cluster.clone()),
        ]
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect()
    }

    pub(super) async fn create_egress_network(&self) -> Result<(), RuntimeError> {
        self.create_internal_network(&self.egress_network(), self.owner_labels())
            .await
            .map_err(|detail| RuntimeError::CreateContainer {
                image: self.egress_image.clone(),
                detail: format!("cannot create the egress network: {detail}"),
            })
    }

    /// Starts a proxy container for one allowlist: on the default bridge (its way out) and on
    /// the egress network under its own name, hardened like a stage.
    async fn start_proxy(
        &self,
        name: &str,
        token: &str,
        hosts: &[String],
    ) -> Result<(), RuntimeError> {
        let failed = |detail: String| RuntimeError::CreateContainer {
            image: self.egress_image.clone(),
            detail: format!("cannot start the egress proxy: {detail}"),
        };
        let mut labels = self.owner_labels();
        labels.insert(LABEL_STAGE.to_string(), "egress_proxy".to_string());
        let config = Config {
            image: Some(self.egress_image.clone()),
            cmd: Some(vec!["egress-proxy".to_string()]),
            env: Some(vec![
                format!("{}={token}", crate::runtime::egress::ENV_TOKEN),
                format!("{}={}", crate::runtime::egress::ENV_ALLOW, hosts.join(",")),
            ]),
            labels: Some(labels),
            user: Some("65534:65534".to_string()),
            host_config: Some(HostConfig {
                network_mode: Some("bridge".to_string()),
                cap_drop: Some(vec!["ALL".to_string()]),
                security_opt: Some(vec!["no-new-privileges".to_string()]),
                readonly_rootfs: Some(true),
                pids_limit: Some(128),
                memory: Some(128 << 20),
                memory_swap: Some(128 << 20),
                init: Some(true),
                ..Default::default()
            }),
            ..Default::default()
        };
        let options = CreateContainerOptions {
            name: Some(name.to_string()),
            platform: String::new(),
        };
        bounded(
            "create container",
            API_TIMEOUT,
            self.docker.create_container(Some(options), config),
        )
        .await?
        .map_err(|e| failed(e.to_string()))?;
        let connect = bollard::models::NetworkConnectRequest {
            container: name.to_string(),
            endpoint_config: Some(bollard::models::EndpointSettings {
                aliases: Some(vec![name.to_string()]),
                ..Default::default()
            }),
        };
        let connected = bounded(
            "connect network",
            API_TIMEOUT,
            self.docker.connect_network(&self.egress_network(), connect),
        )
        .await;
        let started = match connected {
            Ok(Ok(())) => bounded(
                "start container",
                API_TIMEOUT,
                self.docker.start_container(name, None),
            )
            .await
            .map(|r| r.map_err(|e| e.to_string())),
            Ok(Err(e)) => Ok(Err(e.to_string())),
            Err(e) => Err(e),
        };
        let started = match started {
            Ok(Ok(())) => self
                .proxy_ready(name, "egress proxy listening")
                .await
                .map(Ok),
            other => other,
        };
        match started {
            Ok(Ok(())) => Ok(()),
            other => {
                let _ = self.remove(name).await;
                Err(match other {
                    Ok(Err(detail)) => failed(detail),
                    Err(e) => e,
                    Ok(Ok(())) => unreachable!("handled above"),
                })
            }
        }
    }

    /// Waits until a started proxy says it listens (its first line), so that no stage finds
    /// its way out closed; at most [`PROXY_READY`].
    pub(super) async fn proxy_ready(&self, name: &str, ready: &str) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + PROXY_READY;
        while Instant::now() < deadline {
            let options = LogsOptions {
                stdout: true,
                stderr: true,
                tail: "all".into(),
                ..Default::default()
            };
            let read = async {
                let mut text = String::new();
                let mut stream = self.docker.logs(name, Some(options));
                while let Some(Ok(item)) = stream.next().await {
                    text.push_str(&item.to_string());
                }
                text
            };
            let text = bounded("read proxy logs", API_TIMEOUT, read).await?;
            if text.contains(ready) {
                return Ok(());
            }
            if text.contains("error:") {
                return Err(RuntimeError::CreateContainer {
                    image: self.egress_image.clone(),
                    detail: format!("the egress proxy did not start: {}", text.trim()),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(RuntimeError::Timeout {
            operation: "egress proxy start",
            seconds: PROXY_READY.as_secs(),
        })
    }

    /// Removes the egress networks of worker processes that are gone (the rule of
    /// [`super::janitor::left_behind`], as for containers): of this worker or of any process on
    /// this host. A live process's network is never touched, even under the same worker name.
    pub(super) async fn remove_orphan_networks(&self) {
        let mut filters = HashMap::new();
        filters.insert("label".to_string(), vec![format!("{LABEL_MANAGED}=true")]);
        let options = ListNetworksOptions {
            filters: Some(filters),
        };
        let Ok(Ok(networks)) = bounded(
            "list networks",
            API_TIMEOUT,
            self.docker.list_networks(Some(options)),
        )
        .await
        else {
            return;
        };
        for network in networks {
            let labels = network.labels.clone().unwrap_or_default();
            let label = |key: &str| labels.get(key).map(String::as_str).unwrap_or("");
            let gone = label(LABEL_CLUSTER) == self.identity.cluster
                && (label(LABEL_WORKER) == self.identity.worker
                    || label(LABEL_HOST) == self.identity.host)
                && super::janitor::left_behind(&self.identity, &labels);
            let stage = label(super::stage_network::LABEL_STAGE_NETWORK);
            if !gone && label(LABEL_INSTANCE) == self.identity.instance && !stage.is_empty() {
                self.sweep_stage_network(&network, stage).await;
                continue;
            }
            if !gone {
                continue;
            }
            if let Some(name) = network.name {
                let _ = bounded(
                    "remove network",
                    API_TIMEOUT,
                    self.docker.remove_network(&name),
                )
                .await;
            }
        }
    }

    /// Removes this process's egress proxies and network (at shutdown).
    pub async fn close_egress(&self) {
        let mut state = self.egress.lock().await;
        for (_, (name, _)) in state.proxies.drain() {
            let _ = self.remove(&name).await;
        }
        if let Some(relay) = state.relay.take() {
            let _ = self.remove(&relay).await;
        }
        if state.network {
            let _ = bounded(
                "remove network",
                API_TIMEOUT,
                self.docker.remove_network(&self.egress_network()),
            )
            .await;
            state.network = false;
        }
    }
}

fn proxy_url(name: &str, token: &str) -> String {
    format!(
        "http://{}:{token}@{name}:{}",
        crate::runtime::egress::PROXY_USER,
        crate::runtime::egress::PROXY_PORT
    )
}
