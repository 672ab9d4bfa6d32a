//! Layered workspaces (SPEC 14): a run's work tree, its verification copies and its
//! reviewers' copies are overlay mounts of a checkout kept in the repository cache, so a run
//! on a 50,000-file repository writes only the files its stages change.
//!
//! A layered folder `X` keeps its writable layer in `X.layer`: `upper/` (what was written in
//! `X`), `work/` (the overlay's own), and `git/`, the stages' disposable git folder, mounted at
//! `/workspace/.git` (its object files are hard links to the run's private git folder, which
//! cannot cross into an overlay). The cached checkout below is never written: a change makes a
//! copy of the file in `upper/` (with a new ctime, so git's stat check always sees it).
//!
//! Only a root worker mounts, and only where the Docker engine sees the worker's mounts (the
//! same mount namespace): `FORGEPOOL_OVERLAY_WORKSPACES` (`auto`, `true`, `false`). `auto`
//! turns it on for a root worker when a `dockerd` runs in its mount namespace and a probe
//! mount works. Elsewhere (a Kubernetes pod, a Docker-in-Docker sidecar) the engine would see
//! the empty folder under the mount, so `auto` stays off there.
//!
//! `remove_folder` detaches every mount under a folder before removing it; handing a layered
//! folder to the stage user walks only its upper layer. Everything else falls back to
//! checked-out folders. Overlays, not reflinks or worktrees: ext4 (Debian's default) has no
//! reflinks, and a worktree still writes every file.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tracing::{info, warn};

static ENABLED: OnceLock<bool> = OnceLock::new();

/// Whether this process makes layered workspaces (decided once by [`configure`]).
pub fn enabled() -> bool {
    ENABLED.get().copied().unwrap_or(false)
}

/// `FORGEPOOL_OVERLAY_WORKSPACES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setting {
    /// On for a root worker outside a container, when a probe mount works.
    Auto,
    /// On; the worker refuses to start when it cannot mount.
    On,
    /// Off: every workspace is checked out.
    Off,
}

impl std::str::FromStr for Setting {
    type Err = String;

    fn from_str(text: &str) -> Result<Setting, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Setting::Auto),
            "true" | "on" | "1" | "yes" => Ok(Setting::On),
            "false" | "off" | "0" | "no" => Ok(Setting::Off),
            other => Err(format!(
                "FORGEPOOL_OVERLAY_WORKSPACES is `{other}`; expected auto, true or false"
            )),
        }
    }
}

/// Decides, once for the process, whether workspaces are layered; `dir` (the repository
/// cache's folder) holds the probe mount. `On` that cannot mount is an error naming why.
pub fn configure(setting: Setting, dir: &Path) -> Result<bool, String> {
    let decided = match setting {
        Setting::Off => false,
        Setting::Auto if !is_root() => false,
        Setting::Auto if !engine_shares_mounts() => {
            info!("layered workspaces are off: no Docker engine runs in this worker's mount namespace (FORGEPOOL_OVERLAY_WORKSPACES=true turns them on where the engine sees the worker's mounts)");
            false
        }
        Setting::Auto => match probe(dir) {
            Ok(()) => true,
            Err(error) => {
                info!(%error, "layered workspaces are off: an overlay cannot be mounted here");
                false
            }
        },
        Setting::On => {
            probe(dir).map_err(|e| {
                format!("FORGEPOOL_OVERLAY_WORKSPACES=true, but an overlay cannot be mounted in {}: {e} (it needs a root worker and overlayfs)", dir.display())
            })?;
            true
        }
    };
    let _ = ENABLED.set(decided);
    Ok(enabled())
}

/// The folder holding the writable layer of the layered folder `folder`.
pub fn layer_dir(folder: &Path) -> PathBuf {
    let mut name = folder.as_os_str().to_owned();
    name.push(".layer");
    PathBuf::from(name)
}

/// The stages' git folder of the layered folder `folder`, when it has one.
pub fn stage_git(folder: &Path) -> Option<PathBuf> {
    let git = layer_dir(folder).join("git");
    git.is_dir().then_some(git)
}

/// The upper layer of `folder` when it is layered: everything written in it is there.
pub fn upper_of(folder: &Path) -> Option<PathBuf> {
    let upper = layer_dir(folder).join("upper");
    upper.is_dir().then_some(upper)
}

/// Mounts an overlay at `target` (made when missing) of the read-only `lower`, its writable
/// layer in [`layer_dir`] of `target`, the upper layer's root owned by `owner`. Blocking.
pub fn mount(lower: &Path, target: &Path, owner: (u32, u32)) -> std::io::Result<()> {
    let layer = layer_dir(target);
    let (upper, work) = (layer.join("upper"), layer.join("work"));
    for dir in [&upper, &work, &target.to_path_buf()] {
        std::fs::create_dir_all(dir)?;
    }
    std::os::unix::fs::chown(&upper, Some(owner.0), Some(owner.1))?;
    let mut options = String::from("lowerdir=");
    for (n, path) in [lower, &upper, &work].into_iter().enumerate() {
        let text = path.to_str().filter(|t| !t.contains([',', ':', '\\']));
        let Some(text) = text else {
            return Err(std::io::Error::other(format!(
                "{} cannot be an overlay layer (its path has a comma, colon or backslash)",
                path.display()
            )));
        };
        match n {
            0 => {}
            1 => options.push_str(",upperdir="),
            _ => options.push_str(",workdir="),
        }
        options.push_str(text);
    }
    let data = std::ffi::CString::new(options).map_err(std::io::Error::other)?;
    rustix::mount::mount(
        "overlay",
        target,
        "overlay",
        rustix::mount::MountFlags::NODEV | rustix::mount::MountFlags::NOSUID,
        data.as_c_str(),
    )?;
    Ok(())
}

/// Removes a folder of the run, and the writable layer beside it; every overlay mounted
/// at or under it is detached first (never deleted through).
pub async fn remove_folder(path: &Path) -> std::io::Result<()> {
    let (folder, layer) = (path.to_path_buf(), layer_dir(path));
    tokio::task::spawn_blocking(move || {
        unmount_under(&folder);
        for dir in [&folder, &layer] {
            match std::fs::remove_dir_all(dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
        }
        Ok(())
    })
    .await
    .map_err(std::io::Error::other)?
}

/// Detaches every mount at or under `path`, deepest first, and returns how many. Blocking.
pub fn unmount_under(path: &Path) -> usize {
    // The mount table holds resolved paths.
    let resolved = std::fs::canonicalize(path);
    let path = resolved.as_deref().unwrap_or(path);
    let mut inside: Vec<PathBuf> = mount_points()
        .into_iter()
        .filter(|point| point.starts_with(path))
        .collect();
    inside.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    let mut detached = 0;
    for point in inside {
        match rustix::mount::unmount(&point, rustix::mount::UnmountFlags::DETACH) {
            Ok(()) => detached += 1,
            Err(error) => {
                warn!(%error, path = %point.display(), "cannot unmount a layered workspace")
            }
        }
    }
    detached
}

/// The mount points of this process's namespace (`/proc/self/mountinfo`, field 5).
pub fn mount_points() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(unescape(field)))
        .collect()
}

/// mountinfo writes a space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(digits)) => {
                let value = digits.iter().fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
                out.push(value as u8);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether a Docker engine (`dockerd`) runs in this process's mount namespace, so that it
/// sees the worker's mounts. A worker in a Kubernetes pod, or beside a Docker-in-Docker
/// sidecar, sees no `dockerd` of its namespace.
fn engine_shares_mounts() -> bool {
    let Ok(ours) = std::fs::read_link("/proc/self/ns/mnt") else {
        return false;
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let pid = entry.path();
        std::fs::read_to_string(pid.join("comm")).is_ok_and(|c| c.trim() == "dockerd")
            && std::fs::read_link(pid.join("ns/mnt")).is_ok_and(|theirs| theirs == ours)
    })
}

/// Mounts and unmounts an overlay of an empty folder under `dir`.
fn probe(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let root = tempfile::Builder::new()
        .prefix(".overlay-probe-")
        .tempdir_in(dir)?;
    let lower = root.path().join("lower");
    std::fs::create_dir_all(&lower)?;
    std::fs::write(lower.join("probe"), b"lower")?;
    let target = root.path().join("merged");
    mount(&lower, &target, (0, 0))?;
    let seen = std::fs::read(target.join("probe"));
    unmount_under(root.path());
    match seen {
        Ok(bytes) if bytes == b"lower" => Ok(()),
        Ok(_) => Err(std::io::Error::other(
            "the probe overlay showed the wrong content",
        )),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_read_back() {
        assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
        assert_eq!(unescape(r"/plain/path"), "/plain/path");
        assert_eq!(unescape(r"/odd\04"), r"/odd\04");
    }

    #[test]
    fn settings_are_parsed_and_a_wrong_one_is_named() {
        assert_eq!("auto".parse::<Setting>(), Ok(Setting::Auto));
        assert_eq!("TRUE".parse::<Setting>(), Ok(Setting::On));
        assert_eq!("false".parse::<Setting>(), Ok(Setting::Off));
        let error = "sometimes".parse::<Setting>().unwrap_err();
        assert!(error.contains("FORGEPOOL_OVERLAY_WORKSPACES") && error.contains("sometimes"));
    }

    #[test]
    fn a_layered_folder_shows_its_lower_and_keeps_writes_in_its_upper() {
        assert!(
            is_root(),
            "this test mounts an overlay: run the tests as root (.ci/run does)"
        );
        let dir = tempfile::tempdir().unwrap();
        let lower = dir.path().join("lower");
        std::fs::create_dir_all(&lower).unwrap();
        std::fs::write(lower.join("kept"), b"base").unwrap();
        let target = dir.path().join("ws");
        mount(&lower, &target, (65_534, 65_534)).unwrap();
        assert_eq!(std::fs::read(target.join("kept")).unwrap(), b"base");
        std::fs::write(target.join("kept"), b"changed").unwrap();
        std::fs::write(target.join("new"), b"new").unwrap();
        // The cached checkout is untouched; the change is in the upper layer.
        assert_eq!(std::fs::read(lower.join("kept")).unwrap(), b"base");
        assert!(!lower.join("new").exists());
        let upper = upper_of(&target).unwrap();
        assert_eq!(std::fs::read(upper.join("kept")).unwrap(), b"changed");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&target).unwrap().uid(), 65_534);
        assert!(mount_points().contains(&target));
        assert_eq!(unmount_under(dir.path()), 1);
        assert!(!mount_points().contains(&target));
    }
}
