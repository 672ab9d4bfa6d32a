//! Reviewers' copies made of hard links: a read-only copy of the candidate for a reviewer or
//! the final reviewer, made from the run's work tree without writing its files again.
//!
//! Checking out a 50,000-file tree for each review costs seconds; linking it costs a tenth
//! of that. The copy is exactly the candidate: it is made only when the run's index is the
//! snapshot of the candidate's tree (so the work tree holds those files as recorded: the
//! implementer's container is gone, and nothing else writes there), it holds only the paths
//! the tree records, each checked to be of the recorded kind with no symbolic link on its way,
//! and it is mounted read-only, so a reviewer cannot change a linked file. A work tree that
//! does not match gives `false`, and the caller checks a copy out instead.

use std::collections::HashSet;
use std::path::{Component, Path, PathBuf};

use crate::workspace::git::{self, GitError, Repo};

/// Makes a reviewer's copy of `commit` (tree `tree`, on `base`) at `dest`: hard links to the
/// work tree's files, and a git folder with the commit checked out as `forgepool-candidate`
/// and `base` as a branch. `Ok(false)` when the work tree does not hold `tree` as recorded.
pub async fn link_copy(
    repo: &Repo,
    commit: &str,
    tree: &str,
    base: &str,
    dest: &Path,
) -> Result<bool, GitError> {
    if repo.git(&["write-tree"]).await? != tree {
        return Ok(false);
    }
    let listing = repo.git(&["ls-files", "--stage", "-z"]).await?;
    let mut entries = Vec::new();
    for record in listing.split('\0').filter(|r| !r.is_empty()) {
        let Some((meta, path)) = record.split_once('\t') else {
            return Ok(false);
        };
        let mode = meta.split_whitespace().next().unwrap_or_default();
        if mode == "160000" {
            return Ok(false);
        }
        entries.push((mode == "120000", path.to_string()));
    }
    let (work_tree, git_dir, target) = (
        repo.work_tree.clone(),
        repo.git_dir.clone(),
        dest.to_path_buf(),
    );
    let linked = tokio::task::spawn_blocking(move || -> std::io::Result<bool> {
        if !link_files(&work_tree, &target, &entries)? {
            return Ok(false);
        }
        // The index is the snapshot's: its stat data are the linked files'. A link changes a
        // file's ctime, so the copy does not trust ctime.
        git::disposable_git(
            &git_dir,
            &target.join(".git"),
            "[core]\n\ttrustctime = false\n",
        )?;
        Ok(true)
    })
    .await
    .map_err(|e| GitError::Files(std::io::Error::other(e)))?
    .map_err(GitError::Files)?;
    if !linked {
        return Ok(false);
    }
    git::git(
        dest,
        &["update-ref", "refs/heads/forgepool-candidate", commit],
    )
    .await?;
    git::git(
        dest,
        &["symbolic-ref", "HEAD", "refs/heads/forgepool-candidate"],
    )
    .await?;
    git::git(dest, &["branch", "--force", "base", base]).await?;
    Ok(true)
}

/// Links each recorded path of `work_tree` into `dest`; `false` when one is missing, of
/// another kind than recorded, outside the tree, or reached through a symbolic link.
fn link_files(work_tree: &Path, dest: &Path, entries: &[(bool, String)]) -> std::io::Result<bool> {
    std::fs::create_dir_all(dest)?;
    let mut folders: HashSet<PathBuf> = HashSet::new();
    for (symlink, path) in entries {
        let relative = Path::new(path);
        if !relative
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
        {
            return Ok(false);
        }
        // Every folder on the way is a real folder of the work tree, made in the copy once.
        let mut folder = PathBuf::new();
        for part in relative.parent().into_iter().flat_map(Path::components) {
            folder.push(part);
            if folders.contains(&folder) {
                continue;
            }
            match std::fs::symlink_metadata(work_tree.join(&folder)) {
                Ok(meta) if meta.is_dir() => {}
                _ => return Ok(false),
            }
            std::fs::create_dir_all(dest.join(&folder))?;
            folders.insert(folder.clone());
        }
        let source = work_tree.join(relative);
        let Ok(meta) = std::fs::symlink_metadata(&source) else {
            return Ok(false);
        };
        let kind_matches = if *symlink {
            meta.file_type().is_symlink()
        } else {
            meta.is_file()
        };
        if !kind_matches {
            return Ok(false);
        }
        // `link` does not follow a symbolic link: a recorded link is linked as a link. A
        // work tree on another file system (an overlay of the cache) cannot be linked: the
        // copy is checked out instead, which is no fault.
        match std::fs::hard_link(&source, dest.join(relative)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::XDEV.raw_os_error()) => {
                return Ok(false)
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a linked copy that differs from the candidate (an extra, missing or changed
    /// file), one made through a symbolic link out of the work tree, or one whose git folder
    /// does not show the change against `base`.
    #[tokio::test]
    async fn a_linked_copy_is_the_candidate_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let origin = dir.path().join("origin.git");
        let seed = dir.path().join("seed");
        std::fs::create_dir_all(seed.join("src")).unwrap();
        let sh = |cwd: &Path, args: &[&str]| {
            let out = std::process::Command::new("git")
                .args(["-c", "user.name=t", "-c", "user.email=t@t"])
                .args(args)
                .current_dir(cwd)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        sh(
            dir.path(),
            &[
                "init",
                "--quiet",
                "--bare",
                "--initial-branch=main",
                origin.to_str().unwrap(),
            ],
        );
        sh(&seed, &["init", "--quiet", "--initial-branch=main"]);
        std::fs::write(seed.join("src/a.txt"), "a\n").unwrap();
        std::os::unix::fs::symlink("a.txt", seed.join("src/link")).unwrap();
        sh(&seed, &["add", "-A"]);
        sh(&seed, &["commit", "--quiet", "-m", "one"]);
        sh(
            &seed,
            &["push", "--quiet", origin.to_str().unwrap(), "HEAD:main"],
        );

        let run = dir.path().join("run");
        std::fs::create_dir_all(&run).unwrap();
        let repo = Repo::new(run.join("repo.git"), run.join("src"));
        let url = format!("file://{}", origin.display());
        let base = git::clone_at(&url, Some("main"), &repo).await.unwrap();
        std::fs::write(repo.work_tree.join("src/a.txt"), "changed\n").unwrap();
        std::fs::write(repo.work_tree.join("new.txt"), "new\n").unwrap();
        let tree = git::snapshot_tree(&repo).await.unwrap();
        let commit = git::commit_tree(&repo, &tree, &base, "candidate", "1700000000 +0000")
            .await
            .unwrap();
        // Not part of the candidate: must not reach the copy.
        std::fs::create_dir_all(repo.work_tree.join(".forge")).unwrap();
        std::fs::write(repo.work_tree.join(".forge/note"), "x").unwrap();

        let dest = run.join("review-1");
        assert!(link_copy(&repo, &commit, &tree, &base, &dest)
            .await
            .unwrap());
        assert_eq!(
            std::fs::read_to_string(dest.join("src/a.txt")).unwrap(),
            "changed\n"
        );
        assert_eq!(
            std::fs::read_link(dest.join("src/link")).unwrap(),
            Path::new("a.txt")
        );
        assert!(!dest.join(".forge").exists());
        assert_eq!(
            sh(&dest, &["status", "--porcelain", "--untracked-files=all"]),
            ""
        );
        assert_eq!(sh(&dest, &["rev-parse", "HEAD"]), commit);
        assert_eq!(
            sh(&dest, &["diff", "--name-only", "base...HEAD"]),
            "new.txt\nsrc/a.txt"
        );

        // A folder swapped for a symbolic link out of the tree: no copy is linked.
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("a.txt"), "host\n").unwrap();
        std::fs::rename(repo.work_tree.join("src"), run.join("moved")).unwrap();
        std::os::unix::fs::symlink(&outside, repo.work_tree.join("src")).unwrap();
        let other = run.join("review-2");
        assert!(!link_copy(&repo, &commit, &tree, &base, &other)
            .await
            .unwrap());
    }
}
