//! Starting the worker's model gateway (SPEC 16, the `gateway` crate): its socket in the
//! worker's own folder, the keys from the worker's environment, and stage tokens checked
//! against the stage containers' addresses on the internal network.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gateway::daily::Allotter;
use gateway::{Gateway, Providers, Settings};
use telemetry::Metrics;
use tokio_util::sync::CancellationToken;

use crate::docker::{gateway_root, ContainerPeers, DockerRuntime};

/// The gateway's folder under a worker's workspace root.
pub fn folder(workspace_root: &Path) -> PathBuf {
    workspace_root.join(".gateway")
}

/// A running gateway; it stops when this is dropped.
#[derive(Debug)]
pub struct ModelGateway {
    /// The shared state the engine issues passes from.
    pub gateway: Arc<Gateway>,
    stop: CancellationToken,
}

impl Drop for ModelGateway {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The runtime with its gateway folder, and the gateway started for it (both services and
/// `forgepool run` wire it the same way).
pub fn with_gateway(
    runtime: DockerRuntime,
    workspace_root: &Path,
    metrics: Option<Arc<Metrics>>,
    allotter: Arc<dyn Allotter>,
) -> Result<(Arc<DockerRuntime>, ModelGateway), String> {
    let folder = folder(workspace_root);
    let runtime = Arc::new(runtime.with_gateway(folder.clone()));
    let gateway = start(&folder, Arc::clone(&runtime), metrics, Some(allotter))?;
    Ok((runtime, gateway))
}

/// The allotter of `forgepool run`, where one process is the whole pool: the daily budgets
/// of `job`'s profiles, kept in memory.
pub fn local_allotter(job: &proto::Job) -> Arc<dyn Allotter> {
    let profiles = [
        Some(&job.implementer),
        job.reviewer.as_ref(),
        job.final_reviewer.as_ref(),
    ];
    let limits = profiles
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p.name.clone(), p.daily_budget.clone()?)))
        .collect();
    Arc::new(gateway::daily::LocalAllotter::new(limits))
}

/// Starts the gateway for `runtime` (made [`DockerRuntime::with_gateway`] on `folder`), its
/// profiles' daily budgets allotted by `allotter`. The socket is replaced if an earlier
/// process left one; the relay (user 65534) may connect to it, nothing in a stage can reach
/// the folder.
pub fn start(
    folder: &Path,
    runtime: Arc<DockerRuntime>,
    metrics: Option<Arc<Metrics>>,
    allotter: Option<Arc<dyn Allotter>>,
) -> Result<ModelGateway, String> {
    use std::os::unix::fs::PermissionsExt;
    let providers = Providers::from_environment()?;
    std::fs::create_dir_all(folder)
        .map_err(|e| format!("cannot make the gateway's folder {}: {e}", folder.display()))?;
    let _ = std::fs::set_permissions(folder, std::fs::Permissions::from_mode(0o755));
    let socket = folder.join(gateway::SOCKET_NAME);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(|e| format!("the gateway cannot listen on {}: {e}", socket.display()))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| format!("cannot open {} to the relay: {e}", socket.display()))?;
    let gateway = Gateway::new(Settings {
        providers: Some(providers),
        keys: None,
        peers: Some(Arc::new(ContainerPeers(runtime))),
        metrics,
        root: gateway_root(),
        allotter,
    })?;
    let stop = CancellationToken::new();
    tokio::spawn(gateway::serve_unix(
        listener,
        Arc::clone(&gateway),
        stop.clone(),
    ));
    Ok(ModelGateway { gateway, stop })
}

/// `forgepool gateway-relay`, the relay container's process: listens on
/// [`gateway::RELAY_PORT`] and forwards to the socket [`crate::docker::ENV_SOCKET`] names.
pub async fn relay_from_env(shutdown: CancellationToken) -> i32 {
    let socket = match std::env::var_os(crate::docker::ENV_SOCKET) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => {
            eprintln!(
                "error: {} must name the gateway's socket",
                crate::docker::ENV_SOCKET
            );
            return 2;
        }
    };
    let listener = match tokio::net::TcpListener::bind(("0.0.0.0", gateway::RELAY_PORT)).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!(
                "error: cannot listen on port {}: {error}",
                gateway::RELAY_PORT
            );
            return 1;
        }
    };
    println!("gateway relay listening on port {}", gateway::RELAY_PORT);
    gateway::relay::relay(listener, socket, shutdown).await;
    0
}
