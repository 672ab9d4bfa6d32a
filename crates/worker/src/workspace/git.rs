//! Git through the `git` command line: clone, snapshot a tree, make review copies, deliver.
//!
//! forgepool's git only trusts itself. A run's repository is a [`Repo`]: a **private git
//! folder** that only the worker ever touches (its config, hooks, index, objects and refs)
//! and the **work tree** that stages change. The work tree is mounted into stages; the git
//! folder never is. An implementer that wants git gets a disposable copy of the git folder as
//! `/workspace/.git`, which forgepool never reads: git itself skips every `.git` entry of a
//! work tree. Every git process runs without system or global configuration, without hooks
//! or an fsmonitor, with `protocol.allow` limited to the allowed schemes, and never in a
//! folder an agent could have prepared: so no `core.fsmonitor`, filter, `diff.external`,
//! `url.*.insteadOf`, `core.worktree`, gitfile or alternate an agent writes is ever honoured.
//!
//! The git folder is `{run}/repo.git`, the work tree `{run}/src`, and every call names both. A
//! branch or tag is cloned with `--single-branch --separate-git-dir` and checked out in one
//! process, then HEAD is detached and `base` set in one `update-ref`; a commit id takes the
//! general path.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

pub use crate::workspace::copies::shareable;

mod user;

/// The limit on one git command (clone and push of large repositories included).
pub const GIT_TIMEOUT: Duration = Duration::from_secs(600);

/// The most bytes of git's standard error kept in an error.
const MAX_STDERR: usize = 4096;

static ALLOWED_SCHEMES: OnceLock<Vec<String>> = OnceLock::new();

/// Sets the URL schemes git may use for the process (`FORGEPOOL_ALLOWED_URL_SCHEMES`). The
/// first call wins; without one, [`proto::names::DEFAULT_ALLOWED_SCHEMES`] apply.
pub fn set_allowed_schemes(schemes: Vec<String>) {
    let _ = ALLOWED_SCHEMES.set(schemes);
}

/// The URL schemes git may use.
pub fn allowed_schemes() -> Vec<String> {
    ALLOWED_SCHEMES
        .get()
        .cloned()
        .unwrap_or_else(proto::names::default_allowed_schemes)
}

/// What to do about git that could not be started: a missing program is installed; a folder
/// the user git runs as cannot reach is another matter, said by the error itself.
fn spawn_hint(error: &std::io::Error) -> &'static str {
    match error.kind() {
        std::io::ErrorKind::NotFound => "; install git on the worker",
        std::io::ErrorKind::PermissionDenied => {
            " (the user git runs as cannot reach its folder or the program)"
        }
        _ => "",
    }
}

/// A failed git command.
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    /// git could not be started (or its input or output failed).
    #[error("cannot run git: {0}{hint}", hint = spawn_hint(.0))]
    Spawn(std::io::Error),
    /// A file or folder of the run's repository could not be made or read.
    #[error("cannot prepare the repository's files: {0}")]
    Files(std::io::Error),
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
    /// The change holds something forgepool does not deliver.
    #[error("{0}")]
    Refused(String),
}

/// The configuration of the stages' disposable git folder.
const DISPOSABLE_CONFIG: &str =
    "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n\tlogallrefupdates = true\n";

/// The identity of delivery commits.
const AUTHOR_NAME: &str = "forgepool";
const AUTHOR_EMAIL: &str = "forgepool@localhost";

/// A run's repository: the private git folder and the work tree stages change.
#[derive(Debug, Clone)]
pub struct Repo {
    /// The git folder; only the worker touches it, it is never mounted into a stage.
    pub git_dir: PathBuf,
    /// The work tree; stages change it, so nothing in it is trusted.
    pub work_tree: PathBuf,
}

impl Repo {
    /// A repository of a run: `{root}/repo.git` and the work tree `work_tree`.
    pub fn new(git_dir: PathBuf, work_tree: PathBuf) -> Repo {
        Repo { git_dir, work_tree }
    }

    /// Runs git on the git folder alone (objects and refs; the work tree is not read).
    pub async fn git(&self, args: &[&str]) -> Result<String, GitError> {
        let git_dir = format!("--git-dir={}", self.git_dir.display());
        let mut all = vec![git_dir.as_str()];
        all.extend_from_slice(args);
        run_git(&self.git_dir, &all, &[], None, None).await
    }

    /// Runs git on the git folder with the work tree.
    pub async fn git_in_tree(&self, args: &[&str]) -> Result<String, GitError> {
        self.git_in_tree_with_input(args, None).await
    }

    async fn git_in_tree_with_input(
        &self,
        args: &[&str],
        input: Option<&str>,
    ) -> Result<String, GitError> {
        let git_dir = format!("--git-dir={}", self.git_dir.display());
        let work_tree = format!("--work-tree={}", self.work_tree.display());
        let mut all = vec![git_dir.as_str(), work_tree.as_str()];
        all.extend_from_slice(args);
        // Pathspecs are relative to the work tree; the explicit git folder means git never
        // looks for one in it.
        run_git(&self.work_tree, &all, &[], input, None).await
    }

    /// Gives the stages a git repository of their own at `{work tree}/.git`: a copy of the git
    /// folder, which forgepool never reads back (git skips `.git` in a work tree). A layered
    /// work tree gets it beside it ([`crate::workspace::overlay::stage_git`]), mounted at `.git` in the
    /// stages (hard links cannot cross into an overlay), and an empty folder to mount it on.
    pub async fn make_disposable_copy(&self) -> Result<(), GitError> {
        let from = self.git_dir.clone();
        let work_tree = self.work_tree.clone();
        tokio::task::spawn_blocking(move || {
            if crate::workspace::overlay::upper_of(&work_tree).is_none() {
                return disposable_git(&from, &work_tree.join(".git"), "");
            }
            disposable_git(
                &from,
                &crate::workspace::overlay::layer_dir(&work_tree).join("git"),
                "",
            )?;
            std::fs::create_dir_all(work_tree.join(".git"))
        })
        .await
        .map_err(|e| GitError::Files(std::io::Error::other(e)))?
        .map_err(GitError::Files)
    }
}

/// Copies the git folder `from` to `to` (replacing it) for stages: object files are linked,
/// not copied (a 50,000-file repository's pack is hundreds of megabytes; they stay read-only
/// and the worker's: a file with other links is never handed to a stage user), and the
/// configuration is forgepool's minimum: no remote (its URL may carry credentials), no branch
/// tracking, only the object format kept, then `extra`.
pub fn disposable_git(from: &Path, to: &Path, extra: &str) -> std::io::Result<()> {
    if std::fs::symlink_metadata(to).is_ok() {
        crate::workspace::copies::remove_any(to)?;
    }
    let sha256 = std::fs::read_to_string(from.join("config"))
        .is_ok_and(|c| c.contains("objectformat = sha256"));
    crate::workspace::copies::copy_tree(from, to, false)?;
    let config = if sha256 {
        DISPOSABLE_CONFIG.replace("repositoryformatversion = 0", "repositoryformatversion = 1")
            + "[extensions]\n\tobjectformat = sha256\n"
    } else {
        DISPOSABLE_CONFIG.to_string()
    };
    std::fs::write(to.join("config"), config + extra)
}

/// Runs `git args` in `dir` (a folder forgepool made and no stage can write) and returns its
/// trimmed stdout.
pub async fn git(dir: &Path, args: &[&str]) -> Result<String, GitError> {
    run_git(dir, args, &[], None, None).await
}

/// Runs `git args` in `dir` with extra environment variables.
pub async fn git_with_env(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Result<String, GitError> {
    run_git(dir, args, env, None, None).await
}

/// Runs `git args` in `dir` as the user `user` (`uid`, `gid`), with extra environment
/// variables: what it writes is that user's from the start, with no ownership walk after.
/// When the worker is root and has `setpriv`, git keeps one capability,
/// `CAP_DAC_READ_SEARCH` (read and traverse anything; write nothing the user may not), so it
/// reaches the repository cache under a work folder only root may open.
pub async fn git_as(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    user: (u32, u32),
) -> Result<String, GitError> {
    run_git(dir, args, env, None, Some(user)).await
}

/// The configuration every git process of forgepool gets on its command line, which outranks
/// the repository's own: no hooks, no fsmonitor, no helper programs, only allowed protocols.
fn hardening() -> Vec<String> {
    let mut args: Vec<String> = [
        "core.hooksPath=/dev/null",
        "core.fsmonitor=false",
        "core.untrackedCache=false",
        "core.excludesFile=/dev/null",
        "core.attributesFile=/dev/null",
        "core.askPass=",
        "credential.helper=",
        "diff.external=",
        "protocol.allow=never",
        "advice.addEmbeddedRepo=false",
        "init.templateDir=",
        // Checkout with a worker per core: 1.6 s, not 13 s, for 50,000 files.
        "checkout.workers=0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for scheme in allowed_schemes() {
        args.push(format!("protocol.{scheme}.allow=always"));
    }
    // After `credential.helper=`: a forge's helper is the only one git asks.
    args.extend(crate::delivery::forges::forges().git_config());
    args.into_iter()
        .flat_map(|a| ["-c".to_string(), a])
        .collect()
}

/// Variables of the worker's environment that would point git elsewhere.
const GIT_ENVIRONMENT: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_CONFIG",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
    "GIT_EXTERNAL_DIFF",
    "GIT_CEILING_DIRECTORIES",
    "GIT_NAMESPACE",
    "GIT_COMMON_DIR",
];

async fn run_git(
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
    input: Option<&str>,
    user: Option<(u32, u32)>,
) -> Result<String, GitError> {
    let mut command = user::command(user);
    command
        .args(hardening())
        .args(args)
        .current_dir(dir)
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_PROTOCOL_FROM_USER", "0")
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
    for name in GIT_ENVIRONMENT
        .iter()
        .copied()
        .chain(crate::delivery::forges::forges().overridden_environment())
    {
        command.env_remove(name);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    // What errors quote of the command: never a URL's credentials.
    let shown = proto::names::redact_url_credentials(
        &args
            .iter()
            .filter(|a| !a.starts_with("--git-dir=") && !a.starts_with("--work-tree="))
            .copied()
            .collect::<Vec<_>>()
            .join(" "),
    );
    let finished = async {
        #[cfg(test)]
        let _clock = HoldTestClock::new();
        let mut child = command.spawn()?;
        if let (Some(input), Some(mut stdin)) = (input, child.stdin.take()) {
            use tokio::io::AsyncWriteExt;
            stdin.write_all(input.as_bytes()).await?;
        }
        child.wait_with_output().await
    };
    let began = std::time::Instant::now();
    let output = tokio::time::timeout(GIT_TIMEOUT, finished)
        .await
        .map_err(|_| GitError::Timeout(shown.clone()))?
        .map_err(GitError::Spawn)?;
    // Where a run's seconds go, git command by git command (`FORGEPOOL_LOG=forgepool_worker::workspace::git=debug`).
    tracing::debug!(command = %shown, seconds = began.elapsed().as_secs_f64(), "git");
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stderr = crate::runtime::tail(stderr.trim(), MAX_STDERR);
        // A configured forge that refused forgepool's credentials is named with its setting.
        let stderr = match crate::delivery::forges::forges().explain(stderr) {
            Some(explained) => format!("{explained}: {stderr}"),
            None => stderr.to_string(),
        };
        return Err(GitError::Failed {
            command: shown,
            stderr: proto::names::redact_url_credentials(&stderr),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// Under a paused test clock tokio moves time on whenever the runtime waits for nothing but
/// I/O, so [`GIT_TIMEOUT`] would pass while git works. A blocking task held while a child runs
/// stops that: tokio never auto-advances while one is running. The engine's unit tests run
/// real git on a paused clock; production code never needs this.
#[cfg(test)]
struct HoldTestClock(Option<std::sync::mpsc::Sender<()>>);

#[cfg(test)]
impl HoldTestClock {
    fn new() -> HoldTestClock {
        let (release, held) = std::sync::mpsc::channel::<()>();
        tokio::task::spawn_blocking(move || {
            let _ = held.recv();
        });
        HoldTestClock(Some(release))
    }
}

#[cfg(test)]
impl Drop for HoldTestClock {
    fn drop(&mut self) {
        self.0.take();
    }
}

/// Clones `url` into the run's repository (its git folder and work tree, neither existing
/// yet) and returns the commit id of `reference` (the default branch when `None`), checked out
/// detached and also kept as the branch `base`.
pub async fn clone_at(url: &str, reference: Option<&str>, repo: &Repo) -> Result<String, GitError> {
    proto::names::check_url(url, &allowed_schemes())
        .map_err(|reason| GitError::Refused(format!("repository URL refused: {reason}")))?;
    // A branch or tag (or the default branch) is cloned and checked out in one git process;
    // a commit id, or a name the fast path cannot find, takes the general path below.
    if !reference.is_some_and(looks_like_commit) {
        match clone_named(url, reference, repo).await {
            Ok(commit) => return Ok(commit),
            Err(error) if reference.is_none() => return Err(error),
            Err(_) => {
                let _ = tokio::fs::remove_dir_all(&repo.work_tree).await;
                let _ = tokio::fs::remove_dir_all(&repo.git_dir).await;
            }
        }
    }
    clone_into(url, &["--no-checkout"], repo).await?;
    let commit = match reference {
        None => {
            repo.git(&["rev-parse", "--verify", "HEAD^{commit}"])
                .await?
        }
        Some(reference) => {
            let remote = format!("refs/remotes/origin/{reference}^{{commit}}");
            match repo
                .git(&["rev-parse", "--verify", "--quiet", &remote])
                .await
            {
                Ok(commit) if !commit.is_empty() => commit,
                _ => repo
                    .git(&["rev-parse", "--verify", &format!("{reference}^{{commit}}")])
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
    repo.git_in_tree(&["checkout", "--quiet", "--detach", &commit])
        .await?;
    repo.git(&["branch", "--force", "base", &commit]).await?;
    exclude_forge(repo).await?;
    Ok(commit)
}

/// `git clone` with the git folder kept apart from the work tree. The `.git` file git leaves
/// in the work tree is removed: forgepool always names its git folder itself.
async fn clone_into(url: &str, options: &[&str], repo: &Repo) -> Result<(), GitError> {
    let parent = repo.work_tree.parent().unwrap_or(Path::new("/"));
    let git_dir = repo.git_dir.to_string_lossy();
    let work_tree = repo.work_tree.to_string_lossy();
    let mut args = vec!["clone", "--quiet", "--no-local"];
    args.extend_from_slice(options);
    args.extend(["--separate-git-dir", &git_dir, "--", url, &work_tree]);
    git(parent, &args).await?;
    tokio::fs::remove_file(repo.work_tree.join(".git"))
        .await
        .map_err(GitError::Files)
}

/// Clones `url` with `reference` (a branch or tag; the default branch when `None`) checked
/// out, detaches HEAD and points `base` at it: three git processes. Only that branch's
/// history is fetched (`--single-branch`): a repository's other branches (every delivered
/// `forge/*` branch among them) cost nothing. Local paths go through the pack protocol too,
/// which measured faster than copying the object files, and never hardlinks them into a
/// folder that stage users own.
async fn clone_named(url: &str, reference: Option<&str>, repo: &Repo) -> Result<String, GitError> {
    let mut options = vec!["--single-branch"];
    if let Some(reference) = reference {
        options.extend(["--branch", reference]);
    }
    clone_into(url, &options, repo).await?;
    let commit = repo
        .git(&["rev-parse", "--verify", "HEAD^{commit}"])
        .await?;
    let updates = format!("update HEAD {commit}\nupdate refs/heads/base {commit}\n");
    let git_dir = format!("--git-dir={}", repo.git_dir.display());
    run_git(
        &repo.git_dir,
        &[&git_dir, "update-ref", "--no-deref", "--stdin"],
        &[],
        Some(&updates),
        None,
    )
    .await?;
    exclude_forge(repo).await?;
    Ok(commit)
}

/// Whether a reference looks like a (possibly abbreviated) commit id.
pub fn looks_like_commit(reference: &str) -> bool {
    (7..=64).contains(&reference.len()) && reference.chars().all(|c| c.is_ascii_hexdigit())
}

/// Keeps `.forge/` out of every snapshot and commit of a repository.
pub(crate) async fn exclude_forge(repo: &Repo) -> Result<(), GitError> {
    let info = repo.git_dir.join("info");
    let exclude = info.join("exclude");
    let mut text = tokio::fs::read_to_string(&exclude)
        .await
        .unwrap_or_default();
    if !text.lines().any(|l| l == "/.forge/") {
        text.push_str("\n/.forge/\n");
        tokio::fs::create_dir_all(&info)
            .await
            .map_err(GitError::Files)?;
        tokio::fs::write(&exclude, text)
            .await
            .map_err(GitError::Files)?;
    }
    Ok(())
}

/// Records the work tree (everything but `.forge/`, `.git` and what `.gitignore` ignores) and
/// returns its tree id. A change that adds or moves a gitlink (a nested repository) is
/// refused: its commit id would come from a folder the agent chose.
pub async fn snapshot_tree(repo: &Repo) -> Result<String, GitError> {
    repo.git_in_tree(&["add", "--all"]).await?;
    repo.git_in_tree(&[
        "rm",
        "-r",
        "--cached",
        "--quiet",
        "--ignore-unmatch",
        "--",
        ".forge",
    ])
    .await?;
    let changed = repo
        .git(&["diff-index", "--cached", "--raw", "--no-renames", "base"])
        .await?;
    if let Some(path) = changed.lines().find_map(|line| {
        let (meta, path) = line.split_once('\t')?;
        meta.split_whitespace()
            .nth(1)
            .filter(|mode| *mode == "160000")
            .map(|_| path.to_string())
    }) {
        return Err(GitError::Refused(format!(
            "the change adds a nested git repository at `{path}`; forgepool does not deliver gitlinks: remove its .git folder"
        )));
    }
    repo.git(&["write-tree"]).await
}

/// Makes a commit of `tree` on `parent`, dated `date` so the same inputs give the same commit.
pub async fn commit_tree(
    repo: &Repo,
    tree: &str,
    parent: &str,
    message: &str,
    date: &str,
) -> Result<String, GitError> {
    let env = [("GIT_AUTHOR_DATE", date), ("GIT_COMMITTER_DATE", date)];
    let git_dir = format!("--git-dir={}", repo.git_dir.display());
    git_with_env(
        &repo.git_dir,
        &[&git_dir, "commit-tree", tree, "-p", parent, "-m", message],
        &env,
    )
    .await
}

/// Makes a fresh copy of `repo` at `dest` with `commit` checked out and `base` as a branch, so
/// `git diff base...HEAD` shows the change. The copy shares nothing writable with `repo`: its
/// object files are hard links (git's local clone), read-only and owned by the worker, and a
/// file with other links is never handed to a stage user.
pub async fn copy_at(repo: &Repo, commit: &str, base: &str, dest: &Path) -> Result<(), GitError> {
    repo.git(&["update-ref", "refs/heads/forgepool-candidate", commit])
        .await?;
    let parent = dest.parent().unwrap_or(Path::new("/"));
    let source = repo.git_dir.to_string_lossy();
    let dest_text = dest.to_string_lossy();
    let mut args = vec!["-c", "protocol.file.allow=always", "clone", "--quiet"];
    // Object files are linked (git's local clone) only when a stage cannot own them.
    if !shareable(&repo.git_dir) {
        args.push("--no-hardlinks");
    }
    args.extend(["--branch", "forgepool-candidate", "--", &source, &dest_text]);
    git(parent, &args).await?;
    git(dest, &["branch", "--force", "base", base]).await?;
    git(dest, &["remote", "remove", "origin"]).await?;
    Ok(())
}

/// The change from `base` to `commit` as a binary-safe patch.
pub async fn diff(repo: &Repo, base: &str, commit: &str) -> Result<String, GitError> {
    repo.git(&[
        "diff",
        "--binary",
        "--no-ext-diff",
        "--no-textconv",
        base,
        commit,
    ])
    .await
}

/// Pushes `commit` to `branch` of `url`, replacing what the branch held.
pub async fn push(
    repo: &Repo,
    url: &str,
    commit: &str,
    branch: &str,
    replaces: Option<&str>,
) -> Result<(), GitError> {
    proto::names::check_url(url, &allowed_schemes())
        .map_err(|reason| GitError::Refused(format!("repository URL refused: {reason}")))?;
    // Conditional on what was seen: the branch must still hold `replaces` (or not exist), so a
    // concurrent push is never lost.
    let lease = format!(
        "--force-with-lease=refs/heads/{branch}:{}",
        replaces.unwrap_or("")
    );
    let refspec = format!("{commit}:refs/heads/{branch}");
    repo.git(&[
        "push",
        "--quiet",
        "--no-verify",
        &lease,
        "--",
        url,
        &refspec,
    ])
    .await
    .map(|_| ())
}

/// The trailer that names the run a delivery commit belongs to.
pub const RUN_TRAILER: &str = "Forgepool-Run";

/// The commit `branch` holds at `url` and the run its trailer names, `None` when the branch
/// does not exist. The commit is fetched into the run's repository to read its message.
pub async fn remote_delivery(
    repo: &Repo,
    url: &str,
    branch: &str,
) -> Result<Option<(String, Option<String>)>, GitError> {
    proto::names::check_url(url, &allowed_schemes())
        .map_err(|reason| GitError::Refused(format!("repository URL refused: {reason}")))?;
    let reference = format!("refs/heads/{branch}");
    let listed = repo.git(&["ls-remote", "--", url, &reference]).await?;
    let Some(commit) = listed
        .lines()
        .find(|line| line.ends_with(&format!("\t{reference}")))
        .and_then(|line| line.split('\t').next())
        .map(str::to_string)
    else {
        return Ok(None);
    };
    let seen = "refs/forgepool/seen";
    repo.git(&[
        "fetch",
        "--quiet",
        "--no-tags",
        "--",
        url,
        &format!("+{reference}:{seen}"),
    ])
    .await?;
    let message = repo.git(&["log", "-1", "--format=%B", &commit]).await?;
    Ok(Some((commit, run_of(&message))))
}

/// The run id a commit message's last `Forgepool-Run:` trailer names.
pub fn run_of(message: &str) -> Option<String> {
    message
        .lines()
        .rev()
        .find_map(|line| line.strip_prefix(RUN_TRAILER)?.strip_prefix(':'))
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty())
}

/// The change from `base` (a commit) to `tree`, as a patch that [`apply_checkpoint`] replays
/// exactly. Every file is encoded as binary, so the patch is ASCII whatever the files hold.
pub async fn checkpoint_patch(repo: &Repo, base: &str, tree: &str) -> Result<String, GitError> {
    // `info/attributes` outranks the repository's own `.gitattributes`; it is only in place
    // for this one diff, since `binary` also changes how files are added.
    let info = repo.git_dir.join("info");
    let attributes = info.join("attributes");
    let previous = tokio::fs::read(&attributes).await.ok();
    tokio::fs::create_dir_all(&info)
        .await
        .map_err(GitError::Files)?;
    tokio::fs::write(&attributes, "* binary\n")
        .await
        .map_err(GitError::Files)?;
    let patch = repo
        .git(&[
            "diff",
            "--binary",
            "--full-index",
            "--no-textconv",
            "--no-ext-diff",
            base,
            tree,
        ])
        .await;
    let restored = match previous {
        Some(bytes) => tokio::fs::write(&attributes, bytes).await,
        None => tokio::fs::remove_file(&attributes).await,
    };
    restored.map_err(GitError::Files)?;
    patch
}

/// Replays a [`checkpoint_patch`] on the checked-out base and returns the resulting tree.
pub async fn apply_checkpoint(repo: &Repo, patch: &str) -> Result<String, GitError> {
    if !patch.trim().is_empty() {
        let file = repo.git_dir.join("forgepool-resume.patch");
        // A binary hunk ends with a blank line, which the captured output lost.
        tokio::fs::write(&file, format!("{}\n\n", patch.trim_end()))
            .await
            .map_err(GitError::Files)?;
        let path = file.to_string_lossy().to_string();
        repo.git_in_tree(&["apply", "--binary", "--index", "--whitespace=nowarn", &path])
            .await?;
    }
    snapshot_tree(repo).await
}

/// Copies the folder `from` to `to`: folders and regular files only (a git folder that
/// forgepool made holds nothing else).
/// Copies the folder `from` (a git folder forgepool made) to `to`. With `link`, files are
/// hard-linked (copied when the link fails, as across devices); the `objects` folder below
/// is always linked: object files are immutable.
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

    fn repo_at(dir: &Path, name: &str) -> Repo {
        Repo::new(dir.join(format!("{name}.git")), dir.join(name))
    }

    async fn checked_out(repo: &Repo) -> (String, String, String, bool) {
        let head = repo.git(&["rev-parse", "HEAD"]).await.unwrap();
        let base = repo.git(&["rev-parse", "base"]).await.unwrap();
        let file = tokio::fs::read_to_string(repo.work_tree.join("a.txt"))
            .await
            .unwrap();
        let detached = repo.git(&["symbolic-ref", "-q", "HEAD"]).await.is_err();
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
            let dest = repo_at(dir.path(), &format!("clone{n}"));
            let got = clone_at(&url, reference, &dest).await.unwrap();
            assert!(
                !dest.work_tree.join(".git").exists(),
                "the work tree holds no .git until forgepool gives it a disposable one"
            );
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
            let exclude = tokio::fs::read_to_string(dest.git_dir.join("info/exclude"))
                .await
                .unwrap();
            assert!(exclude.lines().any(|l| l == "/.forge/"), "{reference:?}");
        }
        // Copies, never hardlinks: a stage user owning the clone cannot touch the origin.
        let object = dir.path().join("clone1.git/objects");
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
        let error = clone_at(&url, Some("nope"), &repo_at(dir.path(), "c"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("no branch, tag or commit named `nope`"),
            "{error}"
        );
    }
}
