//! The jobs a worker will not run at all, whatever their signature: a profile asking for what
//! the operator did not allow, a repository URL of a scheme not allowed, or one naming the
//! worker's own folders.

use super::*;

impl<R: ContainerRuntime> Engine<R> {
    /// Why this worker will not run the job at all, if it will not: a profile asks for what the
    /// operator did not allow, the repository URL's scheme is not allowed, or it names one of
    /// the worker's own folders.
    pub(super) fn refusal(&self, job: &Job) -> Option<String> {
        let profiles = [
            Some(&job.implementer),
            job.reviewer.as_ref(),
            job.final_reviewer.as_ref(),
        ];
        for profile in profiles.into_iter().flatten() {
            if profile.network == Network::Bridge && !self.config.allow_bridge {
                return Some(format!(
                    "the profile `{}` asks for network = \"bridge\" (unrestricted network), which this worker's operator has not allowed (FORGEPOOL_ALLOW_BRIDGE_NETWORK=true)",
                    profile.name
                ));
            }
            if let Err(error) = profile.check() {
                return Some(error);
            }
        }
        if let Err(e) = proto::names::check_url(&job.repository.url, &git::allowed_schemes()) {
            return Some(format!("repository.url {e}"));
        }
        self.own_folder(&job.repository.url)
    }

    /// Why a local repository URL is refused: it names a folder under this worker's
    /// workspaces or repository cache (another run's work, or a mirror of another, private
    /// repository), whatever the allowed schemes say. Judged on the resolved path.
    fn own_folder(&self, url: &str) -> Option<String> {
        if proto::names::url_scheme(url) != "file" {
            return None;
        }
        let path = Path::new(url.strip_prefix("file://").unwrap_or(url));
        let resolved = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
        let cache = self.config.cache.as_ref().map(|c| c.dir().to_path_buf());
        let own = [Some(self.config.workspace_root.clone()), cache];
        own.into_iter().flatten().find_map(|folder| {
            let folder = std::fs::canonicalize(&folder).unwrap_or(folder);
            resolved.starts_with(&folder).then(|| {
                format!(
                    "repository.url names a folder of this worker ({}), which no run may read",
                    folder.display()
                )
            })
        })
    }
}
