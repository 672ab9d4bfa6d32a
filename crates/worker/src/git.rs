//! Git through the `git` command line: clone, snapshot a tree, make review copies, deliver.
//!
//! The worker owns every repository it touches under its workspace folder; stage containers
//! write into them as another user, so every call trusts the folder (`safe.directory`).

use std::path::Path;
use std::time::Duration;

use tokio::process::Command;

/// The limit on one git command (clone and push of large repositories included).
pub const GIT_TIMEOUT: Duration = Duration::from_secs(600);

/// A failed git command.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    /// git could not be started.
    #[error("cannot run git: {0}; install git on the worker")]
    Spawn(std::io::Error),
    /// git exited with an error.
    #[error("`git {command}` failed: {stderr}")]
    Failed {
        /// The subcommand and its arguments.
        command: String,
        /// What git said.
        stderr: String,
    },
    /// git did not finish in time.
    #[error("`git {0}` did not finish within {GIT_TIMEOUT:?}")]
    Timeout(String),
}

/// The identity of delivery commits.
const AUTHOR_NAME: &str = "forgepool";
const AUTHOR_EMAIL: &str = "forgepool@localhost";

/// Runs `git args` in `dir` and returns its trimmed stdout.
pub async fn git(dir: &Path, args: &[&str]) -> Result<String, GitError> {
    git_with_env(dir, args, &[]).await
}

/// Runs `git args` in `dir` with extra environment variables.
pub async fn git_with_env(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<String, GitError> {
    run_git(dir, args, env, None).await
}

/// Runs `git args` in `dir` with `input` on its standard input.
pub async fn git_with_input(dir: &Path, args: &[&str], input: &str) -> Result<String, GitError> {
    run_git(dir, args, &[], Some(input)).await
}

async fn run_git(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    input: Option<&str>,
) -> Result<String, GitError> {
    let mut command = Command::new("git");
    command
        .arg("-c")
        .arg("safe.directory=*")
        .arg("-c")
        .arg("core.hooksPath=/dev/null")
        .args(args)
        .current_dir(dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_AUTHOR_NAME", AUTHOR_NAME)
        .env("GIT_AUTHOR_EMAIL", AUTHOR_EMAIL)
        .env("GIT_COMMITTER_NAME", AUTHOR_NAME)
        .env("GIT_COMMITTER_EMAIL", AUTHOR_EMAIL)
        .stdin(if input.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    let shown = args.join(" ");
    let finished = async {
        let mut child = command.spawn()?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            use tokio::io::AsyncWriteExt;
            stdin.write_all(input.as_bytes()).await?;
        }
        child.wait_with_output().await
    };
    let output = tokio::time::timeout(GIT_TIMEOUT, finished)
        .await
        .map_err(|_| GitError::Timeout(shown.clone()))?
        .map_err(GitError::Spawn)?;
    if !output.status.success() {
        return Err(GitError::Failed {
            command: shown,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Clones `url` into `dest` and returns the commit id of `reference` (the default branch when
/// `None`), checked out detached and also kept as the branch `base`.
pub async fn clone_at(url: &str, reference: Option<&str>, dest: &Path) -> Result<String, GitError> {
    // A branch or tag (or the default branch) is cloned and checked out in one git process;
    // a commit id, or a name the fast path cannot find, takes the general path below.
    if !reference.is_some_and(looks_like_commit) {
        match clone_named(url, reference, dest).await {
            Ok(commit) => return Ok(commit),
            Err(error) if reference.is_none() => return Err(error),
            Err(_) => {
                let _ = tokio::fs::remove_dir_all(dest).await;
            }
        }
    }
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let dest_text = dest.to_string_lossy();
    git(
        parent,
        &[
            "clone",
            "--quiet",
            "--no-checkout",
            "--no-local",
            "--",
            url,
            &dest_text,
        ],
    )
    .await?;
    let commit = match reference {
        None => git(dest, &["rev-parse", "--verify", "HEAD^{commit}"]).await?,
        Some(reference) => {
            let remote = format!("refs/remotes/origin/{reference}^{{commit}}");
            match git(dest, &["rev-parse", "--verify", "--quiet", &remote]).await {
                Ok(commit) if !commit.is_empty() => commit,
                _ => git(
                    dest,
                    &["rev-parse", "--verify", &format!("{reference}^{{commit}}")],
                )
                .await
                .map_err(|_| GitError::Failed {
                    command: format!("rev-parse {reference}"),
                    stderr: format!(
                        "the repository has no branch, tag or commit named `{reference}`"
                    ),
                })?,
            }
        }
    };
    git(dest, &["checkout", "--quiet", "--detach", &commit]).await?;
    git(dest, &["branch", "--force", "base", &commit]).await?;
    exclude_forge(dest).await?;
    Ok(commit)
}

/// Clones `url` with `reference` (a branch or tag; the default branch when `None`) checked
/// out, detaches HEAD and points `base` at it: three git processes. Only that branch's
/// history is fetched (`--single-branch`): a repository's other branches (every delivered
/// `forge/*` branch among them) cost nothing. Local paths go through the pack protocol too,
/// which measured faster than copying the object files, and never hardlinks them into a
/// folder that stage users own.
async fn clone_named(url: &str, reference: Option<&str>, dest: &Path) -> Result<String, GitError> {
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let dest_text = dest.to_string_lossy();
    let mut args = vec!["clone", "--quiet", "--single-branch", "--no-local"];
    if let Some(reference) = reference {
        args.extend(["--branch", reference]);
    }
    args.extend(["--", url, &dest_text]);
    git(parent, &args).await?;
    let commit = git(dest, &["rev-parse", "--verify", "HEAD^{commit}"]).await?;
    let updates = format!("update HEAD {commit}\nupdate refs/heads/base {commit}\n");
    git_with_input(dest, &["update-ref", "--no-deref", "--stdin"], &updates).await?;
    exclude_forge(dest).await?;
    Ok(commit)
}

/// Whether a reference looks like a (possibly abbreviated) commit id.
fn looks_like_commit(reference: &str) -> bool {
    (7..=64).contains(&reference.len()) && reference.chars().all(|c| c.is_ascii_hexdigit())
}

/// Keeps `.forge/` out of every snapshot and commit of a repository.
async fn exclude_forge(repo: &Path) -> Result<(), GitError> {
    let exclude = repo.join(".git/info/exclude");
    let mut text = tokio::fs::read_to_string(&exclude)
        .await
        .unwrap_or_default();
    if !text.lines().any(|l| l == "/.forge/") {
        text.push_str("\n/.forge/\n");
        tokio::fs::create_dir_all(repo.join(".git/info"))
            .await
            .map_err(GitError::Spawn)?;
        tokio::fs::write(&exclude, text)
            .await
            .map_err(GitError::Spawn)?;
    }
    Ok(())
}

/// Records the working tree (everything but `.forge/`) and returns its tree id.
pub async fn snapshot_tree(repo: &Path) -> Result<String, GitError> {
    git(
        repo,
        &["add", "--all", "--force", "--", ".", ":(exclude).forge"],
    )
    .await?;
    git(
        repo,
        &[
            "rm",
            "-r",
            "--cached",
            "--quiet",
            "--ignore-unmatch",
            "--",
            ".forge",
        ],
    )
    .await?;
    git(repo, &["write-tree"]).await
}

/// Makes a commit of `tree` on `parent`, dated `date` so the same inputs give the same commit.
pub async fn commit_tree(
    repo: &Path,
    tree: &str,
    parent: &str,
    message: &str,
    date: &str,
) -> Result<String, GitError> {
    let env = [("GIT_AUTHOR_DATE", date), ("GIT_COMMITTER_DATE", date)];
    git_with_env(
        repo,
        &["commit-tree", tree, "-p", parent, "-m", message],
        &env,
    )
    .await
}

/// Makes a fresh copy of `repo` at `dest` with `commit` checked out and `base` as a branch, so
/// `git diff base...HEAD` shows the change. The copy shares nothing writable with `repo`.
pub async fn copy_at(repo: &Path, commit: &str, base: &str, dest: &Path) -> Result<(), GitError> {
    git(
        repo,
        &["update-ref", "refs/heads/forgepool-candidate", commit],
    )
    .await?;
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let source = repo.to_string_lossy();
    let dest_text = dest.to_string_lossy();
    // The source belongs to the stage user, and the upload-pack that a local clone starts does
    // not inherit our `safe.directory`, so it is given its own.
    let upload_pack = "git -c safe.directory=* upload-pack";
    git(
        parent,
        &[
            "clone",
            "--quiet",
            "--no-hardlinks",
            "--upload-pack",
            upload_pack,
            "--branch",
            "forgepool-candidate",
            "--",
            &source,
            &dest_text,
        ],
    )
    .await?;
    git(dest, &["branch", "--force", "base", base]).await?;
    git(dest, &["remote", "remove", "origin"]).await?;
    Ok(())
}

/// The change from `base` to `commit` as a binary-safe patch.
pub async fn diff(repo: &Path, base: &str, commit: &str) -> Result<String, GitError> {
    git(repo, &["diff", "--binary", base, commit]).await
}

/// Pushes `commit` to `branch` of `url`, replacing what the branch held.
pub async fn push(repo: &Path, url: &str, commit: &str, branch: &str) -> Result<(), GitError> {
    let refspec = format!("+{commit}:refs/heads/{branch}");
    git(repo, &["push", "--quiet", "--", url, &refspec])
        .await
        .map(|_| ())
}

/// The change from `base` (a commit) to `tree`, as a patch that [`apply_checkpoint`] replays
/// exactly. Every file is encoded as binary, so the patch is ASCII whatever the files hold.
pub async fn checkpoint_patch(repo: &Path, base: &str, tree: &str) -> Result<String, GitError> {
    // `info/attributes` outranks the repository's own `.gitattributes`; it is only in place
    // for this one diff, since `binary` also changes how files are added.
    let attributes = repo.join(".git/info/attributes");
    let previous = tokio::fs::read(&attributes).await.ok();
    tokio::fs::create_dir_all(repo.join(".git/info"))
        .await
        .map_err(GitError::Spawn)?;
    tokio::fs::write(&attributes, "* binary\n")
        .await
        .map_err(GitError::Spawn)?;
    let patch = git(
        repo,
        &[
            "diff",
            "--binary",
            "--full-index",
            "--no-textconv",
            "--no-ext-diff",
            base,
            tree,
        ],
    )
    .await;
    let restored = match previous {
        Some(bytes) => tokio::fs::write(&attributes, bytes).await,
        None => tokio::fs::remove_file(&attributes).await,
    };
    restored.map_err(GitError::Spawn)?;
    patch
}

/// Replays a [`checkpoint_patch`] on the checked-out base and returns the resulting tree.
pub async fn apply_checkpoint(repo: &Path, patch: &str) -> Result<String, GitError> {
    if !patch.trim().is_empty() {
        let file = repo.join(".git/forgepool-resume.patch");
        // A binary hunk ends with a blank line, which the captured output lost.
        tokio::fs::write(&file, format!("{}\n\n", patch.trim_end()))
            .await
            .map_err(GitError::Spawn)?;
        let path = file.to_string_lossy().to_string();
        git(
            repo,
            &["apply", "--binary", "--index", "--whitespace=nowarn", &path],
        )
        .await?;
    }
    snapshot_tree(repo).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bare repository with two commits on `main`, a tag on the first and a branch `topic`.
    async fn origin(dir: &Path) -> (String, String, String) {
        let bare = dir.join("origin.git");
        let seed = dir.join("seed");
        git(
            dir,
            &[
                "init",
                "--quiet",
                "--bare",
                "--initial-branch=main",
                "origin.git",
            ],
        )
        .await
        .unwrap();
        git(dir, &["clone", "--quiet", "origin.git", "seed"])
            .await
            .unwrap();
        tokio::fs::write(seed.join("a.txt"), "one\n").await.unwrap();
        git(&seed, &["add", "-A"]).await.unwrap();
        git(&seed, &["commit", "--quiet", "-m", "one"])
            .await
            .unwrap();
        let first = git(&seed, &["rev-parse", "HEAD"]).await.unwrap();
        git(&seed, &["tag", "v1"]).await.unwrap();
        tokio::fs::write(seed.join("a.txt"), "two\n").await.unwrap();
        git(&seed, &["commit", "--quiet", "-am", "two"])
            .await
            .unwrap();
        let second = git(&seed, &["rev-parse", "HEAD"]).await.unwrap();
        git(
            &seed,
            &[
                "push",
                "--quiet",
                "origin",
                "HEAD:main",
                "HEAD~1:refs/heads/topic",
                "v1",
            ],
        )
        .await
        .unwrap();
        (format!("file://{}", bare.display()), first, second)
    }

    async fn checked_out(dest: &Path) -> (String, String, String, bool) {
        let head = git(dest, &["rev-parse", "HEAD"]).await.unwrap();
        let base = git(dest, &["rev-parse", "base"]).await.unwrap();
        let file = tokio::fs::read_to_string(dest.join("a.txt")).await.unwrap();
        let detached = git(dest, &["symbolic-ref", "-q", "HEAD"]).await.is_err();
        (head, base, file, detached)
    }

    #[tokio::test]
    async fn every_kind_of_reference_is_checked_out_detached_with_base() {
        let dir = tempfile::tempdir().unwrap();
        let (url, first, second) = origin(dir.path()).await;
        let cases: [(Option<&str>, &str, &str); 6] = [
            (None, &second, "two\n"),
            (Some("main"), &second, "two\n"),
            (Some("topic"), &first, "one\n"),
            (Some("v1"), &first, "one\n"),
            (Some(&first), &first, "one\n"),
            (Some(&first[..10]), &first, "one\n"),
        ];
        for (n, (reference, commit, content)) in cases.into_iter().enumerate() {
            let dest = dir.path().join(format!("clone{n}"));
            let got = clone_at(&url, reference, &dest).await.unwrap();
            assert_eq!(got, commit, "{reference:?}");
            assert_eq!(
                checked_out(&dest).await,
                (
                    commit.to_string(),
                    commit.to_string(),
                    content.to_string(),
                    true
                ),
                "{reference:?}"
            );
            let exclude = tokio::fs::read_to_string(dest.join(".git/info/exclude"))
                .await
                .unwrap();
            assert!(exclude.lines().any(|l| l == "/.forge/"), "{reference:?}");
        }
        // Copies, never hardlinks: a stage user owning the clone cannot touch the origin.
        let object = dir.path().join("clone1/.git/objects");
        let mut stack = vec![object];
        while let Some(path) = stack.pop() {
            let mut entries = tokio::fs::read_dir(&path).await.unwrap();
            while let Some(entry) = entries.next_entry().await.unwrap() {
                let metadata = entry.metadata().await.unwrap();
                if metadata.is_dir() {
                    stack.push(entry.path());
                } else {
                    use std::os::unix::fs::MetadataExt;
                    assert_eq!(metadata.nlink(), 1, "{}", entry.path().display());
                }
            }
        }
    }

    #[tokio::test]
    async fn a_missing_reference_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let (url, _, _) = origin(dir.path()).await;
        let error = clone_at(&url, Some("nope"), &dir.path().join("c"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("no branch, tag or commit named `nope`"),
            "{error}"
        );
    }
}
