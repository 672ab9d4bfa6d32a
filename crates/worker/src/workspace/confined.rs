//! Files in agent-writable folders, read and written without ever following a symlink.
//!
//! Everything an agent can write (the workspace, its `.forge/` folder, `/forge/output`) may
//! hold symlinks, FIFOs or devices, and may change between a check and a use. A [`Confined`]
//! is an open handle on a folder: every path below it is walked one component at a time with
//! `O_NOFOLLOW`, so a symlink anywhere on the way fails the operation instead of leading
//! elsewhere, and nothing is looked up by path twice. Files are opened `O_NONBLOCK` and
//! checked on the open handle (a regular file, under the size limit) before a bounded read,
//! so a FIFO or a device never blocks a stage. forgepool's own writes into these folders go
//! through the same handles: a temporary file created exclusively, then a rename that replaces
//! whatever entry (a symlink included) was there.
//!
//! Every call is blocking: call it from a blocking task.
//!
//! `disk_usage` measures a stage's writable folders the same way.

use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{self as fs, FileType, Mode, OFlags};

/// The most entries [`Confined::entries`] lists in one folder.
pub const MAX_ENTRIES: usize = 10_000;

/// An open folder that paths are resolved beneath, never through a symlink.
#[derive(Debug)]
pub struct Confined {
    dir: OwnedFd,
    path: PathBuf,
}

/// What kind of entry a folder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A folder.
    Dir,
    /// A symlink, a FIFO, a socket or a device: never read.
    Other,
}

/// Why a confined read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file does not exist.
    #[error("does not exist")]
    Missing,
    /// A component of the path, or the file itself, is a symlink.
    #[error("is reached through a symlink, which is never followed")]
    Symlink,
    /// The file is a folder, a FIFO, a socket or a device.
    #[error("is not a regular file")]
    NotRegular,
    /// The file is larger than the limit.
    #[error("is {size} bytes, over the limit of {limit}")]
    TooLarge {
        /// Its size when it was opened (or what was read of it).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The path is absolute or has `..`.
    #[error("is not a plain relative path")]
    BadPath,
    /// Another error.
    #[error("{0}")]
    Io(io::Error),
}

impl From<io::Error> for ReadError {
    fn from(error: io::Error) -> ReadError {
        ReadError::Io(error)
    }
}

impl Confined {
    /// Opens a folder the worker owns (the run's root or one of its own folders). The path's
    /// last component must not be a symlink.
    pub fn open(path: &Path) -> io::Result<Confined> {
        let dir = fs::open(path, dir_flags(), Mode::empty())?;
        Ok(Confined {
            dir,
            path: path.to_path_buf(),
        })
    }

    /// The folder's path, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the folder `relative` below this one, refusing a symlink at any component.
    pub fn subdir(&self, relative: &Path) -> Result<Confined, ReadError> {
        let parts = components(relative)?;
        let mut current =
            fs::openat(&self.dir, ".", dir_flags(), Mode::empty()).map_err(io::Error::from)?;
        for part in &parts {
            current = open_dir_at(&current, part)?;
        }
        Ok(Confined {
            dir: current,
            path: self.path.join(relative),
        })
    }

    /// Opens the folder `relative` below this one, creating the folders that are missing.
    /// A symlink at any component fails it.
    pub fn create_subdir(&self, relative: &Path) -> Result<Confined, ReadError> {
        let parts = components(relative)?;
        let mut current =
            fs::openat(&self.dir, ".", dir_flags(), Mode::empty()).map_err(io::Error::from)?;
        for part in &parts {
            match fs::mkdirat(&current, part.as_os_str(), Mode::from_raw_mode(0o755)) {
                Ok(()) | Err(rustix::io::Errno::EXIST) => {}
                Err(error) => return Err(ReadError::Io(error.into())),
            }
            current = open_dir_at(&current, part)?;
        }
        Ok(Confined {
            dir: current,
            path: self.path.join(relative),
        })
    }

    /// Reads the regular file `relative`, at most `limit` bytes; anything else is an error.
    pub fn read(&self, relative: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
        let mut parts = components(relative)?;
        let name = parts.pop().ok_or(ReadError::BadPath)?;
        let parent = if parts.is_empty() {
            fs::openat(&self.dir, ".", dir_flags(), Mode::empty()).map_err(io::Error::from)?
        } else {
            let mut current =
                fs::openat(&self.dir, ".", dir_flags(), Mode::empty()).map_err(io::Error::from)?;
            for part in &parts {
                current = open_dir_at(&current, part)?;
            }
            current
        };
        read_at(&parent, &name, limit)
    }

    /// The entries of this folder (without `.` and `..`), at most [`MAX_ENTRIES`], with their
    /// kinds as the folder lists them (never by following a symlink).
    pub fn entries(&self) -> io::Result<Vec<(String, EntryKind)>> {
        self.entries_up_to(MAX_ENTRIES)
    }

    /// Like [`Confined::entries`], at most `limit` of them.
    pub fn entries_up_to(&self, limit: usize) -> io::Result<Vec<(String, EntryKind)>> {
        let handle = fs::openat(&self.dir, ".", dir_flags(), Mode::empty())?;
        let mut dir = fs::Dir::read_from(&handle)?;
        let mut found = Vec::new();
        while let Some(entry) = dir.read() {
            let entry = entry?;
            let name = entry.file_name().to_bytes();
            if name == b"." || name == b".." {
                continue;
            }
            let kind = match entry.file_type() {
                FileType::RegularFile => EntryKind::File,
                FileType::Directory => EntryKind::Dir,
                FileType::Unknown => {
                    match fs::statat(&handle, entry.file_name(), fs::AtFlags::SYMLINK_NOFOLLOW) {
                        Ok(stat) => kind_of(FileType::from_raw_mode(stat.st_mode)),
                        Err(_) => EntryKind::Other,
                    }
                }
                _ => EntryKind::Other,
            };
            found.push((String::from_utf8_lossy(name).into_owned(), kind));
            if found.len() >= limit {
                break;
            }
        }
        Ok(found)
    }

    /// The size, modification time (seconds, nanoseconds) and inode of the entry `name` of
    /// this folder, without following a symlink; `None` when it cannot be read.
    pub fn stamp(&self, name: &str) -> Option<(u64, i64, i64, u64)> {
        let stat = fs::statat(&self.dir, name, fs::AtFlags::SYMLINK_NOFOLLOW).ok()?;
        Some((
            u64::try_from(stat.st_size).unwrap_or(u64::MAX),
            stat.st_mtime,
            i64::try_from(stat.st_mtime_nsec).unwrap_or(0),
            stat.st_ino,
        ))
    }

    /// Writes `bytes` to the file `name` in this folder atomically: a new temporary file, then
    /// a rename over whatever `name` was (a symlink is replaced, never followed).
    pub fn write_atomically(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(io::Error::other(format!("{name:?} is not a file name")));
        }
        let temporary = format!(".{name}.forgepool-{}", uuid::Uuid::new_v4().simple());
        let fd = fs::openat(
            &self.dir,
            temporary.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )?;
        let mut file = std::fs::File::from(fd);
        let written = file.write_all(bytes).and_then(|()| file.sync_all());
        if let Err(error) = written {
            let _ = fs::unlinkat(&self.dir, temporary.as_str(), fs::AtFlags::empty());
            return Err(error);
        }
        if let Err(error) = fs::renameat(&self.dir, temporary.as_str(), &self.dir, name) {
            let _ = fs::unlinkat(&self.dir, temporary.as_str(), fs::AtFlags::empty());
            return Err(error.into());
        }
        Ok(())
    }
}

/// The disk space a folder's tree takes (allocated blocks, never through a symlink), up to
/// `limit` entries; `None` when there are more, or when a folder cannot be read (a tree that
/// cannot be measured is over any allowance).
pub fn disk_usage(root: &Path, limit: usize) -> Option<u64> {
    fn walk(dir: &Confined, total: &mut u64, seen: &mut usize, limit: usize, depth: usize) -> bool {
        let room = limit.saturating_sub(*seen) + 1;
        let Ok(entries) = dir.entries_up_to(room) else {
            return false;
        };
        for (name, kind) in entries {
            *seen += 1;
            if *seen > limit || depth > 256 {
                return false;
            }
            if let Ok(stat) = fs::statat(&dir.dir, name.as_str(), fs::AtFlags::SYMLINK_NOFOLLOW) {
                *total += u64::try_from(stat.st_blocks).unwrap_or(0) * 512;
            }
            if kind == EntryKind::Dir {
                match dir.subdir(Path::new(&name)) {
                    Ok(child) => {
                        if !walk(&child, total, seen, limit, depth + 1) {
                            return false;
                        }
                    }
                    // Removed since it was listed: nothing to count.
                    Err(ReadError::Missing) => {}
                    Err(_) => return false,
                }
            }
        }
        true
    }
    let root = Confined::open(root).ok()?;
    let (mut total, mut seen) = (0, 0);
    walk(&root, &mut total, &mut seen, limit, 0).then_some(total)
}

/// Reads one regular file of an agent-writable folder: `path` is walked from `root` (a folder
/// the worker owns) without following symlinks. A convenience over [`Confined`].
pub fn read_beneath(root: &Path, relative: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    Confined::open(root)?.read(relative, limit)
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

fn kind_of(file_type: FileType) -> EntryKind {
    match file_type {
        FileType::RegularFile => EntryKind::File,
        FileType::Directory => EntryKind::Dir,
        _ => EntryKind::Other,
    }
}

/// The plain components of a relative path; `..`, `.`, a root or an empty path are refused.
fn components(relative: &Path) -> Result<Vec<PathBuf>, ReadError> {
    let mut parts = Vec::new();
    for component in relative.components() {
        match component {
            Component::Normal(part) => parts.push(PathBuf::from(part)),
            Component::CurDir => {}
            _ => return Err(ReadError::BadPath),
        }
    }
    Ok(parts)
}

fn open_dir_at(parent: &OwnedFd, name: &Path) -> Result<OwnedFd, ReadError> {
    match fs::openat(parent, name.as_os_str(), dir_flags(), Mode::empty()) {
        Ok(fd) => Ok(fd),
        Err(rustix::io::Errno::NOENT) => Err(ReadError::Missing),
        // O_NOFOLLOW on a symlink gives ELOOP; O_DIRECTORY on anything else ENOTDIR.
        Err(rustix::io::Errno::LOOP) => Err(ReadError::Symlink),
        Err(rustix::io::Errno::NOTDIR) => {
            match fs::statat(parent, name.as_os_str(), fs::AtFlags::SYMLINK_NOFOLLOW) {
                Ok(stat) if FileType::from_raw_mode(stat.st_mode) == FileType::Symlink => {
                    Err(ReadError::Symlink)
                }
                _ => Err(ReadError::NotRegular),
            }
        }
        Err(error) => Err(ReadError::Io(error.into())),
    }
}

fn read_at(parent: &OwnedFd, name: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    let name: &OsStr = name.as_os_str();
    if name.as_bytes().is_empty() {
        return Err(ReadError::BadPath);
    }
    // O_NONBLOCK: opening a FIFO never waits for a writer; O_NOCTTY: a terminal never becomes
    // ours. The open handle is checked before a byte is read.
    let flags =
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC;
    let fd = match fs::openat(parent, name, flags, Mode::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) => return Err(ReadError::Missing),
        Err(rustix::io::Errno::LOOP) => return Err(ReadError::Symlink),
        Err(error) => return Err(ReadError::Io(error.into())),
    };
    let stat = fs::fstat(&fd).map_err(io::Error::from)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(ReadError::NotRegular);
    }
    let size = u64::try_from(stat.st_size).unwrap_or(u64::MAX);
    if size > limit {
        return Err(ReadError::TooLarge { size, limit });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    // The file may grow after the check: the read itself is bounded too.
    std::fs::File::from(fd)
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(ReadError::TooLarge {
            size: bytes.len() as u64,
            limit,
        });
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn reads_plain_files_and_refuses_symlinks_anywhere_on_the_way() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), "host secret").unwrap();
        std::fs::create_dir_all(dir.path().join("a/b")).unwrap();
        std::fs::write(dir.path().join("a/b/file.json"), "{}").unwrap();
        symlink(outside.path(), dir.path().join("a/link")).unwrap();
        symlink(outside.path().join("secret"), dir.path().join("a/b/leak")).unwrap();
        let root = Confined::open(dir.path()).unwrap();
        assert_eq!(root.read(Path::new("a/b/file.json"), 10).unwrap(), b"{}");
        assert!(matches!(
            root.read(Path::new("a/link/secret"), 100),
            Err(ReadError::Symlink)
        ));
        assert!(matches!(
            root.read(Path::new("a/b/leak"), 100),
            Err(ReadError::Symlink)
        ));
        assert!(matches!(
            root.subdir(Path::new("a/link")),
            Err(ReadError::Symlink)
        ));
        assert!(matches!(
            root.read(Path::new("../x"), 100),
            Err(ReadError::BadPath)
        ));
        assert!(matches!(
            root.read(Path::new("a/b/file.json"), 1),
            Err(ReadError::TooLarge { size: 2, limit: 1 })
        ));
        assert!(matches!(
            root.read(Path::new("a/b/none"), 1),
            Err(ReadError::Missing)
        ));
        let kinds: std::collections::HashMap<_, _> = root
            .subdir(Path::new("a"))
            .unwrap()
            .entries()
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(kinds["b"], EntryKind::Dir);
        assert_eq!(kinds["link"], EntryKind::Other);
    }

    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("review_cycle_1.json");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let root = Confined::open(dir.path()).unwrap();
        // Without O_NONBLOCK this open would wait for a writer for ever.
        assert!(matches!(
            root.read(Path::new("review_cycle_1.json"), 100),
            Err(ReadError::NotRegular)
        ));
    }

    #[test]
    fn writes_replace_a_symlink_instead_of_following_it() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("victim");
        std::fs::write(&target, "untouched").unwrap();
        symlink(&target, dir.path().join("history.json")).unwrap();
        let root = Confined::open(dir.path()).unwrap();
        root.write_atomically("history.json", b"[]").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "untouched");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("history.json")).unwrap(),
            "[]"
        );
        // A symlinked folder on the way fails the write instead of leading elsewhere.
        symlink(outside.path(), dir.path().join(".forge")).unwrap();
        assert!(matches!(
            root.create_subdir(Path::new(".forge/history")),
            Err(ReadError::Symlink)
        ));
        assert!(!outside.path().join("history").exists());
    }
}
