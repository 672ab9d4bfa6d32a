//! A stage's own network (SPEC 15, 16): every stage that reaches anything besides itself (a
//! provider stage reaches the gateway's relay, an `egress` stage its proxy) gets an internal
//! network of its own, with only itself and the containers it needs on it, so no stage can
//! open a connection to another stage, of its run or of another. The network lives as long as
//! its stage's container: it goes with the container on every path (run, failure, drop).
//!
//! Each network gets a small subnet of its own ([`STAGE_SUBNETS`], a `/28` each): Docker's
//! default address pools hold about 30 networks, far fewer than a busy host's stages. The
//! networks are internal and carry no address of the host (`inhibit_ipv4`), so the range
//! never becomes a route on the host and cannot shadow an address the host uses.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use bollard::models::{EndpointSettings, Ipam, IpamConfig, NetworkConnectRequest};
use bollard::models::{NetworkCreateRequest, NetworkDisconnectRequest};
use bollard::Docker;

use super::{bounded, DockerRuntime, API_TIMEOUT, RELAY_HOST};
use crate::runtime::{RuntimeError, StageSpec};

/// The range stage networks take their subnets from: 4,096 networks of 16 addresses.
pub const STAGE_SUBNETS: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 213, 0, 0), 16);
/// The size of each stage network's subnet.
const SUBNET_PREFIX: u8 = 28;
/// How many subnets are tried before a stage fails (another network may hold each).
const SUBNET_TRIES: usize = 32;
/// The label naming the stage container a network is for.
pub const LABEL_STAGE_NETWORK: &str = "forgepool.stage-network";

/// A stage's network and the containers of this worker joined to it (the relay, a proxy),
/// which are taken off it before it is removed.
#[derive(Debug, Clone)]
pub(super) struct StageNetwork {
    pub(super) name: String,
    pub(super) members: Vec<String>,
}

/// The network of the stage container named `container`.
pub fn stage_network_name(container: &str) -> String {
    format!("{container}-net")
}

impl DockerRuntime {
    /// Creates the network of the stage container `container`, on a free subnet of
    /// [`STAGE_SUBNETS`].
    pub(super) async fn create_stage_network(
        &self,
        container: &str,
    ) -> Result<StageNetwork, RuntimeError> {
        let name = stage_network_name(container);
        let mut labels = self.owner_labels();
        labels.insert(LABEL_STAGE_NETWORK.to_string(), container.to_string());
        self.create_internal_network(&name, labels)
            .await
            .map_err(|detail| {
                network_failed(format!("cannot make the stage's own network: {detail}"))
            })?;
        Ok(StageNetwork {
            name,
            members: Vec::new(),
        })
    }

    /// Creates an internal network without an address of the host, on a free subnet of
    /// [`STAGE_SUBNETS`]; one of that name already there counts as made.
    pub(super) async fn create_internal_network(
        &self,
        name: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), String> {
        let mut last = String::new();
        for _ in 0..SUBNET_TRIES {
            let request = NetworkCreateRequest {
                name: name.to_string(),
                driver: Some("bridge".to_string()),
                internal: Some(true),
                labels: Some(labels.clone()),
                options: Some(HashMap::from([(
                    "com.docker.network.bridge.inhibit_ipv4".to_string(),
                    "true".to_string(),
                )])),
                ipam: Some(Ipam {
                    config: Some(vec![IpamConfig {
                        subnet: Some(random_subnet()),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            };
            match bounded(
                "create network",
                API_TIMEOUT,
                self.docker.create_network(request),
            )
            .await
            .map_err(|e| e.to_string())?
            {
                Ok(_) => return Ok(()),
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 409, ..
                }) => return Ok(()),
                // Another network holds this subnet: another one is tried.
                Err(e) if e.to_string().contains("overlaps") => last = e.to_string(),
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!(
            "no free subnet in {}.{}.0.0/{} after {SUBNET_TRIES} tries ({last})",
            STAGE_SUBNETS.0.octets()[0],
            STAGE_SUBNETS.0.octets()[1],
            STAGE_SUBNETS.1
        ))
    }

    /// Joins `member` (a container of this worker, or the stage itself) to a stage network,
    /// reachable there under `alias` when one is given.
    pub(super) async fn join_stage_network(
        &self,
        network: &str,
        member: &str,
        alias: Option<&str>,
    ) -> Result<(), RuntimeError> {
        let connect = NetworkConnectRequest {
            container: member.to_string(),
            endpoint_config: Some(EndpointSettings {
                aliases: alias.map(|a| vec![a.to_string()]),
                ..Default::default()
            }),
        };
        bounded(
            "connect network",
            API_TIMEOUT,
            self.docker.connect_network(network, connect),
        )
        .await?
        .map_err(|e| {
            network_failed(format!(
                "cannot join {member} to the stage's network {network}: {e}"
            ))
        })
    }
}

impl DockerRuntime {
    /// Puts on a stage's network what the stage needs: the egress proxy of its allowlist (its
    /// address in the stage's environment, its token redacted from the output) and the
    /// gateway's relay (reached directly, never through the proxy).
    pub(super) async fn stage_network_members(
        &self,
        spec: &mut StageSpec,
        network: &mut StageNetwork,
    ) -> Result<(), RuntimeError> {
        if spec.network == proto::Network::Egress {
            let (url, proxy) = self.egress_proxy(&spec.egress).await?;
            for name in ["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"] {
                spec.env.push(format!("{name}={url}"));
            }
            if let Some(token) = url
                .split_once(':')
                .and_then(|(_, rest)| rest.rsplit_once('@'))
                .and_then(|(credentials, _)| credentials.rsplit_once(':'))
                .map(|(_, token)| token.to_string())
            {
                spec.redact.push(token);
            }
            spec.redact.push(url);
            network.members.push(proxy.clone());
            self.join_stage_network(&network.name, &proxy, Some(&proxy))
                .await?;
        }
        if spec.gateway {
            let relay = self.gateway_relay().await?;
            for name in ["NO_PROXY", "no_proxy"] {
                spec.env.push(format!("{name}={RELAY_HOST}"));
            }
            network.members.push(relay.clone());
            self.join_stage_network(&network.name, &relay, Some(RELAY_HOST))
                .await?;
        }
        Ok(())
    }
}

impl DockerRuntime {
    /// Removes a network of this process whose stage container is gone, once it is older
    /// than the longest a stage takes to be created (a network is made just before its
    /// container): a release that failed leaves nothing behind for long.
    pub(super) async fn sweep_stage_network(
        &self,
        network: &bollard::models::Network,
        stage: &str,
    ) {
        let old = network
            .created
            .as_deref()
            .and_then(|at| humantime::parse_rfc3339_weak(at.split('.').next().unwrap_or(at)).ok())
            .and_then(|at| at.elapsed().ok())
            .is_some_and(|age| age > 2 * API_TIMEOUT);
        if !old || self.exists(stage).await {
            return;
        }
        let Some(name) = network.name.clone() else {
            return;
        };
        let members = match bounded(
            "inspect network",
            API_TIMEOUT,
            self.docker.inspect_network(&name, None),
        )
        .await
        {
            Ok(Ok(inspected)) => inspected
                .containers
                .unwrap_or_default()
                .into_keys()
                .collect(),
            _ => Vec::new(),
        };
        tracing::info!(network = %name, "removed the network of a stage that is gone");
        release(&self.docker, &StageNetwork { name, members }).await;
    }
}

impl DockerRuntime {
    /// Whether a container exists; only the engine's clear "no such container" says no.
    async fn exists(&self, name: &str) -> bool {
        !matches!(
            bounded(
                "inspect container",
                API_TIMEOUT,
                self.docker.inspect_container(name, None),
            )
            .await,
            Ok(Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404,
                ..
            }))
        )
    }
}

/// Takes a stage network's members off it and removes it (its stage container is gone).
/// Best effort: what is left is swept by the janitor.
pub(super) async fn release(docker: &Docker, network: &StageNetwork) {
    for member in &network.members {
        let request = NetworkDisconnectRequest {
            container: member.clone(),
            force: Some(true),
        };
        let _ = tokio::time::timeout(
            API_TIMEOUT,
            docker.disconnect_network(&network.name, request),
        )
        .await;
    }
    let _ = tokio::time::timeout(API_TIMEOUT, docker.remove_network(&network.name)).await;
}

/// A random `/28` of [`STAGE_SUBNETS`].
fn random_subnet() -> String {
    let (base, prefix) = STAGE_SUBNETS;
    let count = 1u32 << (SUBNET_PREFIX - prefix);
    let index = rand_index(count);
    let address = u32::from(base) + (index << (32 - SUBNET_PREFIX));
    format!("{}/{SUBNET_PREFIX}", Ipv4Addr::from(address))
}

/// A random number below `count`, from a fresh UUID's bits.
fn rand_index(count: u32) -> u32 {
    (uuid::Uuid::new_v4().as_u128() % u128::from(count)) as u32
}

fn network_failed(detail: String) -> RuntimeError {
    RuntimeError::CreateContainer {
        image: String::new(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a subnet outside the range, or not aligned to its size (Docker refuses it).
    #[test]
    fn subnets_are_aligned_sixteens_of_the_range() {
        for _ in 0..1000 {
            let subnet = random_subnet();
            let (address, prefix) = subnet.split_once('/').unwrap();
            assert_eq!(prefix, "28");
            let address: Ipv4Addr = address.parse().unwrap();
            assert_eq!(address.octets()[..2], [10, 213]);
            assert_eq!(address.octets()[3] % 16, 0, "{subnet}");
        }
    }
}
