//! The model gateway's relay container (see [`gateway::relay`]): on this process's internal
//! egress network, with the gateway's socket folder mounted read-only. A stage whose profile
//! has a `provider` gets a network of its own ([`super::stage_network`]) which the relay joins
//! under the name stages reach it by ([`RELAY_HOST`]); nothing else of the host is on it.

use std::net::IpAddr;
use std::path::PathBuf;

use bollard::models::ContainerCreateBody as Config;
use bollard::models::{EndpointSettings, HostConfig, NetworkingConfig};
use bollard::query_parameters::CreateContainerOptions;

use super::{bounded, short_instance, DockerRuntime, API_TIMEOUT};
use crate::runtime::{RuntimeError, LABEL_STAGE};

/// The host name stages reach the gateway at.
pub const RELAY_HOST: &str = "forgepool-gateway";

/// The environment variable naming the socket the relay forwards to.
pub const ENV_SOCKET: &str = "FORGEPOOL_GATEWAY_SOCKET";

/// The root URL stages reach the gateway at.
pub fn gateway_root() -> String {
    format!("http://{RELAY_HOST}:{}", gateway::RELAY_PORT)
}

impl DockerRuntime {
    /// The same runtime, with the gateway listening in `folder` (its socket is
    /// [`gateway::SOCKET_NAME`] there).
    pub fn with_gateway(mut self, folder: PathBuf) -> DockerRuntime {
        self.gateway_folder = Some(folder);
        self
    }

    /// Makes sure the egress network and the relay on it run (made on first use); the relay's
    /// container name.
    pub(super) async fn gateway_relay(&self) -> Result<String, RuntimeError> {
        let folder = self
            .gateway_folder
            .clone()
            .ok_or_else(|| RuntimeError::CreateContainer {
                image: self.egress_image.clone(),
                detail: "this worker runs no model gateway".into(),
            })?;
        let mut state = self.egress.lock().await;
        if !state.network {
            self.create_egress_network().await?;
            state.network = true;
        }
        if let Some(name) = &state.relay {
            if self.running(name).await {
                return Ok(name.clone());
            }
            tracing::warn!(relay = %name, "the gateway's relay is gone; starting it again");
            let _ = self.remove(name).await;
            state.relay = None;
        }
        self.ensure_image(&self.egress_image).await?;
        let name = format!(
            "forgepool-gateway-{}-{}",
            short_instance(&self.identity.instance),
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        self.start_relay(&name, folder).await?;
        state.relay = Some(name.clone());
        Ok(name)
    }

    async fn start_relay(&self, name: &str, folder: PathBuf) -> Result<(), RuntimeError> {
        let failed = |detail: String| RuntimeError::CreateContainer {
            image: self.egress_image.clone(),
            detail: format!("cannot start the model gateway's relay: {detail}"),
        };
        let mut labels = self.owner_labels();
        labels.insert(LABEL_STAGE.to_string(), "gateway_relay".to_string());
        let network = self.egress_network();
        let config = Config {
            image: Some(self.egress_image.clone()),
            cmd: Some(vec!["gateway-relay".to_string()]),
            env: Some(vec![format!(
                "{ENV_SOCKET}={}/{}",
                gateway::RELAY_MOUNT,
                gateway::SOCKET_NAME
            )]),
            labels: Some(labels),
            user: Some("65534:65534".to_string()),
            host_config: Some(HostConfig {
                network_mode: Some(network.clone()),
                binds: Some(vec![format!(
                    "{}:{}:ro",
                    folder.display(),
                    gateway::RELAY_MOUNT
                )]),
                cap_drop: Some(vec!["ALL".to_string()]),
                security_opt: Some(vec!["no-new-privileges".to_string()]),
                readonly_rootfs: Some(true),
                pids_limit: Some(128),
                memory: Some(128 << 20),
                memory_swap: Some(128 << 20),
                init: Some(true),
                ..Default::default()
            }),
            networking_config: Some(NetworkingConfig {
                endpoints_config: Some(
                    [(
                        network,
                        EndpointSettings {
                            aliases: Some(vec![RELAY_HOST.to_string()]),
                            ..Default::default()
                        },
                    )]
                    .into_iter()
                    .collect(),
                ),
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
        let started = bounded(
            "start container",
            API_TIMEOUT,
            self.docker.start_container(name, None),
        )
        .await
        .and_then(|r| r.map_err(|e| failed(e.to_string())));
        let ready = match started {
            Ok(()) => self.proxy_ready(name, "gateway relay listening").await,
            Err(e) => Err(e),
        };
        if ready.is_err() {
            let _ = self.remove(name).await;
        }
        ready
    }

    /// A stage container's address on its own network, while it runs.
    pub async fn address_on_stage_network(&self, container: &str) -> Option<IpAddr> {
        let inspected = bounded(
            "inspect container",
            API_TIMEOUT,
            self.docker.inspect_container(container, None),
        )
        .await
        .ok()?
        .ok()?;
        let networks = inspected.network_settings?.networks?;
        let endpoint = networks.get(&super::stage_network::stage_network_name(container))?;
        endpoint.ip_address.as_deref()?.parse().ok()
    }
}

/// The gateway's check that a token is used from its own stage container.
#[derive(Debug)]
pub struct ContainerPeers(pub std::sync::Arc<DockerRuntime>);

impl gateway::PeerCheck for ContainerPeers {
    fn address(
        &self,
        container: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<IpAddr>> + Send + '_>> {
        let container = container.to_string();
        Box::pin(async move { self.0.address_on_stage_network(&container).await })
    }
}
