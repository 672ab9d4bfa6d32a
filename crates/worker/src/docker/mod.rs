//! The Docker implementation of [`ContainerRuntime`], through the Docker Engine API (bollard).
//!
//! Every container gets the SPEC 6 hardening: all capabilities dropped, `no-new-privileges`,
//! pids, memory (without extra swap) and CPU limits, a non-root user chosen by the engine, a
//! time limit, and labels naming the run, stage, worker and a deadline. Every API call is
//! bounded by a timeout, and a container is removed on every path, including when the future
//! running it is dropped.
//!
//! `mod.rs` creates, runs and removes a stage; `config.rs` is the hardened container
//! configuration; `logs.rs` the capped, redacted output; `egress.rs` the egress proxies and their
//! network; `stage_network.rs` each stage's own network; `janitor.rs` orphans and dead instances;
//! `gateway.rs` the model gateway's relay. A
//! created container that is never run is removed when it is dropped, and its deadline label also
//! covers the longest clone. bollard appears in no other module of forgepool.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bollard::query_parameters::{
    CreateContainerOptions, CreateImageOptions, RemoveContainerOptions, WaitContainerOptions,
};
use bollard::Docker;
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

mod config;
mod egress;
mod gateway;
mod janitor;
mod logs;
mod stage_network;

use egress::EgressState;
pub use egress::DEFAULT_EGRESS_IMAGE;
pub use gateway::{gateway_root, ContainerPeers, ENV_SOCKET, RELAY_HOST};
use logs::Collected;

use crate::runtime::{
    tail, ContainerRuntime, LogChunk, RuntimeError, StageExit, StageOutput, StageSpec, TAIL_BYTES,
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
    /// The model gateway's socket folder, which its relay container mounts.
    gateway_folder: Option<std::path::PathBuf>,
}

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
            gateway_folder: None,
        })
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
                from_image: Some(image.to_string()),
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
    ) -> Result<Driven, RuntimeError> {
        bounded(
            "start container",
            API_TIMEOUT,
            self.docker.start_container(id, None),
        )
        .await?
        .map_err(|e| RuntimeError::StartContainer {
            name: spec.name.clone(),
            detail: e.to_string(),
        })?;
        let wait = async {
            let options = WaitContainerOptions {
                condition: "not-running".to_string(),
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
        let mut collected = Collected::new(spec.agent);
        let (exit, ()) = tokio::join!(
            async {
                let exit = limited.await;
                let _ = stopped.send(true);
                exit
            },
            collected.follow(&self.docker, id, &spec.redact, &logs, stop_seen)
        );
        let (stdout, combined, report) = collected.finish(&spec.redact, &logs).await;
        Ok((exit?, stdout, combined, report))
    }
}

/// What a stage's run left: how it ended, its captured stdout, its combined output, and its
/// agent's report.
type Driven = (
    StageExit,
    String,
    String,
    Option<crate::agents::AgentReport>,
);

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
        // The stage's own network, with the proxy or relay it needs on it; it goes with the
        // guard (a failure below removes it).
        let mut guard = RemoveOnDrop {
            docker: self.docker.clone(),
            id: None,
            network: None,
        };
        if spec.gateway || spec.network == proto::Network::Egress {
            let mut network = self.create_stage_network(&spec.name).await?;
            let joined = self.stage_network_members(&mut spec, &mut network).await;
            guard.network = Some(network);
            joined?;
        }
        let options = CreateContainerOptions {
            name: Some(spec.name.clone()),
            platform: String::new(),
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
        guard.id = Some(created.id);
        if let (Some(network), proto::Network::Bridge) = (&guard.network, spec.network) {
            // A `bridge` stage keeps the default bridge and reaches the relay on its own network.
            self.join_stage_network(&network.name, &spec.name, None)
                .await?;
        }
        Ok(CreatedStage {
            spec,
            creation: began.elapsed(),
            guard,
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
        if let Some(network) = guard.network.take() {
            stage_network::release(&self.docker, &network).await;
        }
        let (exit, stdout, combined, agent) = driven?;
        removed?;
        Ok(StageOutput {
            exit,
            stdout,
            tail: tail(&combined, TAIL_BYTES).to_string(),
            duration: creation + began.elapsed(),
            agent,
        })
    }

    async fn remove_orphans(&self) -> Result<usize, RuntimeError> {
        self.remove_orphans_and_overdue().await
    }

    fn instance(&self) -> &str {
        &self.identity.instance
    }

    async fn other_instances(&self) -> Result<HashSet<String>, RuntimeError> {
        self.instances_elsewhere().await
    }

    async fn remove_instance(&self, instance: &str) -> Result<usize, RuntimeError> {
        self.remove_containers_of(instance).await
    }

    async fn close(&self) {
        self.close_egress().await;
    }
}

/// Removes a container in the background if the future that owns it is dropped early.
#[derive(Debug)]
struct RemoveOnDrop {
    docker: Docker,
    id: Option<String>,
    /// The stage's own network, removed after the container.
    network: Option<stage_network::StageNetwork>,
}

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let (id, network) = (self.id.take(), self.network.take());
        if id.is_none() && network.is_none() {
            return;
        }
        let docker = self.docker.clone();
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Some(id) = id {
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
                }
                if let Some(network) = network {
                    stage_network::release(&docker, &network).await;
                }
            });
        }
    }
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
