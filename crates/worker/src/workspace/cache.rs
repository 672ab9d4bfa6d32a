//! The repository cache (SPEC 14, `FORGEPOOL_CACHE_DIR`): one bare mirror per repository URL
//! and base ref, so a run fetches only what changed since the last run of its ref, and its git
//! folder is made from the mirror with hard links instead of a transfer.
//!
//! - **Only what the base ref reaches.** A mirror holds one ref's objects, never another's:
//!   a run's git folder is linked from the whole mirror, and the agent can read every object
//!   in it, so a blob that only another branch reaches (another ticket's private branch) must
//!   never be there. When the ref was rewritten (the new commit does not descend from the one
//!   fetched before), the mirror is repacked and pruned down to what the ref reaches now.
//! - **Fetched at every run's start.** The run's ref is fetched from the remote into the mirror
//!   (`refs/forgepool/want/{hash of the ref}`) and the run uses the commit that fetch named:
//!   the mirror is never trusted for content the remote does not have.
//! - **Locked per repository.** A file lock (`{mirror}.lock`, `flock`) is held from the fetch
//!   until the run's git folder is made, so two runs of one repository that start together
//!   take turns, and eviction never removes a mirror in use.
//! - **Rebuilt when damaged.** When a fetch into the mirror or the run's clone from it fails
//!   (a truncated pack, a missing object) but a direct clone of the remote works, the run uses
//!   the direct clone and the mirror is removed: the next run fetches it again from scratch.
//! - **Bounded.** After each fetch, mirrors are evicted least recently used first (the time of
//!   `{mirror}.used`) until the cache is within its size limit; locked mirrors are skipped.
//!
//! The mirrors hold only what git fetched, and forgepool's own configuration: nothing a stage
//! writes ever reaches them. A stage's copies share their object files by hard link; those
//! files are read-only and never handed to the stage user (a file with other links is not
//! chowned), so a stage cannot change them.
//!
//! A mirror is `{dir}/{sha256(url, ref)[..32]}.git`; the size limit is `FORGEPOOL_CACHE_MAX_GIB`.
//! A commit id (rather than a ref) takes the direct path: no mirror.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};
use tracing::{info, warn};

use crate::workspace::git::{self, GitError, Repo, GIT_TIMEOUT};

mod trees;

pub use trees::{BaseTree, KEPT_TREES};

/// The default limit of a worker's repository cache.
pub const DEFAULT_CACHE_BYTES: u64 = 20 * 1024 * 1024 * 1024;

/// A worker's repository cache.
#[derive(Debug, Clone)]
pub struct RepoCache {
    dir: PathBuf,
    max_bytes: u64,
}

/// A run's ref fetched into its mirror; the mirror stays locked until this is dropped.
#[derive(Debug)]
pub struct Fetched {
    /// The mirror (a bare repository).
    pub mirror: PathBuf,
    /// The commit the remote's ref named at the fetch.
    pub commit: String,
    /// Held until the run's git folder is made from the mirror.
    _lock: FileLock,
}

impl RepoCache {
    /// A cache in `dir` (made when first used), evicted down to `max_bytes`.
    pub fn new(dir: PathBuf, max_bytes: u64) -> RepoCache {
        RepoCache { dir, max_bytes }
    }

    /// The cache's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The mirror of `url` at `reference` (`None`: the remote's default branch):
    /// `{dir}/{first 32 hex digits of the SHA-256 of both}.git`.
    pub fn mirror_of(&self, url: &str, reference: Option<&str>) -> PathBuf {
        let key = format!("{url}\n{}", reference.unwrap_or("HEAD"));
        self.dir.join(format!("{}.git", &hash(&key)[..32]))
    }

    /// Fetches `reference` (the remote's default branch when `None`) of `url` into its mirror,
    /// and returns the mirror, locked, with the commit fetched.
    pub async fn fetch(&self, url: &str, reference: Option<&str>) -> Result<Fetched, GitError> {
        tokio::fs::create_dir_all(&self.dir)
            .await
            .map_err(GitError::Files)?;
        let mirror = self.mirror_of(url, reference);
        let lock = FileLock::exclusive(&lock_path(&mirror), GIT_TIMEOUT).await?;
        let began = Instant::now();
        let commit = fetch_into(&mirror, url, reference).await?;
        info!(
            seconds = began.elapsed().as_secs_f64(),
            "repository fetched into the cache"
        );
        let _ = touch(&used_path(&mirror)).await;
        self.evict(&mirror).await;
        Ok(Fetched {
            mirror,
            commit,
            _lock: lock,
        })
    }

    /// Clones `url` at `reference` into the run's repository `repo` through the cache and
    /// returns the base commit: the ref is fetched into the mirror, the run's git folder is
    /// made from it with hard links (under the mirror's lock), and the commit is checked out.
    /// A commit id takes the direct path (a remote need not serve one by id). When the cache
    /// fails, the run clones directly; a mirror that failed while the remote did not is
    /// removed, to be fetched again from scratch by the next run.
    pub async fn clone_at(
        &self,
        url: &str,
        reference: Option<&str>,
        repo: &Repo,
    ) -> Result<String, GitError> {
        Ok(self.clone_layered(url, reference, repo, None).await?.0)
    }

    /// [`RepoCache::clone_at`], with the work tree an overlay of a cached checkout of the base
    /// commit (owned by `layered`, the stage user) when `layered` is given and the checkout
    /// can be had: then the checkout is returned, held for as long as the run keeps it. When
    /// it cannot, the work tree is checked out as usual.
    pub async fn clone_layered(
        &self,
        url: &str,
        reference: Option<&str>,
        repo: &Repo,
        layered: Option<(u32, u32)>,
    ) -> Result<(String, Option<BaseTree>), GitError> {
        proto::names::check_url(url, &git::allowed_schemes())
            .map_err(|reason| GitError::Refused(format!("repository URL refused: {reason}")))?;
        if reference.is_some_and(git::looks_like_commit) {
            return Ok((git::clone_at(url, reference, repo).await?, None));
        }
        let cached = async {
            let fetched = self.fetch(url, reference).await?;
            link_from_mirror(&fetched.mirror, repo).await?;
            let base = match layered {
                Some(owner) => match self.base_tree(&fetched, owner).await {
                    Ok(base) => Some(base),
                    Err(error) => {
                        warn!(%error, "cannot make a cached checkout; checking the work tree out");
                        None
                    }
                },
                None => None,
            };
            drop(fetched._lock);
            if let Some(base) = base {
                match base.lay_work_tree(repo).await {
                    Ok(()) => return Ok::<_, GitError>((fetched.commit, Some(base))),
                    Err(error) => {
                        warn!(%error, "cannot lay the work tree over the cached checkout; checking it out");
                        unlay(&repo.work_tree).await;
                        // The checkout's index describes files the emptied work tree lacks.
                        let _ = tokio::fs::remove_file(repo.git_dir.join("index")).await;
                    }
                }
            }
            check_out_base(repo, &fetched.commit).await?;
            Ok((fetched.commit, None))
        };
        let error = match cached.await {
            Ok(cloned) => return Ok(cloned),
            Err(error) => error,
        };
        unlay(&repo.work_tree).await;
        let _ = tokio::fs::remove_dir_all(&repo.work_tree).await;
        let _ = tokio::fs::remove_dir_all(&repo.git_dir).await;
        let direct = git::clone_at(url, reference, repo).await?;
        warn!(%error, "the cached mirror failed where the remote did not; it is fetched again next time");
        let mirror = self.mirror_of(url, reference);
        // Only a mirror no run holds now: waiting long for one in use is not worth it.
        if let Ok(lock) = FileLock::exclusive(&lock_path(&mirror), Duration::from_secs(5)).await {
            remove_mirror(&mirror).await;
            drop(lock);
        }
        Ok((direct, None))
    }
}

/// Unmounts a layered folder and removes its writable layer, leaving the folder empty.
pub async fn unlay(folder: &Path) {
    let folder = folder.to_path_buf();
    let _ = tokio::task::spawn_blocking(move || {
        crate::workspace::overlay::unmount_under(&folder);
        let _ = std::fs::remove_dir_all(crate::workspace::overlay::layer_dir(&folder));
    })
    .await;
}

impl RepoCache {
    /// Evicts mirrors, least recently used first, until the cache is within its limit. The
    /// mirror `keep` (just fetched) and mirrors locked by a run are never evicted.
    async fn evict(&self, keep: &Path) {
        let dir = self.dir.clone();
        let keep = keep.to_path_buf();
        let max = self.max_bytes;
        let mirrors = tokio::task::spawn_blocking(move || mirrors_by_use(&dir))
            .await
            .unwrap_or_default();
        // Checkouts whose mirror was evicted while a run held them go once no run does.
        for orphan in trees::orphans(&self.dir) {
            trees::prune(&orphan, 0).await;
            let _ = tokio::fs::remove_dir(&orphan).await;
        }
        let mut total: u64 = mirrors.iter().map(|m| m.bytes).sum();
        for mirror in mirrors {
            if total <= max {
                break;
            }
            if mirror.path == keep {
                continue;
            }
            // A mirror a run holds is skipped: its lock cannot be had at once.
            let Ok(lock) = FileLock::exclusive(&lock_path(&mirror.path), Duration::ZERO).await
            else {
                continue;
            };
            info!(mirror = %mirror.path.display(), bytes = mirror.bytes, "evicting a cached repository");
            remove_mirror(&mirror.path).await;
            total = total.saturating_sub(mirror.bytes);
            drop(lock);
        }
    }
}

/// Fetches into `mirror` (made when missing) and returns the commit `reference` names.
async fn fetch_into(mirror: &Path, url: &str, reference: Option<&str>) -> Result<String, GitError> {
    if !mirror.join("HEAD").is_file() {
        remove_mirror(mirror).await;
        let path = mirror.to_string_lossy();
        git::git(
            mirror.parent().unwrap_or(Path::new("/")),
            &["init", "--quiet", "--bare", "--template=", &path],
        )
        .await?;
    }
    let source = reference.unwrap_or("HEAD");
    let want = format!("refs/forgepool/want/{}", &hash(source)[..16]);
    let git_dir = format!("--git-dir={}", mirror.display());
    // A branch is preferred to a tag of the same name, as `git clone --branch` does.
    let candidates = match reference {
        Some(name) if !name.starts_with("refs/") => {
            vec![format!("refs/heads/{name}"), format!("refs/tags/{name}")]
        }
        _ => vec![source.to_string()],
    };
    let before = git::git(
        mirror,
        &[
            &git_dir,
            "rev-parse",
            "--verify",
            "--quiet",
            &format!("{want}^{{commit}}"),
        ],
    )
    .await
    .ok();
    let mut fetched = Ok(String::new());
    for candidate in candidates {
        let refspec = format!("+{candidate}:{want}");
        // No automatic gc: it would go on in the background after the lock is released.
        fetched = git::git(
            mirror,
            &[
                &git_dir,
                "-c",
                "gc.auto=0",
                "-c",
                "maintenance.auto=false",
                "fetch",
                "--quiet",
                "--no-tags",
                "--no-write-fetch-head",
                "--",
                url,
                &refspec,
            ],
        )
        .await;
        if fetched.is_ok() {
            break;
        }
    }
    fetched?;
    // Housekeeping in the foreground, under the lock (nothing when under git's thresholds).
    git::git(
        mirror,
        &[
            &git_dir,
            "-c",
            "gc.autoDetach=false",
            "gc",
            "--auto",
            "--quiet",
        ],
    )
    .await?;
    let commit = git::git(
        mirror,
        &[
            &git_dir,
            "rev-parse",
            "--verify",
            &format!("{want}^{{commit}}"),
        ],
    )
    .await?;
    if let Some(before) = before.filter(|before| *before != commit) {
        prune_if_rewritten(mirror, &before, &commit).await?;
    }
    // A mirror that lost the commit's tree is caught here rather than in the run's clone.
    git::git(
        mirror,
        &[&git_dir, "cat-file", "-e", &format!("{commit}^{{tree}}")],
    )
    .await?;
    Ok(commit)
}

/// Drops from `mirror` every object its ref no longer reaches when the ref moved from `before`
/// to `now` by a rewrite (a force-push): what a rewrite removed from the branch must not stay
/// readable by the next run's agent. A fast-forward removes nothing, and costs nothing here.
async fn prune_if_rewritten(mirror: &Path, before: &str, now: &str) -> Result<(), GitError> {
    let git_dir = format!("--git-dir={}", mirror.display());
    let ancestor = git::git(
        mirror,
        &[&git_dir, "merge-base", "--is-ancestor", before, now],
    )
    .await;
    if ancestor.is_ok() {
        return Ok(());
    }
    info!("the base ref was rewritten; dropping from the mirror what it no longer reaches");
    // `-a -d` writes one pack of what the refs reach and deletes the others, unreachable
    // objects with them; `prune` removes the unreachable loose ones.
    git::git(
        mirror,
        &[&git_dir, "-c", "gc.auto=0", "repack", "-a", "-d", "-q"],
    )
    .await?;
    git::git(mirror, &[&git_dir, "prune", "--expire=now"]).await?;
    Ok(())
}

/// Makes the run's git folder from a cache mirror, with no work tree checked out yet: git's
/// local clone hard-links the mirror's object files into the run's git folder, which only
/// the worker touches.
pub async fn link_from_mirror(mirror: &Path, repo: &Repo) -> Result<(), GitError> {
    let parent = repo.work_tree.parent().unwrap_or(Path::new("/"));
    let (source, git_dir) = (mirror.to_string_lossy(), repo.git_dir.to_string_lossy());
    let work_tree = repo.work_tree.to_string_lossy();
    // The mirror's object files are linked only when a stage cannot own them.
    let links = if git::shareable(mirror) {
        "--quiet"
    } else {
        "--no-hardlinks"
    };
    git::git(
        parent,
        &[
            "-c",
            "protocol.file.allow=always",
            "clone",
            "--quiet",
            "--no-checkout",
            links,
            "--separate-git-dir",
            &git_dir,
            "--",
            &source,
            &work_tree,
        ],
    )
    .await?;
    tokio::fs::remove_file(repo.work_tree.join(".git"))
        .await
        .map_err(GitError::Files)
}

/// Checks `commit` out detached in the run's work tree and keeps it as the branch `base`.
pub async fn check_out_base(repo: &Repo, commit: &str) -> Result<(), GitError> {
    repo.git_in_tree(&["checkout", "--quiet", "--detach", commit])
        .await?;
    repo.git(&["branch", "--force", "base", commit]).await?;
    git::exclude_forge(repo).await
}

fn hash(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

fn lock_path(mirror: &Path) -> PathBuf {
    mirror.with_extension("lock")
}

fn used_path(mirror: &Path) -> PathBuf {
    mirror.with_extension("used")
}

async fn touch(path: &Path) -> std::io::Result<()> {
    let file = tokio::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .await?
        .into_std()
        .await;
    file.set_modified(SystemTime::now())
}

/// Removes a mirror and its checkouts no run holds (a held one goes with a later eviction).
async fn remove_mirror(mirror: &Path) {
    let _ = tokio::fs::remove_dir_all(mirror).await;
    let _ = tokio::fs::remove_file(used_path(mirror)).await;
    trees::prune(&trees::trees_dir(mirror), 0).await;
}

/// A mirror, its size and when a run last used it.
struct Cached {
    path: PathBuf,
    bytes: u64,
    used: SystemTime,
}

/// The mirrors in `dir`, least recently used first.
fn mirrors_by_use(dir: &Path) -> Vec<Cached> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut mirrors: Vec<Cached> = entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "git"))
        .map(|path| Cached {
            bytes: size_of(&path) + trees::recorded_size(&trees::trees_dir(&path)),
            used: std::fs::metadata(used_path(&path))
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH),
            path,
        })
        .collect();
    mirrors.sort_by_key(|m| m.used);
    mirrors
}

/// The bytes of the regular files under `dir` (symbolic links are not followed).
fn size_of(dir: &Path) -> u64 {
    let mut total = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        let Ok(metadata) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if metadata.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&path) {
                pending.extend(entries.flatten().map(|e| e.path()));
            }
        } else if metadata.is_file() {
            total += metadata.len();
        }
    }
    total
}

/// A `flock` on a file, released when dropped (the file is closed).
#[derive(Debug)]
pub(crate) struct FileLock {
    /// Held open for the lock's lifetime.
    _file: std::fs::File,
}

impl FileLock {
    /// Takes the lock on `path` (made when missing), trying for up to `limit`.
    pub(crate) async fn exclusive(path: &Path, limit: Duration) -> Result<FileLock, GitError> {
        FileLock::take(
            path,
            limit,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        )
        .await
    }

    /// Takes a shared lock on `path` (made when missing), trying for up to `limit`: many
    /// holders at once, none while an exclusive one is held.
    async fn shared(path: &Path, limit: Duration) -> Result<FileLock, GitError> {
        FileLock::take(
            path,
            limit,
            rustix::fs::FlockOperation::NonBlockingLockShared,
        )
        .await
    }

    async fn take(
        path: &Path,
        limit: Duration,
        operation: rustix::fs::FlockOperation,
    ) -> Result<FileLock, GitError> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .map_err(GitError::Files)?;
        let deadline = Instant::now() + limit;
        loop {
            match rustix::fs::flock(file.as_fd(), operation) {
                Ok(()) => return Ok(FileLock { _file: file }),
                Err(error) if Instant::now() >= deadline => {
                    return Err(GitError::Files(std::io::Error::other(format!(
                        "cannot lock {} within {limit:?}: {error}",
                        path.display()
                    ))))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests;
