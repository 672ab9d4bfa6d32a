//! Copies of a worker's folders for stages: object files hard-linked where a stage cannot
//! own them, everything else copied.

use std::path::Path;

/// Copies `from` to `to`, hard-linking the shareable files of `objects/` (and of every folder
/// when `link`).
pub(crate) fn copy_tree(from: &Path, to: &Path, link: bool) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(
                &entry.path(),
                &target,
                link || entry.file_name() == "objects",
            )?;
        } else if kind.is_file() {
            if link && shareable(&entry.path()) && std::fs::hard_link(entry.path(), &target).is_ok()
            {
                continue;
            }
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// Removes a file or a folder.
pub(crate) fn remove_any(path: &Path) -> std::io::Result<()> {
    let metadata = std::fs::symlink_metadata(path)?;
    if metadata.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// Whether a file of a worker's git folder may be shared with a stage by hard link: only
/// when root owns it (stage users are never root; a worker that is not root runs stages as
/// itself, and they would own the file).
pub fn shareable(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.uid() == 0)
}
