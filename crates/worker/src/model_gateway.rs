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
    own_folder(folder)?;
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

/// Makes the gateway's folder (mode 0755), never through a symbolic link: an existing one
/// must be a folder owned by this process's user, opened without following a link before its
/// mode is set. A link planted in the workspace root would otherwise move the gateway's
/// socket (mode 0666) into a folder of someone else's choosing.
fn own_folder(folder: &Path) -> Result<(), String> {
    use rustix::fs::{Mode, OFlags};
    let shown = folder.display();
    match rustix::fs::mkdir(folder, Mode::from_raw_mode(0o755)) {
        Ok(()) | Err(rustix::io::Errno::EXIST) => {}
        Err(e) => return Err(format!("cannot make the gateway's folder {shown}: {e}")),
    }
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let opened = rustix::fs::open(folder, flags, Mode::empty()).map_err(|e| {
        format!("the gateway's folder {shown} is not a folder of its own (a symbolic link, or a file): {e}; remove it")
    })?;
    let owner = rustix::fs::fstat(&opened)
        .map_err(|e| format!("the gateway's folder {shown}: {e}"))?
        .st_uid;
    let me = rustix::process::geteuid().as_raw();
    if owner != me {
        return Err(format!(
            "the gateway's folder {shown} belongs to user {owner}, not to this worker's ({me}); remove it"
        ));
    }
    rustix::fs::fchmod(&opened, Mode::from_raw_mode(0o755))
        .map_err(|e| format!("the gateway's folder {shown}: {e}"))
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

#[cfg(test)]
mod tests {
    /// Catches: a gateway folder followed through a symbolic link planted in the workspace
    /// root (its target made 0755 and given a 0666 socket).
    #[test]
    fn the_gateway_folder_is_never_a_link() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("elsewhere");
        std::fs::create_dir(&target).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).unwrap();
        let folder = super::folder(root.path());
        std::os::unix::fs::symlink(&target, &folder).unwrap();
        let refused = super::own_folder(&folder).unwrap_err();
        assert!(refused.contains("symbolic link"), "{refused}");
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "the link's target was changed");
        std::fs::remove_file(&folder).unwrap();
        super::own_folder(&folder).unwrap();
        let mode = std::fs::metadata(&folder).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o755);
    }
}
