//! git as the stage user: how a root worker runs the git that writes a cached checkout, so
//! the files are that user's from the start (see [`super::git_as`]).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tokio::process::Command;

/// The `git` command, run as `user` when one is given.
pub(super) fn command(user: Option<(u32, u32)>) -> Command {
    match (user, reader()) {
        (Some((uid, gid)), Some(setpriv)) => {
            // As the user, with one capability: to read and traverse any folder, so git
            // reaches a cache under a work folder only root may open. It writes only where
            // the user may; no other capability, none gained by exec.
            let mut command = Command::new(setpriv);
            command
                .args(["--reuid", &uid.to_string(), "--regid", &gid.to_string()])
                .args(["--clear-groups", "--no-new-privs"])
                // So that `access(2)`, which git asks before it opens a repository, counts
                // the capability too (it drops capabilities for a user that is not root).
                .arg("--securebits=+no_setuid_fixup")
                .args([
                    "--inh-caps=-all,+dac_read_search",
                    "--ambient-caps=+dac_read_search",
                ])
                .args(["--bounding-set=-all,+dac_read_search", "git"])
                .env("HOME", "/");
            command
        }
        (Some((uid, gid)), None) => {
            // Supplementary groups are dropped too (the standard library does when root sets uid).
            let mut command = Command::new("git");
            command.uid(uid).gid(gid).env("HOME", "/");
            command
        }
        (None, _) => Command::new("git"),
    }
}

/// util-linux's `setpriv`, when the worker is root, has it and may hand on
/// `CAP_DAC_READ_SEARCH` (a container's default capabilities lack it): git then runs as the
/// stage user with that capability alone.
fn reader() -> Option<&'static Path> {
    static SETPRIV: OnceLock<Option<PathBuf>> = OnceLock::new();
    SETPRIV
        .get_or_init(|| {
            let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
            let root = status_field(&status, "Uid:").is_some_and(|uids| uids.starts_with("0\t"));
            let bounding = status_field(&status, "CapBnd:")
                .and_then(|hex| u64::from_str_radix(hex, 16).ok())
                .unwrap_or(0);
            let root = root && bounding & (1 << CAP_DAC_READ_SEARCH) != 0;
            ["/usr/bin/setpriv", "/bin/setpriv"]
                .into_iter()
                .map(PathBuf::from)
                .find(|path| root && path.is_file())
        })
        .as_deref()
}

/// The capability's number (`linux/capability.h`).
const CAP_DAC_READ_SEARCH: u32 = 2;

/// The value of a `/proc/PID/status` field.
fn status_field<'a>(status: &'a str, name: &str) -> Option<&'a str> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    /// Catches: a status field misread, which would send git through `setpriv` where the
    /// capability cannot be handed on (every fresh checkout failing once first).
    #[test]
    fn status_fields_are_read() {
        let status = "Name:\tx\nUid:\t0\t0\t0\t0\nCapBnd:\t000001fffeffffff\n";
        assert_eq!(super::status_field(status, "Uid:"), Some("0\t0\t0\t0"));
        assert_eq!(
            super::status_field(status, "CapBnd:"),
            Some("000001fffeffffff")
        );
        assert_eq!(super::status_field(status, "CapEff:"), None);
    }
}
