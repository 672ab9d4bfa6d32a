//! The cycle collector: finds review cycle files in a workspace's `.forge/` folder (SPEC 8).
//!
//! The engine polls it while every stage runs and sweeps once more after each container exits,
//! so a file written just before exit is never missed. A file is reported when it is new or its
//! content changed; temporary files and anything that is not `{step}/review_cycle_{N}.json` with
//! a JSON object holding `cycle` and `verdict` are ignored until they become valid.
//!
//! Only the files containers wrote are collected, never the ones forgepool owns, and every read
//! goes through `crate::workspace::confined`; `write_atomically` writes forgepool's own files into
//! the workspace the same way. Polling every 100 ms (`AUTO_REVIEW_POLL_INTERVAL`) instead of
//! inotify: it works the same for bind mounts, Docker-in-Docker and network file systems, and
//! costs one small directory read per tick. Median latency from rename to event is half an
//! interval (docs/BENCHMARKS.md, "Cycle file to event").

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use proto::{CycleOrigin, CycleRecord};

use crate::workspace::confined::{Confined, EntryKind};

/// The largest cycle file read: 1 MiB.
pub const MAX_CYCLE_FILE_BYTES: u64 = 1024 * 1024;
/// The most cycle files collected from a workspace in one run.
pub const MAX_CYCLE_FILES: usize = 1000;
/// The most times one cycle file is reported again after it changed.
pub const MAX_CYCLE_UPDATES: u32 = 20;
/// The most bytes of cycle files one scan reads; the rest waits for the next scan.
pub const MAX_SCAN_BYTES: u64 = 4 * 1024 * 1024;

/// Remembers which cycle files were already reported.
#[derive(Debug, Default)]
pub struct CycleCollector {
    workspace: PathBuf,
    /// Per file: what its metadata was when it was last read, its content digest, and how
    /// often it was reported.
    seen: HashMap<(String, String), Seen>,
    /// Files forgepool wrote itself (`(step, file)`): their record is forgepool's, and the
    /// copy in the workspace, which a later stage could change, is never read back.
    owned: HashSet<(String, String)>,
}

/// What the collector knows of one cycle file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    stamp: (u64, i64, i64, u64),
    digest: u64,
    reports: u32,
}

impl CycleCollector {
    /// A collector over `{workspace}/.forge`.
    pub fn new(workspace: &Path) -> CycleCollector {
        CycleCollector {
            workspace: workspace.to_path_buf(),
            seen: HashMap::new(),
            owned: HashSet::new(),
        }
    }

    /// Marks a cycle file as forgepool's own: it is never collected from the workspace.
    pub fn own(&mut self, step: &str, file: &str) {
        self.owned.insert((step.to_string(), file.to_string()));
    }

    /// Returns the cycle files that are new or changed since the last scan, ordered by step
    /// and cycle. Nothing is read through a symlink, and only regular files up to
    /// [`MAX_CYCLE_FILE_BYTES`] count. Blocking: call it from a blocking task.
    pub fn scan(&mut self) -> Vec<CycleRecord> {
        let mut found = Vec::new();
        // The workspace root belongs to the worker's run folder; `.forge` and everything below
        // it is the agent's, so it is walked without following symlinks.
        let Ok(forge) = Confined::open(&self.workspace).and_then(|w| {
            w.subdir(Path::new(".forge"))
                .map_err(|e| std::io::Error::other(e.to_string()))
        }) else {
            return found;
        };
        let Ok(steps) = forge.entries() else {
            return found;
        };
        let mut budget = MAX_SCAN_BYTES;
        for (step_name, kind) in steps {
            // Only step folders named by the step rule: the name reaches the report.
            if step_name == "history"
                || kind != EntryKind::Dir
                || !proto::names::is_step(&step_name)
            {
                continue;
            }
            let Ok(step) = forge.subdir(Path::new(&step_name)) else {
                continue;
            };
            let Ok(files) = step.entries() else {
                continue;
            };
            for (name, kind) in files {
                let Some(cycle) = cycle_number(&name) else {
                    continue;
                };
                let key = (step_name.clone(), name.clone());
                if kind != EntryKind::File || self.owned.contains(&key) {
                    continue;
                }
                let known = self.seen.get(&key).copied();
                if known.is_none() && self.seen.len() >= MAX_CYCLE_FILES {
                    continue;
                }
                if known.is_some_and(|k| k.reports > MAX_CYCLE_UPDATES) {
                    continue;
                }
                // Unchanged metadata (size, modification time, inode): not read again.
                let Some(stamp) = step.stamp(&name) else {
                    continue;
                };
                if known.is_some_and(|k| k.stamp == stamp) || stamp.0 > budget {
                    continue;
                }
                let Ok(bytes) = step.read(Path::new(&name), MAX_CYCLE_FILE_BYTES) else {
                    continue;
                };
                budget = budget.saturating_sub(bytes.len() as u64);
                let digest = fnv1a(&bytes);
                let reports = known.map_or(0, |k| k.reports);
                if known.is_some_and(|k| k.digest == digest) {
                    self.seen.insert(
                        key,
                        Seen {
                            stamp,
                            digest,
                            reports,
                        },
                    );
                    continue;
                }
                let Some(record) = parse_cycle(&step_name, &name, cycle, &bytes) else {
                    continue;
                };
                self.seen.insert(
                    key,
                    Seen {
                        stamp,
                        digest,
                        reports: reports + 1,
                    },
                );
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

fn parse_cycle(step: &str, file: &str, cycle: u32, bytes: &[u8]) -> Option<CycleRecord> {
    let content: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let object = content.as_object()?;
    let verdict = object.get("verdict")?.as_str()?.to_ascii_lowercase();
    if verdict != "approved" && verdict != "rejected" {
        return None;
    }
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
        origin: CycleOrigin::Container,
    })
}

/// A small content fingerprint to notice rewritten files.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes `bytes` to `{workspace}/{relative}` atomically (a temporary file in the same folder,
/// then a rename), creating the folders on the way. The workspace is the agent's: a symlink
/// anywhere below it fails the write instead of leading it elsewhere.
pub fn write_atomically(workspace: &Path, relative: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = relative
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| std::io::Error::other("the path has no file name"))?;
    let folder = relative.parent().unwrap_or(Path::new(""));
    let root = Confined::open(workspace)?;
    let dir = if folder.as_os_str().is_empty() {
        root
    } else {
        root.create_subdir(folder)
            .map_err(|e| std::io::Error::other(format!("{}: {e}", folder.display())))?
    };
    dir.write_atomically(name, bytes)
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
    fn never_reads_through_a_symlink_nor_a_file_forgepool_owns() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(
            outside.path().join("review_cycle_7.json"),
            r#"{"cycle": 7, "verdict": "approved", "feedback": "host decoy"}"#,
        )
        .unwrap();
        std::fs::create_dir_all(dir.path().join(".forge/s")).unwrap();
        std::os::unix::fs::symlink(outside.path(), dir.path().join(".forge/linked")).unwrap();
        std::os::unix::fs::symlink(
            outside.path().join("review_cycle_7.json"),
            dir.path().join(".forge/s/review_cycle_7.json"),
        )
        .unwrap();
        write(
            dir.path(),
            ".forge/s/review_cycle_1.json",
            r#"{"cycle": 1, "verdict": "approved", "feedback": "rewritten by round 2"}"#,
        );
        let mut collector = CycleCollector::new(dir.path());
        collector.own("s", "review_cycle_1.json");
        assert!(collector.scan().is_empty());
        // A symlinked .forge is not followed either.
        let other = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), other.path().join(".forge")).unwrap();
        assert!(CycleCollector::new(other.path()).scan().is_empty());
    }

    #[test]
    fn atomic_writes_leave_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".forge/s/review_cycle_1.json");
        write_atomically(dir.path(), Path::new(".forge/s/review_cycle_1.json"), b"{}").unwrap();
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from("review_cycle_1.json")]);
    }
}
