//! The Docker implementation of [`ContainerRuntime`], through the Docker Engine API (bollard).
//!
//! Every container gets the SPEC 6 hardening: all capabilities dropped, `no-new-privileges`,
//! pids, memory (without extra swap) and CPU limits, a non-root user chosen by the engine, a
//! time limit, and labels naming the run, stage, worker and a deadline. Every API call is
//! bounded by a timeout, and a container is removed on every path, including when the future
//! running it is dropped.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bollard::container::{
    Config, CreateContainerOptions, ListContainersOptions, LogOutput, LogsOptions,
    RemoveContainerOptions, WaitContainerOptions,
};
use bollard::image::CreateImageOptions;
use bollard::models::{HostConfig, ResourcesUlimits};
use bollard::Docker;
use futures_util::StreamExt;
use proto::LogStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::runtime::{
    redact, tail, ContainerRuntime, LogChunk, RuntimeError, StageExit, StageOutput, StageSpec,
    LABEL_CLUSTER, LABEL_DEADLINE, LABEL_HOST, LABEL_INSTANCE, LABEL_MANAGED, LABEL_PID,
    LABEL_STAGE, LABEL_WORKER, MAX_CAPTURED_STDOUT, MAX_LOG_BYTES, MAX_LOG_LINES, MAX_PARTIAL_LINE,
    TAIL_BYTES,
};

/// The limit on any single Docker API call (create, start, remove, list, inspect).
pub const API_TIMEOUT: Duration = Duration::from_secs(30);
/// The limit on pulling a missing image.
pub const PULL_TIMEOUT: Duration = Duration::from_secs(300);
/// How long an overdue container may outlive its deadline before any worker removes it.
pub const OVERDUE_GRACE: Duration = Duration::from_secs(60);
/// How long a stopped container's log stream may take to end before it is closed.
pub const LOG_DRAIN: Duration = Duration::from_secs(5);

/// Who owns the containers this runtime creates.
#[derive(Debug, Clone)]
pub struct Identity {
    /// The worker's stable identity (its host name or `FORGEPOOL_WORKER_ID`).
    pub worker: String,
    /// A fresh id for this process, so a restarted worker recognises its predecessor's leftovers.
    pub instance: String,
    /// The host name.
    pub host: String,
    /// This process's id.
    pub pid: u32,
    /// The installation the worker belongs to (its queue prefix, or `embedded`): the dead-worker
    /// sweep only ever touches containers of its own cluster.
    pub cluster: String,
}

impl Identity {
    /// An identity for this process under a worker name.
    pub fn for_worker(worker: impl Into<String>) -> Identity {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".to_string());
        Identity {
            worker: worker.into(),
            instance: uuid::Uuid::new_v4().to_string(),
            host,
            pid: std::process::id(),
            cluster: "embedded".to_string(),
        }
    }

    /// The same identity in another cluster.
    pub fn in_cluster(mut self, cluster: impl Into<String>) -> Identity {
        self.cluster = cluster.into();
        self
    }
}

/// Runs stages on a Docker engine.
#[derive(Debug)]
pub struct DockerRuntime {
    docker: Docker,
    endpoint: String,
    identity: Identity,
    present_images: Mutex<HashSet<String>>,
    /// The image egress proxies run (`FORGEPOOL_EGRESS_IMAGE`): forgepool's own.
    egress_image: String,
    /// The egress network and the proxies made so far, one per allowlist.
    egress: tokio::sync::Mutex<EgressState>,
}

/// What this runtime made for `network = "egress"` stages.
#[derive(Debug, Default)]
struct EgressState {
    network: bool,
    /// Allowlist → (proxy container name, token).
    proxies: HashMap<Vec<String>, (String, String)>,
}

/// How long a new egress proxy may take to listen.
const PROXY_READY: Duration = Duration::from_secs(15);

/// The image egress proxies run unless `FORGEPOOL_EGRESS_IMAGE` names another.
pub const DEFAULT_EGRESS_IMAGE: &str = "forgepool:dev";

impl DockerRuntime {
    /// Connects to the engine named by `DOCKER_HOST` (or the local socket) and checks it answers.
    pub async fn connect(identity: Identity) -> Result<DockerRuntime, RuntimeError> {
        let endpoint = std::env::var("DOCKER_HOST")
            .unwrap_or_else(|_| "unix:///var/run/docker.sock".to_string());
        let unreachable = |detail: String| RuntimeError::Unreachable {
            endpoint: endpoint.clone(),
            detail,
        };
        let docker =
            Docker::connect_with_local_defaults().map_err(|e| unreachable(e.to_string()))?;
        let docker = bounded(
            "negotiate API version",
            Duration::from_secs(10),
            docker.negotiate_version(),
        )
        .await?
        .map_err(|e| unreachable(e.to_string()))?;
        bounded("ping", Duration::from_secs(10), docker.ping())
            .await?
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(DockerRuntime {
            docker,
            endpoint,
            identity,
            present_images: Mutex::new(HashSet::new()),
            egress_image: DEFAULT_EGRESS_IMAGE.to_string(),
            egress: tokio::sync::Mutex::new(EgressState::default()),
        })
    }

    /// The same runtime with egress proxies running `image`.
    pub fn with_egress_image(mut self, image: impl Into<String>) -> DockerRuntime {
        self.egress_image = image.into();
        self
    }

    /// The internal network of this process's egress stages: no route out, and no address of
    /// the host on it (`inhibit_ipv4`), so its members reach each other and nothing else.
    pub fn egress_network(&self) -> String {
        format!(
            "forgepool-egress-{}",
            short_instance(&self.identity.instance)
        )
    }

    /// The proxy URL for a stage allowed `hosts`: the egress network exists and a proxy for
    /// exactly that allowlist runs on it (made on first use, then shared).
    async fn egress_proxy(&self, hosts: &[String]) -> Result<String, RuntimeError> {
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
                return Ok(proxy_url(name, token));
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
        state.proxies.insert(key, (name, token));
        Ok(url)
    }

    /// Whether a container is running. Only a clear answer counts as gone (no such container,
    /// or stopped); an engine that did not answer leaves it be.
    async fn running(&self, name: &str) -> bool {
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
    fn owner_labels(&self) -> HashMap<String, String> {
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

    async fn create_egress_network(&self) -> Result<(), RuntimeError> {
        let labels = self.owner_labels();
        let options = bollard::network::CreateNetworkOptions {
            name: self.egress_network(),
            driver: "bridge".to_string(),
            internal: true,
            check_duplicate: true,
            options: HashMap::from([(
                "com.docker.network.bridge.inhibit_ipv4".to_string(),
                "true".to_string(),
            )]),
            labels,
            ..Default::default()
        };
        match bounded(
            "create network",
            API_TIMEOUT,
            self.docker.create_network(options),
        )
        .await?
        {
            Ok(_) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 409, ..
            }) => Ok(()),
            Err(e) => Err(RuntimeError::CreateContainer {
                image: self.egress_image.clone(),
                detail: format!("cannot create the egress network: {e}"),
            }),
        }
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
                format!("{}={token}", crate::egress::ENV_TOKEN),
                format!("{}={}", crate::egress::ENV_ALLOW, hosts.join(",")),
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
            name: name.to_string(),
            platform: None,
        };
        bounded(
            "create container",
            API_TIMEOUT,
            self.docker.create_container(Some(options), config),
        )
        .await?
        .map_err(|e| failed(e.to_string()))?;
        let connect = bollard::network::ConnectNetworkOptions {
            container: name.to_string(),
            endpoint_config: bollard::models::EndpointSettings {
                aliases: Some(vec![name.to_string()]),
                ..Default::default()
            },
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
                self.docker.start_container::<String>(name, None),
            )
            .await
            .map(|r| r.map_err(|e| e.to_string())),
            Ok(Err(e)) => Ok(Err(e.to_string())),
            Err(e) => Err(e),
        };
        let started = match started {
            Ok(Ok(())) => self.proxy_ready(name).await.map(Ok),
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
    async fn proxy_ready(&self, name: &str) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + PROXY_READY;
        while Instant::now() < deadline {
            let options = LogsOptions::<String> {
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
            if text.contains("egress proxy listening") {
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

    /// Removes the egress networks of worker processes that are gone: an earlier instance of
    /// this worker, or a process on this host that no longer runs (the same rule as for
    /// containers). A live worker's network is never touched, and one in use cannot be
    /// removed anyway.
    async fn remove_orphan_networks(&self) {
        let mut filters = HashMap::new();
        filters.insert("label".to_string(), vec![format!("{LABEL_MANAGED}=true")]);
        let options = bollard::network::ListNetworksOptions { filters };
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
            let gone = label(LABEL_INSTANCE) != self.identity.instance
                && label(LABEL_CLUSTER) == self.identity.cluster
                && (label(LABEL_WORKER) == self.identity.worker
                    || (label(LABEL_HOST) == self.identity.host
                        && !process_alive(label(LABEL_PID))));
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

    /// The engine's address.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Makes sure an image is on the engine: never pulls one that is present.
    async fn ensure_image(&self, image: &str) -> Result<(), RuntimeError> {
        if self
            .present_images
            .lock()
            .map(|set| set.contains(image))
            .unwrap_or(false)
        {
            return Ok(());
        }
        let inspected = bounded(
            "inspect image",
            API_TIMEOUT,
            self.docker.inspect_image(image),
        )
        .await?;
        if inspected.is_err() {
            let options = CreateImageOptions {
                from_image: image.to_string(),
                ..Default::default()
            };
            let pull = async {
                let mut progress = self.docker.create_image(Some(options), None, None);
                while let Some(step) = progress.next().await {
                    step.map_err(|e| e.to_string())?;
                }
                Ok::<(), String>(())
            };
            bounded("pull image", PULL_TIMEOUT, pull)
                .await?
                .map_err(|detail| RuntimeError::ImageMissing {
                    image: image.to_string(),
                    detail,
                })?;
        }
        if let Ok(mut set) = self.present_images.lock() {
            set.insert(image.to_string());
        }
        Ok(())
    }

    fn forget_image(&self, image: &str) {
        if let Ok(mut set) = self.present_images.lock() {
            set.remove(image);
        }
    }

    /// The container configuration for a stage: image, command, hardening, limits and labels.
    pub fn container_config(&self, spec: &StageSpec) -> Config<String> {
        let mut labels = spec.labels.clone();
        labels.extend(self.owner_labels());
        // A container may be created while its run's repository is still being cloned, so
        // its deadline also covers the longest clone.
        let deadline = unix_now()
            + spec.timeout.as_secs()
            + OVERDUE_GRACE.as_secs()
            + crate::git::GIT_TIMEOUT.as_secs();
        labels.insert(LABEL_DEADLINE.into(), deadline.to_string());
        let binds = spec
            .mounts
            .iter()
            .map(|m| {
                format!(
                    "{}:{}:{}",
                    m.source.display(),
                    m.target,
                    if m.read_only { "ro" } else { "rw" }
                )
            })
            .collect();
        let memory = i64::try_from(spec.memory_bytes).unwrap_or(i64::MAX);
        Config {
            image: Some(spec.image.clone()),
            cmd: (!spec.command.is_empty()).then(|| spec.command.clone()),
            env: Some(spec.env.clone()),
            labels: Some(labels),
            user: spec.user.clone(),
            working_dir: spec.workdir.clone(),
            attach_stdout: Some(false),
            attach_stderr: Some(false),
            network_disabled: Some(spec.network == proto::Network::None),
            host_config: Some(HostConfig {
                binds: Some(binds),
                network_mode: Some(match spec.network {
                    proto::Network::None => "none".to_string(),
                    proto::Network::Bridge => "bridge".to_string(),
                    proto::Network::Egress => self.egress_network(),
                }),
                cap_drop: Some(vec!["ALL".to_string()]),
                security_opt: Some(vec!["no-new-privileges".to_string()]),
                pids_limit: Some(spec.pids_limit),
                memory: Some(memory),
                memory_swap: Some(memory),
                nano_cpus: Some((spec.cpus * 1e9) as i64),
                init: Some(true),
                readonly_rootfs: Some(spec.read_only_root),
                tmpfs: spec.read_only_root.then(|| {
                    HashMap::from([(
                        "/tmp".to_string(),
                        format!("rw,nosuid,nodev,size={},mode=1777", spec.disk_bytes),
                    )])
                }),
                ulimits: Some(stage_ulimits(spec)),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn remove(&self, id: &str) -> Result<(), RuntimeError> {
        let options = RemoveContainerOptions {
            force: true,
            v: true,
            ..Default::default()
        };
        match bounded(
            "remove container",
            API_TIMEOUT,
            self.docker.remove_container(id, Some(options)),
        )
        .await?
        {
            Ok(()) => Ok(()),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => Ok(()),
            // Another remover (a surviving worker's sweep) got there first.
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 409,
                message,
            }) if message.contains("already in progress") => Ok(()),
            Err(e) => Err(RuntimeError::Cleanup(format!("container {id}: {e}"))),
        }
    }

    /// Starts a created container, streams its output, and waits for it within its time limit.
    /// On a timeout or a cancellation the container is killed at once, which also ends its
    /// output stream.
    async fn drive(
        &self,
        id: &str,
        spec: &StageSpec,
        logs: mpsc::Sender<LogChunk>,
        cancel: CancellationToken,
    ) -> Result<(StageExit, String, String), RuntimeError> {
        bounded(
            "start container",
            API_TIMEOUT,
            self.docker.start_container::<String>(id, None),
        )
        .await?
        .map_err(|e| RuntimeError::StartContainer {
            name: spec.name.clone(),
            detail: e.to_string(),
        })?;
        let wait = async {
            let options = WaitContainerOptions {
                condition: "not-running",
            };
            let mut stream = self.docker.wait_container(id, Some(options));
            match stream.next().await {
                Some(Ok(response)) => Ok(response.status_code),
                Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => {
                    Ok(code)
                }
                Some(Err(e)) => Err(RuntimeError::WaitContainer {
                    name: spec.name.clone(),
                    detail: e.to_string(),
                }),
                None => Err(RuntimeError::WaitContainer {
                    name: spec.name.clone(),
                    detail: "wait stream ended".into(),
                }),
            }
        };
        let limited = async {
            let exit = tokio::select! {
                code = tokio::time::timeout(spec.timeout, wait) => match code {
                    Ok(code) => code.map(StageExit::Exited),
                    Err(_) => Ok(StageExit::TimedOut),
                },
                () = cancel.cancelled() => Ok(StageExit::Cancelled),
            };
            if !matches!(exit, Ok(StageExit::Exited(_))) {
                self.remove(id).await?;
            }
            exit
        };
        // The output is read while the container runs. Once it has stopped, each read of the
        // log stream gets LOG_DRAIN: a follow request that races the container's exit can
        // stay open for ever on some engines (Docker 20.10), and must not hold a finished
        // stage. Forwarding what was read is never cut short.
        let (stopped, stop_seen) = tokio::sync::watch::channel(false);
        let mut collected = Collected::default();
        let (exit, ()) = tokio::join!(
            async {
                let exit = limited.await;
                let _ = stopped.send(true);
                exit
            },
            collected.follow(&self.docker, id, &spec.redact, &logs, stop_seen)
        );
        let (stdout, combined) = collected.finish(&spec.redact, &logs).await;
        Ok((exit?, stdout, combined))
    }
}

impl DockerRuntime {
    /// The instances of this cluster, other than this one, that own containers on this engine.
    pub async fn other_instances(&self) -> Result<HashSet<String>, RuntimeError> {
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
    pub async fn remove_instance(&self, instance: &str) -> Result<usize, RuntimeError> {
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
            filters,
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

    /// Removes orphans and overdue containers (the same as the trait method, callable on the
    /// concrete type).
    pub async fn remove_orphans_now(&self) -> Result<usize, RuntimeError> {
        ContainerRuntime::remove_orphans(self).await
    }

    /// This process's instance id.
    pub fn instance(&self) -> &str {
        &self.identity.instance
    }
}

/// A stage container of [`DockerRuntime`], created and not started: its spec, how long its
/// creation took (a stage's duration is that plus its run, never the wait in between), and
/// the guard that removes it.
#[derive(Debug)]
pub struct CreatedStage {
    spec: StageSpec,
    creation: Duration,
    guard: RemoveOnDrop,
}

impl ContainerRuntime for DockerRuntime {
    type Created = CreatedStage;

    async fn create_stage(&self, mut spec: StageSpec) -> Result<CreatedStage, RuntimeError> {
        let began = Instant::now();
        self.ensure_image(&spec.image).await?;
        if spec.network == proto::Network::Egress {
            let url = self.egress_proxy(&spec.egress).await?;
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
        }
        let options = CreateContainerOptions {
            name: spec.name.clone(),
            platform: None,
        };
        let created = bounded(
            "create container",
            API_TIMEOUT,
            self.docker
                .create_container(Some(options), self.container_config(&spec)),
        )
        .await?
        .map_err(|e| {
            if matches!(
                e,
                bollard::errors::Error::DockerResponseServerError {
                    status_code: 404,
                    ..
                }
            ) {
                self.forget_image(&spec.image);
                RuntimeError::ImageMissing {
                    image: spec.image.clone(),
                    detail: e.to_string(),
                }
            } else {
                RuntimeError::CreateContainer {
                    image: spec.image.clone(),
                    detail: e.to_string(),
                }
            }
        })?;
        Ok(CreatedStage {
            spec,
            creation: began.elapsed(),
            guard: RemoveOnDrop {
                docker: self.docker.clone(),
                id: Some(created.id),
            },
        })
    }

    async fn run_created(
        &self,
        created: CreatedStage,
        logs: mpsc::Sender<LogChunk>,
        cancel: CancellationToken,
    ) -> Result<StageOutput, RuntimeError> {
        let began = Instant::now();
        let CreatedStage {
            spec,
            creation,
            mut guard,
        } = created;
        let id = guard.id.clone().unwrap_or_default();
        let driven = self.drive(&id, &spec, logs, cancel).await;
        let removed = self.remove(&id).await;
        guard.id = None;
        let (exit, stdout, combined) = driven?;
        removed?;
        Ok(StageOutput {
            exit,
            stdout,
            tail: tail(&combined, TAIL_BYTES).to_string(),
            duration: creation + began.elapsed(),
        })
    }

    async fn remove_orphans(&self) -> Result<usize, RuntimeError> {
        let mut filters = HashMap::new();
        filters.insert("label".to_string(), vec![format!("{LABEL_MANAGED}=true")]);
        let options = ListContainersOptions {
            all: true,
            filters,
            ..Default::default()
        };
        let containers = bounded(
            "list containers",
            API_TIMEOUT,
            self.docker.list_containers(Some(options)),
        )
        .await?
        .map_err(|e| RuntimeError::Cleanup(e.to_string()))?;
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
}

/// Removes a container in the background if the future that owns it is dropped early.
#[derive(Debug)]
struct RemoveOnDrop {
    docker: Docker,
    id: Option<String>,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let docker = self.docker.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let options = RemoveContainerOptions {
                        force: true,
                        v: true,
                        ..Default::default()
                    };
                    let _ = tokio::time::timeout(
                        API_TIMEOUT,
                        docker.remove_container(&id, Some(options)),
                    )
                    .await;
                });
            }
        }
    }
}

/// A stage's output as it is read: the captured stdout and the combined tail (both redacted),
/// and the partial lines of each stream not yet forwarded as chunks.
#[derive(Debug, Default)]
struct Collected {
    stdout: String,
    combined: String,
    pending: [String; 2],
    /// Bytes and lines forwarded as log chunks so far.
    forwarded_bytes: usize,
    forwarded_lines: usize,
    /// Bytes and lines past the caps: counted, never forwarded.
    dropped_bytes: usize,
    dropped_lines: usize,
}

impl Collected {
    /// Reads the container's output until the stream ends, forwarding whole lines.
    async fn follow(
        &mut self,
        docker: &Docker,
        id: &str,
        secrets: &[String],
        logs: &mpsc::Sender<LogChunk>,
        mut stopped: tokio::sync::watch::Receiver<bool>,
    ) {
        let options = LogsOptions::<String> {
            follow: true,
            stdout: true,
            stderr: true,
            tail: "all".into(),
            ..Default::default()
        };
        let mut stream = docker.logs(id, Some(options));
        let mut container_stopped = *stopped.borrow();
        loop {
            let item = if container_stopped {
                match tokio::time::timeout(LOG_DRAIN, stream.next()).await {
                    Ok(item) => item,
                    Err(_) => {
                        tracing::warn!(container = %id, "the log stream stayed open after the container stopped; it was closed");
                        break;
                    }
                }
            } else {
                tokio::select! {
                    item = stream.next() => item,
                    // A dropped sender means the same: the container is done.
                    _ = stopped.changed() => {
                        container_stopped = true;
                        continue;
                    }
                }
            };
            let Some(item) = item else {
                break;
            };
            let (stream_kind, bytes) = match item {
                Ok(LogOutput::StdOut { message }) => (LogStream::Stdout, message),
                Ok(LogOutput::StdErr { message }) => (LogStream::Stderr, message),
                Ok(LogOutput::Console { message }) => (LogStream::Stdout, message),
                Ok(LogOutput::StdIn { .. }) => continue,
                Err(_) => break,
            };
            let text = String::from_utf8_lossy(&bytes);
            let slot = &mut self.pending[usize::from(stream_kind == LogStream::Stderr)];
            slot.push_str(&text);
            if let Some(end) = slot.rfind('\n') {
                let lines: String = slot.drain(..=end).collect();
                self.emit(&lines, stream_kind, secrets, logs).await;
            } else if slot.len() > MAX_PARTIAL_LINE {
                // A line without end is forwarded in pieces: the buffer stays bounded. The
                // last bytes stay behind, so that a secret is never cut in two pieces that
                // redaction would each miss.
                let redacted = redact(slot, secrets);
                let keep = secrets
                    .iter()
                    .map(String::len)
                    .max()
                    .unwrap_or(1)
                    .saturating_sub(1);
                let mut cut = redacted.len().saturating_sub(keep);
                while !redacted.is_char_boundary(cut) {
                    cut -= 1;
                }
                *slot = redacted[cut..].to_string();
                let piece = redacted[..cut].to_string();
                self.emit(&piece, stream_kind, secrets, logs).await;
            }
        }
    }

    /// Forwards the partial lines left, and returns the captured stdout and combined output.
    async fn finish(
        mut self,
        secrets: &[String],
        logs: &mpsc::Sender<LogChunk>,
    ) -> (String, String) {
        for (index, rest) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            if !rest.is_empty() {
                let kind = if index == 0 {
                    LogStream::Stdout
                } else {
                    LogStream::Stderr
                };
                self.emit(&rest, kind, secrets, logs).await;
            }
        }
        if self.dropped_bytes > 0 {
            let summary = format!(
                "[forgepool: {} more bytes in {} lines of output were not stored; a stage keeps at most {} bytes and {} lines of its log]\n",
                self.dropped_bytes, self.dropped_lines, MAX_LOG_BYTES, MAX_LOG_LINES
            );
            let _ = logs
                .send(LogChunk {
                    stream: LogStream::Stderr,
                    text: summary,
                })
                .await;
        }
        (self.stdout, self.combined)
    }

    async fn emit(
        &mut self,
        text: &str,
        stream: LogStream,
        secrets: &[String],
        logs: &mpsc::Sender<LogChunk>,
    ) {
        let text = redact(text, secrets);
        if stream == LogStream::Stdout && self.stdout.len() < MAX_CAPTURED_STDOUT {
            let room = MAX_CAPTURED_STDOUT - self.stdout.len();
            self.stdout.push_str(head(&text, room));
        }
        self.combined.push_str(&text);
        if self.combined.len() > 4 * TAIL_BYTES {
            self.combined = tail(&self.combined, TAIL_BYTES).to_string();
        }
        let lines = text.matches('\n').count().max(1);
        if self.forwarded_bytes + text.len() > MAX_LOG_BYTES
            || self.forwarded_lines + lines > MAX_LOG_LINES
        {
            self.dropped_bytes += text.len();
            self.dropped_lines += lines;
            return;
        }
        self.forwarded_bytes += text.len();
        self.forwarded_lines += lines;
        // The receiver is gone only when the engine stopped listening; output is still
        // captured.
        let _ = logs.send(LogChunk { stream, text }).await;
    }
}

/// The resource limits of every stage's processes: open files, processes of the stage user,
/// the largest file it may write (its disk allowance), and no core dumps.
fn stage_ulimits(spec: &StageSpec) -> Vec<ResourcesUlimits> {
    let limit = |name: &str, value: i64| ResourcesUlimits {
        name: Some(name.to_string()),
        soft: Some(value),
        hard: Some(value),
    };
    vec![
        limit("nofile", STAGE_OPEN_FILES),
        limit("nproc", STAGE_PROCESSES),
        limit("fsize", i64::try_from(spec.disk_bytes).unwrap_or(i64::MAX)),
        limit("core", 0),
    ]
}

/// The open-files limit of a stage's processes.
const STAGE_OPEN_FILES: i64 = 4096;
/// The processes limit of the stage user (the container's pids limit is the tighter bound per
/// stage; this one counts every process of that user on the host).
const STAGE_PROCESSES: i64 = 8192;

/// The first `limit` bytes of `text` on a character boundary.
fn head(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

async fn bounded<T>(
    operation: &'static str,
    limit: Duration,
    future: impl std::future::Future<Output = T>,
) -> Result<T, RuntimeError> {
    tokio::time::timeout(limit, future)
        .await
        .map_err(|_| RuntimeError::Timeout {
            operation,
            seconds: limit.as_secs(),
        })
}

fn short_instance(instance: &str) -> String {
    instance.replace('-', "").chars().take(12).collect()
}

fn proxy_url(name: &str, token: &str) -> String {
    format!(
        "http://{}:{token}@{name}:{}",
        crate::egress::PROXY_USER,
        crate::egress::PROXY_PORT
    )
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn process_alive(pid: &str) -> bool {
    pid.parse::<u32>()
        .is_ok_and(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
}
