//! Cached checkouts: the read-only lower layer of layered workspaces ([`crate::workspace::overlay`]).
//!
//! A mirror's checkouts live in `{mirror}.trees/{commit}-{uid}-{gid}/`: `files/`, the commit
//! checked out and owned by the stage user (so a stage can change a file through the overlay,
//! which copies it up), and `index`, git's index of `files/`. A layered folder shows the same
//! inodes, sizes and times, so git's stat check matches every unchanged file and never
//! re-hashes it. A checkout is made once per commit, under the mirror's lock, by git running
//! as the stage user (no ownership walk), in a temporary folder renamed into place when
//! complete, and is never written again.
//!
//! A run holds a shared lock on `{commit}-{uid}-{gid}.lock` for as long as its overlays use the
//! checkout; removing one takes that lock exclusively, so a checkout in use is never removed.
//! A mirror keeps its [`KEPT_TREES`] most recently used checkouts, and evicting a mirror
//! removes its checkouts no run holds.
//!
//! When the worker is root, git runs as the stage user through `setpriv` with
//! `CAP_DAC_READ_SEARCH` alone, so it reaches a cache under a closed work folder; when neither
//! works, the worker checks out and walks the files once to hand them over. The cached index is
//! refreshed once after the checkout (1.3 s less per warm run on 50,000 files), dated two seconds
//! ahead so that git's racy-entry rule does not make it wait for the second to turn: safe only
//! because the checkout's files are never written again. A run's own index is a copy dated when
//! made, so the rule still guards every file a stage can write. Checkouts under 5,000 entries
//! skip the refresh.
//!
//! `BaseTree::lay_work_tree` mounts the run's work tree and gives the run's git folder the
//! checkout's index. `BaseTree::lay_copy` makes a reviewer's or verifier's copy of a candidate:
//! an overlay of the base, where `git read-tree --reset -u` with a copy of the index writes only
//! the changed files (`core.checkStat=minimal`, since the overlay does not keep every stat field
//! the index recorded). A copy that cannot be laid or linked says why; a work tree on another
//! file system is not linked, and checking out instead is no fault.

use super::*;
use crate::workspace::overlay;

/// The checkouts kept per repository (the most recently used ones).
pub const KEPT_TREES: usize = 2;

/// A cached checkout of a run's base commit, held (shared) until dropped.
#[derive(Debug)]
pub struct BaseTree {
    /// The checked-out files: an overlay's lower layer, never written.
    pub files: PathBuf,
    /// git's index of `files`.
    pub index: PathBuf,
    /// The commit checked out.
    pub commit: String,
    /// Who owns the files (the stage user).
    pub owner: (u32, u32),
    _lock: FileLock,
}

/// The folder of a mirror's checkouts.
pub(super) fn trees_dir(mirror: &Path) -> PathBuf {
    mirror.with_extension("trees")
}

impl RepoCache {
    /// The checkout of `fetched.commit` owned by `owner`, made when missing. Called while the
    /// mirror's lock is held (so no other run makes or removes a checkout of it meanwhile).
    pub(super) async fn base_tree(
        &self,
        fetched: &Fetched,
        owner: (u32, u32),
    ) -> Result<BaseTree, GitError> {
        let trees = trees_dir(&fetched.mirror);
        let name = format!("{}-{}-{}", fetched.commit, owner.0, owner.1);
        let dir = trees.join(&name);
        let lock_file = trees.join(format!("{name}.lock"));
        if dir.join("index").is_file() && !intact(&fetched.mirror, &dir).await {
            // Changed behind forgepool's back (only a host process can): made again, so a
            // run never starts from content the remote does not have.
            warn!(checkout = %dir.display(), "a cached checkout differs from its commit; making it again");
            let Ok(lock) = FileLock::exclusive(&lock_file, Duration::ZERO).await else {
                return Err(GitError::Refused(
                    "a cached checkout differs from its commit and another run holds it".into(),
                ));
            };
            let _ = tokio::fs::remove_dir_all(&dir).await;
            drop(lock);
        }
        if !dir.join("index").is_file() {
            let began = Instant::now();
            build(&fetched.mirror, &fetched.commit, &dir, owner).await?;
            info!(
                seconds = began.elapsed().as_secs_f64(),
                "base checkout made in the cache"
            );
        }
        let lock = FileLock::shared(&lock_file, GIT_TIMEOUT).await?;
        let _ = touch(&lock_file).await;
        prune(&trees, KEPT_TREES).await;
        Ok(BaseTree {
            files: dir.join("files"),
            index: dir.join("index"),
            commit: fetched.commit.clone(),
            owner,
            _lock: lock,
        })
    }
}

impl BaseTree {
    /// Makes the run's work tree an overlay of this checkout and gives the run's git folder
    /// (made from the mirror with no checkout) the checkout's index, HEAD detached at the
    /// commit and `base`: the work tree is ready without writing a file.
    pub async fn lay_work_tree(&self, repo: &Repo) -> Result<(), GitError> {
        self.mount(&repo.work_tree).await?;
        tokio::fs::copy(&self.index, repo.git_dir.join("index"))
            .await
            .map_err(GitError::Files)?;
        repo.git(&["update-ref", "--no-deref", "HEAD", &self.commit])
            .await?;
        repo.git(&["branch", "--force", "base", &self.commit])
            .await?;
        git::exclude_forge(repo).await
    }

    /// A copy of `commit` at `dest`: an overlay of this checkout (the base) with the files
    /// `commit` changes written by git, and the stages' git folder beside it
    /// ([`overlay::stage_git`]) with `commit` checked out as `forgepool-candidate` and `base` as
    /// a branch.
    pub async fn lay_copy(&self, repo: &Repo, commit: &str, dest: &Path) -> Result<(), GitError> {
        self.mount(dest).await?;
        let layer = overlay::layer_dir(dest);
        let index = layer.join("index");
        tokio::fs::copy(&self.index, &index)
            .await
            .map_err(GitError::Files)?;
        let (git_dir, work_tree) = (
            format!("--git-dir={}", repo.git_dir.display()),
            format!("--work-tree={}", dest.display()),
        );
        let index_text = index.to_string_lossy();
        git::git_with_env(
            &layer,
            &[
                // The index is the cached checkout's, whose stat data an overlay does not
                // keep whole (and a small checkout's index is never refreshed): a two-tree
                // merge (`-m`) refused every path the candidate changes as "not uptodate".
                // `--reset` makes the copy the candidate whatever the index says; the files
                // are the cache's, which nobody writes. Only what a checkout keeps is compared,
                // so the untouched files stay as they are.
                "-c",
                "core.checkStat=minimal",
                "-c",
                "core.trustctime=false",
                &git_dir,
                &work_tree,
                "read-tree",
                "--reset",
                "-u",
                commit,
            ],
            &[("GIT_INDEX_FILE", &index_text)],
        )
        .await?;
        let (from, stage_git) = (repo.git_dir.clone(), layer.join("git"));
        let (moved, mount_point) = (index.clone(), dest.join(".git"));
        tokio::task::spawn_blocking(move || {
            git::disposable_git(&from, &stage_git, "")?;
            std::fs::rename(&moved, stage_git.join("index"))?;
            std::fs::create_dir_all(&mount_point)
        })
        .await
        .map_err(|e| GitError::Files(std::io::Error::other(e)))?
        .map_err(GitError::Files)?;
        let stage_git = format!("--git-dir={}", layer.join("git").display());
        git::git(
            &layer,
            &[
                &stage_git,
                "update-ref",
                "refs/heads/forgepool-candidate",
                commit,
            ],
        )
        .await?;
        git::git(
            &layer,
            &[
                &stage_git,
                "symbolic-ref",
                "HEAD",
                "refs/heads/forgepool-candidate",
            ],
        )
        .await?;
        git::git(
            &layer,
            &[&stage_git, "branch", "--force", "base", &self.commit],
        )
        .await?;
        Ok(())
    }

    async fn mount(&self, target: &Path) -> Result<(), GitError> {
        let (files, target, owner) = (self.files.clone(), target.to_path_buf(), self.owner);
        tokio::task::spawn_blocking(move || overlay::mount(&files, &target, owner))
            .await
            .map_err(|e| GitError::Files(std::io::Error::other(e)))?
            .map_err(GitError::Files)
    }
}

/// Whether the checkout in `dir` still is its commit: no file changed or removed (the files
/// against their index, stat data first, as git's status does) and none added (a walk for
/// files the index does not record). Both compare with the index only: the mirror's HEAD is
/// not the checkout's commit.
async fn intact(mirror: &Path, dir: &Path) -> bool {
    let index = dir.join("index").to_string_lossy().into_owned();
    let (git_dir, work_tree) = (
        format!("--git-dir={}", mirror.display()),
        format!("--work-tree={}", dir.join("files").display()),
    );
    let env = [("GIT_INDEX_FILE", index.as_str())];
    let common = ["--no-optional-locks", git_dir.as_str(), work_tree.as_str()];
    let changed = [&common[..], &["diff-files", "--name-only"]].concat();
    let added = [&common[..], &["ls-files", "--others", "--directory"]].concat();
    for args in [changed, added] {
        match git::git_with_env(dir, &args, &env).await {
            Ok(listed) if listed.is_empty() => {}
            _ => return false,
        }
    }
    true
}

/// Checks `commit` of `mirror` out into `dir` (`files/` and `index`) owned by `owner`: by
/// git running as `owner` when it can reach the folders, else by git running as the worker
/// and one ownership walk (the checkout is made once per commit either way).
async fn build(mirror: &Path, commit: &str, dir: &Path, owner: (u32, u32)) -> Result<(), GitError> {
    match check_out(mirror, commit, dir, owner, true).await {
        Ok(()) => Ok(()),
        Err(error) => {
            info!(%error, "the stage user cannot reach the cache; checking out as the worker");
            check_out(mirror, commit, dir, owner, false).await
        }
    }
}

async fn check_out(
    mirror: &Path,
    commit: &str,
    dir: &Path,
    owner: (u32, u32),
    as_owner: bool,
) -> Result<(), GitError> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let temporary = dir.with_file_name(format!(".new-{name}"));
    let _ = tokio::fs::remove_dir_all(&temporary).await;
    let files = temporary.join("files");
    let made = {
        let (temporary, files) = (temporary.clone(), files.clone());
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&files)?;
            std::os::unix::fs::chown(&temporary, Some(owner.0), Some(owner.1))?;
            std::os::unix::fs::chown(&files, Some(owner.0), Some(owner.1))
        })
    };
    blocking(made.await)?;
    let index = temporary.join("index").to_string_lossy().into_owned();
    let env = [("GIT_INDEX_FILE", index.as_str())];
    let (git_dir, work_tree) = (
        format!("--git-dir={}", mirror.display()),
        format!("--work-tree={}", files.display()),
    );
    let place = if as_owner { &files } else { &temporary };
    let user = as_owner.then_some(owner);
    let checkout = [
        git_dir.as_str(),
        &work_tree,
        "read-tree",
        "--reset",
        "-u",
        commit,
    ];
    git_by(place, &checkout, &env, user).await?;
    if !as_owner {
        let files = files.clone();
        blocking(tokio::task::spawn_blocking(move || own_all(&files, owner)).await)?;
    }
    // git's parallel checkout leaves entries that every later status re-checks by content
    // (measured: 1.3 s more per warm run on 50,000 files) until one refresh records them. A
    // small checkout is re-checked faster than the refresh.
    // Files checked out as the worker and then given to the stage user changed owner and
    // inode change time after the index recorded them: without a refresh every path of every
    // later copy reads as changed (`read-tree -m` refused them as "not uptodate").
    let entries = tokio::fs::metadata(&index).await.map_or(0, |m| m.len());
    if entries >= SMALL_INDEX_BYTES || !as_owner {
        refresh(place, &git_dir, &work_tree, &env, user).await?;
    }
    // Read in place by `intact` at every later use: dated ahead so it re-hashes nothing.
    date_ahead(&index).await?;
    // Its size is recorded once, so eviction never walks 50,000 files to weigh it.
    let (measured, record) = (files.clone(), size_file(dir));
    let bytes = tokio::task::spawn_blocking(move || super::size_of(&measured))
        .await
        .unwrap_or(0);
    let _ = tokio::fs::remove_dir_all(dir).await;
    tokio::fs::rename(&temporary, dir)
        .await
        .map_err(GitError::Files)?;
    tokio::fs::write(record, bytes.to_string())
        .await
        .map_err(GitError::Files)
}

/// Where a checkout's size is recorded.
fn size_file(dir: &Path) -> PathBuf {
    dir.with_extension("size")
}

/// The recorded sizes of a mirror's checkouts.
pub(super) fn recorded_size(trees: &Path) -> u64 {
    checkouts_by_use(trees)
        .iter()
        .filter_map(|(dir, _)| std::fs::read_to_string(size_file(dir)).ok())
        .filter_map(|text| text.trim().parse::<u64>().ok())
        .sum()
}

/// Checkout folders of the cache `dir` whose mirror is gone.
pub(super) fn orphans(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|e| e == "trees"))
        .filter(|path| !path.with_extension("git").exists())
        .collect()
}

/// The size of an index (about 5,000 entries) under which a checkout is not refreshed.
const SMALL_INDEX_BYTES: u64 = 512 * 1024;

async fn refresh(
    place: &Path,
    git_dir: &str,
    work_tree: &str,
    env: &[(&str, &str)],
    user: Option<(u32, u32)>,
) -> Result<(), GitError> {
    // The index is dated two seconds ahead before the refresh reads it, so no entry counts
    // as racily clean and nothing waits for the second to turn. That is safe here, and only
    // here: the checkout's files are never written again (a stage's change is a copy in an
    // upper layer, with a new ctime). A run's own index is a copy dated when it is made, so
    // git's racy-entry rule still guards every file a stage can write.
    date_ahead(env[0].1).await?;
    let refresh = [git_dir, work_tree, "update-index", "-q", "--refresh"];
    git_by(place, &refresh, env, user).await?;
    Ok(())
}

/// Dates the index file `index` two seconds ahead (see [`refresh`]).
async fn date_ahead(index: &str) -> Result<(), GitError> {
    let index = PathBuf::from(index);
    let ahead = tokio::task::spawn_blocking(move || {
        std::fs::File::options()
            .write(true)
            .open(&index)?
            .set_modified(SystemTime::now() + Duration::from_secs(2))
    });
    blocking(ahead.await)
}

async fn git_by(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    user: Option<(u32, u32)>,
) -> Result<String, GitError> {
    match user {
        Some(user) => git::git_as(dir, args, env, user).await,
        None => git::git_with_env(dir, args, env).await,
    }
}

fn blocking(outcome: Result<std::io::Result<()>, tokio::task::JoinError>) -> Result<(), GitError> {
    outcome
        .map_err(|e| GitError::Files(std::io::Error::other(e)))?
        .map_err(GitError::Files)
}

/// Gives `owner` everything under `dir` (a checkout git just wrote: nothing in it is linked).
fn own_all(dir: &Path, owner: (u32, u32)) -> std::io::Result<()> {
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        let metadata = std::fs::symlink_metadata(&path)?;
        std::os::unix::fs::lchown(&path, Some(owner.0), Some(owner.1))?;
        if metadata.is_dir() {
            for entry in std::fs::read_dir(&path)? {
                pending.push(entry?.path());
            }
        }
    }
    Ok(())
}

/// Removes a mirror's checkouts beyond the `keep` most recently used, skipping those a run
/// holds.
pub(super) async fn prune(trees: &Path, keep: usize) {
    // A checkout is made under its mirror's lock, which every caller holds: a half-made one
    // (`.new-*`) is a leftover of a failed or interrupted build.
    if let Ok(mut entries) = tokio::fs::read_dir(trees).await {
        while let Ok(Some(entry)) = entries.next_entry().await {
            if entry.file_name().to_string_lossy().starts_with(".new-") {
                let _ = tokio::fs::remove_dir_all(entry.path()).await;
            }
        }
    }
    let trees = trees.to_path_buf();
    let listed = tokio::task::spawn_blocking(move || checkouts_by_use(&trees))
        .await
        .unwrap_or_default();
    for (dir, lock_file) in listed.into_iter().skip(keep) {
        let Ok(lock) = FileLock::exclusive(&lock_file, Duration::ZERO).await else {
            continue;
        };
        info!(checkout = %dir.display(), "removing a cached checkout");
        let _ = tokio::fs::remove_dir_all(&dir).await;
        let _ = tokio::fs::remove_file(size_file(&dir)).await;
        let _ = tokio::fs::remove_file(&lock_file).await;
        drop(lock);
    }
}

/// A mirror's checkouts and their lock files, most recently used first.
fn checkouts_by_use(trees: &Path) -> Vec<(PathBuf, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(trees) else {
        return Vec::new();
    };
    let mut found: Vec<(SystemTime, PathBuf, PathBuf)> = entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.is_dir()
                && !path
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .map(|dir| {
            let lock_file = dir.with_extension("lock");
            let used = std::fs::metadata(&lock_file)
                .and_then(|m| m.modified())
                .unwrap_or(SystemTime::UNIX_EPOCH);
            (used, dir, lock_file)
        })
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    found
        .into_iter()
        .map(|(_, dir, lock)| (dir, lock))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests::{origin, repo_in, sh};
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    const STAGE_USER: (u32, u32) = (65_534, 65_534);

    fn root_required() {
        assert!(
            rustix::process::geteuid().is_root(),
            "layered workspaces mount overlays: run the tests as root (.ci/run does)"
        );
    }

    /// Catches: a layered work tree whose snapshot differs from a checked-out one (the
    /// delivered commit and the guard's tree hashes must not depend on layers), a change that
    /// reaches the cached checkout, a deletion git does not see through the overlay, a
    /// checkout made as root and walked (a closed work folder), and a warm run that checks the
    /// commit out again.
    #[tokio::test]
    async fn a_layered_work_tree_is_the_same_as_a_checked_out_one() {
        root_required();
        let dir = tempfile::tempdir().unwrap();
        // Root's alone, as a worker's work folder is by default.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let (url, _) = origin(dir.path(), "shop", 30);
        let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
        let (layered, direct) = (repo_in(dir.path(), "a"), repo_in(dir.path(), "b"));
        let (base, tree) = cache
            .clone_layered(&url, Some("main"), &layered, Some(STAGE_USER))
            .await
            .unwrap();
        let tree = tree.expect("a cached checkout");
        assert_eq!(
            base,
            git::clone_at(&url, Some("main"), &direct).await.unwrap()
        );
        assert!(
            overlay::upper_of(&layered.work_tree).is_some(),
            "the work tree is layered"
        );
        assert_eq!(
            std::fs::metadata(tree.files.join("f3.txt")).unwrap().uid(),
            STAGE_USER.0,
            "the checkout is the stage user's from the start"
        );
        // Under a folder only root may open, git still ran as the stage user (its index is
        // that user's), not as root followed by an ownership walk and a refresh of every file
        // (+0.9 s on 50,000 files).
        assert_eq!(
            std::fs::metadata(&tree.index).unwrap().uid(),
            STAGE_USER.0,
            "git wrote the checkout as the stage user"
        );
        assert_eq!(
            git::snapshot_tree(&layered).await.unwrap(),
            git::snapshot_tree(&direct).await.unwrap()
        );
        for repo in [&layered, &direct] {
            std::fs::write(repo.work_tree.join("f3.txt"), "changed\n").unwrap();
            std::fs::write(repo.work_tree.join("new.txt"), "new\n").unwrap();
            std::fs::remove_file(repo.work_tree.join("f5.txt")).unwrap();
        }
        let snapshot = git::snapshot_tree(&layered).await.unwrap();
        assert_eq!(
            snapshot,
            git::snapshot_tree(&direct).await.unwrap(),
            "the same tree hash"
        );
        let changed = layered
            .git(&["diff-index", "--cached", "--name-status", "base"])
            .await
            .unwrap();
        assert_eq!(changed, "M\tf3.txt\nD\tf5.txt\nA\tnew.txt");
        assert_ne!(
            std::fs::read_to_string(tree.files.join("f3.txt")).unwrap(),
            "changed\n"
        );
        assert!(tree.files.join("f5.txt").is_file() && !tree.files.join("new.txt").exists());
        let built = std::fs::metadata(&tree.files).unwrap().ino();
        drop(tree);
        crate::workspace::cache::unlay(&layered.work_tree).await;
        let again = repo_in(dir.path(), "c");
        let (_, warm) = cache
            .clone_layered(&url, Some("main"), &again, Some(STAGE_USER))
            .await
            .unwrap();
        assert_eq!(
            std::fs::metadata(&warm.unwrap().files).unwrap().ino(),
            built,
            "reused, not checked out again"
        );
        crate::workspace::cache::unlay(&again.work_tree).await;
    }

    /// Catches: a reviewer's or verifier's layered copy that is not exactly the candidate
    /// (a change, an addition or a deletion missing), or whose git folder does not show the
    /// change as `base...HEAD`.
    #[tokio::test]
    async fn a_layered_copy_is_exactly_the_candidate() {
        root_required();
        let dir = tempfile::tempdir().unwrap();
        let (url, _) = origin(dir.path(), "shop", 30);
        let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
        let repo = repo_in(dir.path(), "a");
        let (base, tree) = cache
            .clone_layered(&url, Some("main"), &repo, Some(STAGE_USER))
            .await
            .unwrap();
        let tree = tree.unwrap();
        std::fs::write(repo.work_tree.join("f3.txt"), "changed\n").unwrap();
        std::fs::create_dir_all(repo.work_tree.join("deep/er")).unwrap();
        std::fs::write(repo.work_tree.join("deep/er/new.txt"), "new\n").unwrap();
        std::fs::remove_file(repo.work_tree.join("f5.txt")).unwrap();
        let snapshot = git::snapshot_tree(&repo).await.unwrap();
        let commit = git::commit_tree(&repo, &snapshot, &base, "candidate", "1700000000 +0000")
            .await
            .unwrap();
        let copy = dir.path().join("a").join("review-1");
        tree.lay_copy(&repo, &commit, &copy).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(copy.join("f3.txt")).unwrap(),
            "changed\n"
        );
        assert_eq!(
            std::fs::read_to_string(copy.join("deep/er/new.txt")).unwrap(),
            "new\n"
        );
        assert!(!copy.join("f5.txt").exists());
        let stage_git = overlay::stage_git(&copy).expect("the stages' git folder beside the copy");
        let git_dir = format!("--git-dir={}", stage_git.display());
        let work_tree = format!("--work-tree={}", copy.display());
        assert_eq!(
            sh(&copy, &[&git_dir, &work_tree, "status", "--porcelain"]),
            "",
            "the copy is the candidate, as its index says"
        );
        assert_eq!(sh(&copy, &[&git_dir, "rev-parse", "HEAD^{tree}"]), snapshot);
        assert_eq!(
            sh(&copy, &[&git_dir, "diff", "--name-only", "base...HEAD"]),
            "deep/er/new.txt\nf3.txt\nf5.txt"
        );
        crate::workspace::cache::unlay(&copy).await;
        crate::workspace::cache::unlay(&repo.work_tree).await;
    }

    /// Catches: a checkout removed while a run's overlay still uses it, and checkouts that
    /// pile up without bound.
    #[tokio::test]
    async fn a_checkout_in_use_is_kept_and_old_ones_are_pruned() {
        root_required();
        let dir = tempfile::tempdir().unwrap();
        let (url, seed) = origin(dir.path(), "shop", 3);
        let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
        let first_repo = repo_in(dir.path(), "r0");
        let (_, held) = cache
            .clone_layered(&url, Some("main"), &first_repo, Some(STAGE_USER))
            .await
            .unwrap();
        let held = held.unwrap();
        let bare = url.trim_start_matches("file://").to_string();
        for n in 1..=KEPT_TREES + 1 {
            std::fs::write(seed.join(format!("more{n}.txt")), "more\n").unwrap();
            sh(&seed, &["add", "-A"]);
            sh(&seed, &["commit", "--quiet", "-m", "more"]);
            sh(&seed, &["push", "--quiet", &bare, "HEAD:main"]);
            let repo = repo_in(dir.path(), &format!("r{n}"));
            let (_, tree) = cache
                .clone_layered(&url, Some("main"), &repo, Some(STAGE_USER))
                .await
                .unwrap();
            drop(tree);
            crate::workspace::cache::unlay(&repo.work_tree).await;
        }
        let trees = trees_dir(&cache.mirror_of(&url, Some("main")));
        let kept = checkouts_by_use(&trees);
        assert!(
            held.files.join("f1.txt").is_file(),
            "the held checkout is still there"
        );
        assert_eq!(
            kept.len(),
            KEPT_TREES + 1,
            "the kept ones and the held one: {kept:?}"
        );
        crate::workspace::cache::unlay(&first_repo.work_tree).await;
        drop(held);
        prune(&trees, KEPT_TREES).await;
        assert_eq!(checkouts_by_use(&trees).len(), KEPT_TREES);
    }

    /// Catches: a checkout whose mirror was evicted while a run held it, left on disk for
    /// ever (nothing lists it again), and checkouts weighed by walking their files instead
    /// of their recorded size.
    #[tokio::test]
    async fn an_evicted_mirrors_held_checkout_goes_once_released() {
        root_required();
        let dir = tempfile::tempdir().unwrap();
        let (url, _) = origin(dir.path(), "shop", 10);
        let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
        let repo = repo_in(dir.path(), "a");
        let (_, held) = cache
            .clone_layered(&url, Some("main"), &repo, Some(STAGE_USER))
            .await
            .unwrap();
        let held = held.unwrap();
        let mirror = cache.mirror_of(&url, Some("main"));
        let trees = trees_dir(&mirror);
        assert_eq!(recorded_size(&trees), super::super::size_of(&held.files));
        assert!(recorded_size(&trees) > 0);
        remove_mirror(&mirror).await;
        assert!(held.files.join("f1.txt").is_file(), "a held checkout stays");
        assert_eq!(orphans(cache.dir()), vec![trees.clone()]);
        crate::workspace::cache::unlay(&repo.work_tree).await;
        drop(held);
        cache.evict(Path::new("/nothing")).await;
        assert!(!trees.exists(), "the released orphan is removed");
    }

    /// Catches: a cached checkout changed behind forgepool's back (a file changed, one
    /// removed, one added) trusted by the next run, which would deliver those changes.
    #[tokio::test]
    async fn a_changed_cached_checkout_is_made_again() {
        root_required();
        // One tampering at a time, so each of the two checks has to catch its own.
        type Tampering = (&'static str, fn(&Path));
        let tamperings: [Tampering; 3] = [
            ("a changed file", |files| {
                std::fs::write(files.join("f1.txt"), "planted\n").unwrap()
            }),
            ("a removed file", |files| {
                std::fs::remove_file(files.join("f2.txt")).unwrap()
            }),
            ("an added file", |files| {
                std::fs::write(files.join("extra.txt"), "planted\n").unwrap()
            }),
        ];
        for (what, tamper) in tamperings {
            let dir = tempfile::tempdir().unwrap();
            let (url, _) = origin(dir.path(), "shop", 10);
            let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
            let first = repo_in(dir.path(), "a");
            let (_, tree) = cache
                .clone_layered(&url, Some("main"), &first, Some(STAGE_USER))
                .await
                .unwrap();
            let files = tree.unwrap().files.clone();
            crate::workspace::cache::unlay(&first.work_tree).await;
            let original = std::fs::read_to_string(files.join("f1.txt")).unwrap();
            tamper(&files);
            let again = repo_in(dir.path(), "b");
            let (_, tree) = cache
                .clone_layered(&url, Some("main"), &again, Some(STAGE_USER))
                .await
                .unwrap();
            assert!(
                tree.is_some(),
                "{what}: layered again, over a checkout made anew"
            );
            assert_eq!(
                std::fs::read_to_string(again.work_tree.join("f1.txt")).unwrap(),
                original,
                "{what}"
            );
            assert!(again.work_tree.join("f2.txt").is_file(), "{what}");
            assert!(!again.work_tree.join("extra.txt").exists(), "{what}");
            crate::workspace::cache::unlay(&again.work_tree).await;
        }
    }
}
