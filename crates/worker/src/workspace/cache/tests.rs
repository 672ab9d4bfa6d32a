//! The repository cache's tests, against real git repositories in temporary folders.

use super::*;

pub(super) fn sh(dir: &Path, args: &[&str]) -> String {
    let output = std::process::Command::new("git")
        .args([
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "-c",
            "protocol.file.allow=always",
        ])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("git runs");
    assert!(
        output.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// A bare origin with `main` at a commit of `files` files; returns its `file://` URL.
pub(super) fn origin(dir: &Path, name: &str, files: usize) -> (String, PathBuf) {
    let bare = dir.join(format!("{name}.git"));
    let seed = dir.join(format!("{name}-seed"));
    std::fs::create_dir_all(&seed).unwrap();
    sh(
        dir,
        &[
            "init",
            "--quiet",
            "--bare",
            "--initial-branch=main",
            bare.to_str().unwrap(),
        ],
    );
    sh(&seed, &["init", "--quiet", "--initial-branch=main"]);
    for n in 0..files {
        std::fs::write(
            seed.join(format!("f{n}.txt")),
            format!("{name} {n}\n").repeat(200),
        )
        .unwrap();
    }
    sh(&seed, &["add", "-A"]);
    sh(&seed, &["commit", "--quiet", "-m", "one"]);
    sh(
        &seed,
        &["push", "--quiet", bare.to_str().unwrap(), "HEAD:main"],
    );
    (format!("file://{}", bare.display()), seed)
}

pub(super) fn repo_in(dir: &Path, name: &str) -> Repo {
    std::fs::create_dir_all(dir.join(name)).unwrap();
    Repo::new(dir.join(name).join("repo.git"), dir.join(name).join("src"))
}

/// Catches: two runs of one repository that start together and corrupt each other's
/// fetch or clone (no lock), or get different commits for the same ref.
#[tokio::test]
async fn two_runs_of_one_repository_at_once_get_the_same_base() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _) = origin(dir.path(), "shop", 20);
    let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
    let (one, two) = (repo_in(dir.path(), "one"), repo_in(dir.path(), "two"));
    let (a, b) = tokio::join!(
        cache.clone_at(&url, Some("main"), &one),
        cache.clone_at(&url, Some("main"), &two)
    );
    let (a, b) = (a.expect("first clone"), b.expect("second clone"));
    assert_eq!(a, b);
    assert!(one.work_tree.join("f7.txt").is_file() && two.work_tree.join("f7.txt").is_file());
    assert!(
        cache.mirror_of(&url, Some("main")).join("HEAD").is_file(),
        "the mirror is kept"
    );
}

/// Catches: a cache that serves what it fetched before instead of what the remote has now
/// (a force-pushed ref must give the new commit, and the old one must not come back).
#[tokio::test]
async fn a_force_pushed_ref_is_fetched_anew() {
    let dir = tempfile::tempdir().unwrap();
    let (url, seed) = origin(dir.path(), "shop", 3);
    let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
    let first = cache
        .clone_at(&url, Some("main"), &repo_in(dir.path(), "a"))
        .await
        .unwrap();
    std::fs::write(seed.join("f0.txt"), "rewritten\n").unwrap();
    sh(
        &seed,
        &["commit", "--quiet", "--amend", "-a", "-m", "rewritten"],
    );
    let bare = url.trim_start_matches("file://");
    sh(&seed, &["push", "--quiet", "--force", bare, "HEAD:main"]);
    let now = sh(&seed, &["rev-parse", "HEAD"]);
    let repo = repo_in(dir.path(), "b");
    let second = cache.clone_at(&url, Some("main"), &repo).await.unwrap();
    assert_ne!(first, second);
    assert_eq!(second, now, "the remote's commit, not the cached one");
    assert_eq!(
        std::fs::read_to_string(repo.work_tree.join("f0.txt")).unwrap(),
        "rewritten\n"
    );
    // What the rewrite removed from the branch is readable neither in the mirror nor in the
    // next run's git folder.
    let removed = sh(&seed, &["rev-parse", &format!("{first}:f0.txt")]);
    assert!(!has_object(&cache.mirror_of(&url, Some("main")), &removed));
    assert!(!has_object(&repo.git_dir, &removed));
}

/// Whether the git folder `git_dir` holds `object`.
fn has_object(git_dir: &Path, object: &str) -> bool {
    std::process::Command::new("git")
        .args([
            "--git-dir",
            git_dir.to_str().unwrap(),
            "cat-file",
            "-e",
            object,
        ])
        .status()
        .unwrap()
        .success()
}

/// Catches: a run's git folder made from a mirror of the whole repository, where the agent
/// reads a blob only another branch reaches (another ticket's private branch, fetched by an
/// earlier run of that branch on the same worker).
#[tokio::test]
async fn a_runs_git_folder_holds_only_what_its_base_ref_reaches() {
    let dir = tempfile::tempdir().unwrap();
    let (url, seed) = origin(dir.path(), "shop", 3);
    let bare = url.trim_start_matches("file://").to_string();
    sh(&seed, &["checkout", "--quiet", "-b", "private"]);
    std::fs::write(seed.join("secret.txt"), "only on the private branch\n").unwrap();
    sh(&seed, &["add", "-A"]);
    sh(&seed, &["commit", "--quiet", "-m", "private"]);
    sh(&seed, &["push", "--quiet", &bare, "HEAD:private"]);
    let secret = sh(&seed, &["rev-parse", "HEAD:secret.txt"]);
    let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
    let private = repo_in(dir.path(), "private");
    cache
        .clone_at(&url, Some("private"), &private)
        .await
        .unwrap();
    assert!(has_object(&private.git_dir, &secret));
    let main = repo_in(dir.path(), "main");
    cache.clone_at(&url, Some("main"), &main).await.unwrap();
    assert!(main.work_tree.join("f1.txt").is_file());
    assert!(
        !has_object(&main.git_dir, &secret),
        "the main run's git folder holds the private branch's blob"
    );
    // The cache's speed stays: a second run of main links the same mirror.
    let again = repo_in(dir.path(), "again");
    cache.clone_at(&url, Some("main"), &again).await.unwrap();
    assert!(!has_object(&again.git_dir, &secret));
}

/// Catches: a cache that grows without bound, or evicts the repository just fetched.
#[tokio::test]
async fn the_least_recently_used_mirror_is_evicted_over_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let (old, _) = origin(dir.path(), "old", 30);
    let (new, _) = origin(dir.path(), "new", 30);
    let roomy = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
    roomy
        .clone_at(&old, None, &repo_in(dir.path(), "a"))
        .await
        .unwrap();
    assert!(roomy.mirror_of(&old, None).is_dir());
    // Room for one mirror and a half.
    let one = size_of(&roomy.mirror_of(&old, None));
    let cache = RepoCache::new(dir.path().join("cache"), one * 3 / 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    cache
        .clone_at(&new, None, &repo_in(dir.path(), "b"))
        .await
        .unwrap();
    assert!(
        !cache.mirror_of(&old, None).exists(),
        "the older mirror was evicted"
    );
    assert!(
        cache.mirror_of(&new, None).is_dir(),
        "the one just fetched is kept"
    );
}

/// Catches: a damaged mirror (a truncated pack) that fails runs, or that is kept and
/// fails the next run too.
#[tokio::test]
async fn a_corrupted_mirror_is_detected_and_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _) = origin(dir.path(), "shop", 20);
    let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
    let first = cache
        .clone_at(&url, Some("main"), &repo_in(dir.path(), "a"))
        .await
        .unwrap();
    let mirror = cache.mirror_of(&url, Some("main"));
    sh(&mirror, &["repack", "-a", "-d", "--quiet"]);
    let pack_dir = mirror.join("objects/pack");
    for entry in std::fs::read_dir(&pack_dir).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "pack") {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(entry.path())
                .unwrap();
            file.set_len(100).unwrap();
        }
    }
    let repo = repo_in(dir.path(), "b");
    let second = cache
        .clone_at(&url, Some("main"), &repo)
        .await
        .expect("cloned anyway");
    assert_eq!(first, second);
    assert!(repo.work_tree.join("f3.txt").is_file());
    let third = repo_in(dir.path(), "c");
    cache
        .clone_at(&url, Some("main"), &third)
        .await
        .expect("the mirror was made again");
    assert!(third.work_tree.join("f3.txt").is_file());
    assert_eq!(
        sh(
            &mirror,
            &["rev-parse", "--verify", &format!("{first}^{{tree}}")]
        )
        .len(),
        40
    );
}

/// Catches: a cached clone whose base, tree or refs differ from a direct clone's (the
/// delivered commit and the no-progress guard's tree hashes must not depend on the cache).
#[tokio::test]
async fn a_cached_clone_is_the_same_as_a_direct_one() {
    let dir = tempfile::tempdir().unwrap();
    let (url, _) = origin(dir.path(), "shop", 20);
    let cache = RepoCache::new(dir.path().join("cache"), DEFAULT_CACHE_BYTES);
    let (cached, direct) = (repo_in(dir.path(), "a"), repo_in(dir.path(), "b"));
    let via_cache = cache.clone_at(&url, Some("main"), &cached).await.unwrap();
    let plain = git::clone_at(&url, Some("main"), &direct).await.unwrap();
    assert_eq!(via_cache, plain);
    for repo in [&cached, &direct] {
        std::fs::write(repo.work_tree.join("new.txt"), "change\n").unwrap();
    }
    let (one, two) = (
        git::snapshot_tree(&cached).await.unwrap(),
        git::snapshot_tree(&direct).await.unwrap(),
    );
    assert_eq!(one, two, "the same tree hash");
    assert_eq!(
        cached.git(&["rev-parse", "base"]).await.unwrap(),
        direct.git(&["rev-parse", "base"]).await.unwrap()
    );
}
