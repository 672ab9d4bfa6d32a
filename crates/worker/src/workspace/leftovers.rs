//! Run folders a worker process left behind when it was killed. While a process executes a
//! run it holds a `flock` on `{root}/.owners/{run_id}.lock`; a run folder whose lock can be
//! taken belongs to nobody alive (the kernel drops a killed process's locks) and is removed,
//! its layered mounts detached first. Locks work across processes, containers and PID
//! namespaces that share the folder on one machine, which process ids would not.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing::{info, warn};

use super::cache::FileLock;

/// The folder of the owners' lock files, in the workspace root.
const OWNERS: &str = ".owners";

fn lock_path(root: &Path, run: &str) -> PathBuf {
    root.join(OWNERS).join(format!("{run}.lock"))
}

/// This process's hold on a run folder: released (and its lock file removed) when dropped.
#[derive(Debug)]
pub struct Owned {
    path: PathBuf,
    _lock: FileLock,
}

impl Drop for Owned {
    fn drop(&mut self) {
        // Removed while still held, so no other process takes a lock on a file about to go.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Takes the run folder `root/run` for this process, before the folder is made; `None` (with a
/// warning) when the lock cannot be written: the run goes on, only its cleanup after a crash
/// is lost.
pub async fn own(root: &Path, run: &str) -> Option<Owned> {
    let path = lock_path(root, run);
    if let Err(error) = tokio::fs::create_dir_all(root.join(OWNERS)).await {
        warn!(%error, "cannot record the run folder's owner");
        return None;
    }
    match FileLock::exclusive(&path, Duration::from_secs(5)).await {
        Ok(lock) => Some(Owned { path, _lock: lock }),
        Err(error) => {
            warn!(%error, "cannot record the run folder's owner");
            None
        }
    }
}

/// Removes every run folder of `root` whose owner is gone; returns how many.
pub async fn remove_left_behind(root: &Path) -> usize {
    let Ok(mut entries) = tokio::fs::read_dir(root.join(OWNERS)).await else {
        return 0;
    };
    let mut removed = 0;
    while let Ok(Some(entry)) = entries.next_entry().await {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(run) = name.strip_suffix(".lock") else {
            continue;
        };
        // Only a run id names a run folder: nothing else of the root is touched.
        if uuid::Uuid::parse_str(run).is_err() {
            continue;
        }
        let Ok(orphan) = FileLock::exclusive(&entry.path(), Duration::ZERO).await else {
            continue;
        };
        match super::overlay::remove_folder(&root.join(run)).await {
            Ok(()) => {
                info!(run_id = %run, "removed the run folder a killed worker left");
                removed += 1;
                drop(Owned {
                    path: entry.path(),
                    _lock: orphan,
                });
            }
            Err(error) => warn!(%error, run_id = %run, "cannot remove a left run folder"),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a left run folder never removed (a host's disk fills with killed runs), a live
    /// process's run folder removed under it, and anything of the root that is not a run
    /// folder touched.
    #[tokio::test]
    async fn only_folders_whose_owner_is_gone_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let (live, dead) = (
            uuid::Uuid::new_v4().to_string(),
            uuid::Uuid::new_v4().to_string(),
        );
        for run in [&live, &dead] {
            std::fs::create_dir_all(root.path().join(run).join("workspace")).unwrap();
        }
        std::fs::create_dir_all(root.path().join(".cache/mirror")).unwrap();
        let held = own(root.path(), &live).await.expect("owned");
        // A killed owner: its lock file stays, nobody holds it.
        drop(own(root.path(), &dead).await.expect("owned"));
        std::fs::write(lock_path(root.path(), &dead), "").unwrap();
        std::fs::write(lock_path(root.path(), "not-a-run"), "").unwrap();

        assert_eq!(remove_left_behind(root.path()).await, 1);
        assert!(
            !root.path().join(&dead).exists(),
            "the dead owner's folder is gone"
        );
        assert!(!lock_path(root.path(), &dead).exists());
        assert!(
            root.path().join(&live).join("workspace").exists(),
            "a live run's folder stays"
        );
        assert!(root.path().join(".cache/mirror").exists());
        assert!(lock_path(root.path(), "not-a-run").exists());
        drop(held);
        assert!(!lock_path(root.path(), &live).exists(), "released on drop");
    }
}
