//! The cycle collector: finds review cycle files in a workspace's `.forge/` folder (SPEC 8).
//!
//! The engine polls it while every stage runs and sweeps once more after each container exits,
//! so a file written just before exit is never missed. A file is reported when it is new or its
//! content changed; temporary files and anything that is not `{step}/review_cycle_{N}.json` with
//! a JSON object holding `cycle` and `verdict` are ignored until they become valid.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use proto::CycleRecord;

/// The largest cycle file read: 1 MiB.
pub const MAX_CYCLE_FILE_BYTES: u64 = 1024 * 1024;

/// Remembers which cycle files were already reported.
#[derive(Debug, Default)]
pub struct CycleCollector {
    forge_dir: PathBuf,
    seen: HashMap<PathBuf, u64>,
}

impl CycleCollector {
    /// A collector over `{workspace}/.forge`.
    pub fn new(workspace: &Path) -> CycleCollector {
        CycleCollector {
            forge_dir: workspace.join(".forge"),
            seen: HashMap::new(),
        }
    }

    /// Returns the cycle files that are new or changed since the last scan, ordered by step
    /// and cycle. Blocking: call it from a blocking task.
    pub fn scan(&mut self) -> Vec<CycleRecord> {
        let mut found = Vec::new();
        let Ok(steps) = std::fs::read_dir(&self.forge_dir) else {
            return found;
        };
        for step in steps.flatten() {
            let step_name = step.file_name().to_string_lossy().to_string();
            // Symlinks are never followed: a stage must not point the collector elsewhere.
            if step_name == "history" || !step.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let Ok(files) = std::fs::read_dir(step.path()) else {
                continue;
            };
            for file in files.flatten() {
                let name = file.file_name().to_string_lossy().to_string();
                let Some(cycle) = cycle_number(&name) else {
                    continue;
                };
                if !file.file_type().is_ok_and(|t| t.is_file()) {
                    continue;
                }
                let path = file.path();
                let Ok(bytes) = read_capped(&path) else {
                    continue;
                };
                let digest = fnv1a(&bytes);
                if self.seen.get(&path) == Some(&digest) {
                    continue;
                }
                let Some(record) = parse_cycle(&step_name, &name, cycle, &bytes) else {
                    continue;
                };
                self.seen.insert(path, digest);
                found.push(record);
            }
        }
        found.sort_by(|a, b| (&a.step, a.cycle).cmp(&(&b.step, b.cycle)));
        found
    }
}

/// `review_cycle_{N}.json` → N.
fn cycle_number(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("review_cycle_")?.strip_suffix(".json")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    let metadata = std::fs::symlink_metadata(path)?;
    if metadata.len() > MAX_CYCLE_FILE_BYTES {
        return Err(std::io::Error::other("cycle file too large"));
    }
    std::fs::read(path)
}

fn parse_cycle(step: &str, file: &str, cycle: u32, bytes: &[u8]) -> Option<CycleRecord> {
    let content: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let object = content.as_object()?;
    let verdict = object.get("verdict")?.as_str()?.to_ascii_lowercase();
    object.get("cycle")?.as_u64()?;
    Some(CycleRecord {
        step: step.to_string(),
        file: file.to_string(),
        cycle,
        max_cycles: object
            .get("max_cycles")
            .and_then(serde_json::Value::as_u64)
            .map(|n| n as u32),
        verdict,
        feedback: object
            .get("feedback")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_string(),
        content,
    })
}

/// A small content fingerprint to notice rewritten files.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes `bytes` to `path` atomically: a temporary file in the same folder, then a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("path has no parent"))?;
    std::fs::create_dir_all(dir)?;
    let mut temporary = tempfile::NamedTempFile::new_in(dir)?;
    std::io::Write::write_all(&mut temporary, bytes)?;
    temporary.as_file().sync_all()?;
    temporary.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, relative: &str, text: &str) {
        let path = dir.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }

    #[test]
    fn reports_new_and_changed_files_once() {
        let dir = tempfile::tempdir().unwrap();
        let mut collector = CycleCollector::new(dir.path());
        assert!(collector.scan().is_empty(), "no .forge folder yet");
        write(
            dir.path(),
            ".forge/implement_task/review_cycle_1.json",
            r#"{"cycle": 1, "verdict": "REJECTED", "feedback": "no tests", "max_cycles": 3}"#,
        );
        let found = collector.scan();
        assert_eq!(found.len(), 1);
        assert_eq!(
            (
                found[0].cycle,
                found[0].verdict.as_str(),
                found[0].feedback.as_str()
            ),
            (1, "rejected", "no tests")
        );
        assert_eq!(found[0].max_cycles, Some(3));
        assert!(
            collector.scan().is_empty(),
            "unchanged files are not reported again"
        );
        write(
            dir.path(),
            ".forge/implement_task/review_cycle_1.json",
            r#"{"cycle": 1, "verdict": "approved"}"#,
        );
        write(
            dir.path(),
            ".forge/implement_task/review_cycle_2.json",
            r#"{"cycle": 2, "verdict": "approved"}"#,
        );
        let found = collector.scan();
        assert_eq!(found.iter().map(|r| r.cycle).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn ignores_what_is_not_a_cycle_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut collector = CycleCollector::new(dir.path());
        write(
            dir.path(),
            ".forge/history/SHOP-1.json",
            r#"{"cycle": 1, "verdict": "approved"}"#,
        );
        write(
            dir.path(),
            ".forge/s/review_cycle_1.json.tmp",
            r#"{"cycle": 1, "verdict": "approved"}"#,
        );
        write(
            dir.path(),
            ".forge/s/review_cycle_x.json",
            r#"{"cycle": 1, "verdict": "approved"}"#,
        );
        write(
            dir.path(),
            ".forge/s/review_cycle_2.json",
            r#"{"cycle": 2, "verd"#,
        );
        write(
            dir.path(),
            ".forge/s/review_cycle_3.json",
            r#"["not", "an", "object"]"#,
        );
        write(
            dir.path(),
            ".forge/review_cycle_4.json",
            r#"{"cycle": 4, "verdict": "approved"}"#,
        );
        assert!(collector.scan().is_empty());
        write(
            dir.path(),
            ".forge/s/review_cycle_2.json",
            r#"{"cycle": 2, "verdict": "approved"}"#,
        );
        assert_eq!(
            collector.scan().len(),
            1,
            "a partial file is picked up once it is complete"
        );
    }

    #[test]
    fn atomic_writes_leave_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".forge/s/review_cycle_1.json");
        write_atomically(&path, b"{}").unwrap();
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from("review_cycle_1.json")]);
    }
}
