//! The independent final review's report, `review.json` (SPEC 7.3), checked strictly.
//!
//! The reviewer works on a fresh read-only copy of the verified tree and must leave exactly one
//! regular file, `review.json`, in its output folder. Every finding must point at real source:
//! an existing relative path, an existing line, and evidence quoted from that file. Anything
//! else refuses the report, and a refused report blocks the run.
//!
//! The shape is exact, and a report holding credential-like text is refused too.

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path};

use crate::workspace::confined::{Confined, ReadError};

use serde::Deserialize;

/// The largest report accepted: 256 KiB.
pub const MAX_REPORT_BYTES: u64 = 256 * 1024;
/// The largest source file a finding may point at: 8 MiB.
pub const MAX_SOURCE_FILE_BYTES: u64 = 8 * 1024 * 1024;
/// The most findings a report may hold.
pub const MAX_FINDINGS: usize = 30;

pub use proto::{FinalReport, Finding};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReport {
    verdict: String,
    summary: String,
    findings: Vec<Finding>,
}

/// Checks the output folder and the report against the source copy. Blocking: run it on the
/// blocking pool. The error says why the report was refused.
pub fn validate(output_dir: &Path, source: &Path) -> Result<FinalReport, String> {
    let text = read_only_report(output_dir)?;
    check_report(&text, source)
}

/// Checks a report's text against the source copy (SPEC 7.3): shape, verdict, findings, paths
/// read without following symlinks, lines and evidence. Blocking.
pub fn check_report(text: &str, source: &Path) -> Result<FinalReport, String> {
    if let Some(kind) = credential_like(text) {
        return Err(format!(
            "review.json contains credential-like content ({kind})"
        ));
    }
    let raw: RawReport = serde_json::from_str(text)
        .map_err(|e| format!("review.json is not valid JSON of the required shape: {e}"))?;
    let approved = match raw.verdict.as_str() {
        "approved" => true,
        "changes_required" => false,
        other => {
            return Err(format!(
                "review.json verdict must be `approved` or `changes_required`, got {other:?}"
            ))
        }
    };
    if raw.findings.len() > MAX_FINDINGS {
        return Err(format!(
            "review.json has {} findings; at most {MAX_FINDINGS} are allowed",
            raw.findings.len()
        ));
    }
    if !approved && raw.findings.is_empty() {
        return Err("review.json says changes_required but lists no finding".into());
    }
    let root =
        Confined::open(source).map_err(|e| format!("cannot read the reviewed source copy: {e}"))?;
    for (index, finding) in raw.findings.iter().enumerate() {
        let at = format!("findings[{index}]");
        if !matches!(
            finding.severity.as_str(),
            "low" | "medium" | "high" | "critical"
        ) {
            return Err(format!(
                "{at}.severity must be low, medium, high or critical, got {:?}",
                finding.severity
            ));
        }
        if approved && matches!(finding.severity.as_str(), "high" | "critical") {
            return Err(format!(
                "{at}: an approved report cannot keep a {} finding",
                finding.severity
            ));
        }
        let relative = Path::new(&finding.path);
        let escapes = relative.is_absolute()
            || finding.path.is_empty()
            || relative
                .components()
                .any(|c| !matches!(c, Component::Normal(_)))
            || relative
                .components()
                .next()
                .is_some_and(|c| c.as_os_str() == ".git");
        if escapes {
            return Err(format!(
                "{at}.path {:?} must be a relative path inside the source",
                finding.path
            ));
        }
        // The source holds whatever the implementer made, symlinks included: the file is read
        // without following any.
        let content = match root.read(relative, MAX_SOURCE_FILE_BYTES) {
            Ok(content) => content,
            Err(ReadError::Missing) => {
                return Err(format!(
                    "{at}.path {:?} does not exist in the reviewed source",
                    finding.path
                ))
            }
            Err(error) => {
                return Err(format!(
                    "{at}.path {:?} is not a file inside the reviewed source: it {error}",
                    finding.path
                ))
            }
        };
        let content = String::from_utf8_lossy(&content);
        let lines = content.lines().count() as u64;
        if finding.line == 0 || finding.line > lines {
            return Err(format!(
                "{at}.line {} does not exist in {} ({lines} lines)",
                finding.line, finding.path
            ));
        }
        if finding.evidence.trim().is_empty() || !content.contains(finding.evidence.as_str()) {
            return Err(format!("{at}.evidence does not occur in {}", finding.path));
        }
    }
    Ok(FinalReport {
        approved,
        summary: raw.summary,
        findings: raw.findings,
    })
}

/// Reads `review.json`, refusing an output folder that holds anything else, a symlink or a
/// hardlink, or a report over the size limit.
fn read_only_report(output_dir: &Path) -> Result<String, String> {
    let folder = Confined::open(output_dir)
        .map_err(|e| format!("cannot read the final review's output folder: {e}"))?;
    let entries = folder
        .entries()
        .map_err(|e| format!("cannot read the final review's output folder: {e}"))?;
    let names: HashSet<String> = entries.iter().map(|(name, _)| name.clone()).collect();
    if !names.contains("review.json") {
        return Err("the final reviewer wrote no /forge/output/review.json".into());
    }
    if names.len() != 1 {
        let mut others: Vec<_> = names.into_iter().filter(|n| n != "review.json").collect();
        others.sort();
        return Err(format!(
            "the output folder must hold only review.json, but also holds: {}",
            others.join(", ")
        ));
    }
    let path = output_dir.join("review.json");
    let metadata = std::fs::symlink_metadata(&path).map_err(|e| format!("review.json: {e}"))?;
    if metadata.nlink() > 1 {
        return Err("review.json is a hardlink".into());
    }
    let bytes = folder
        .read(Path::new("review.json"), MAX_REPORT_BYTES)
        .map_err(|error| match error {
            ReadError::Symlink => "review.json is a symlink".to_string(),
            ReadError::NotRegular => "review.json is not a regular file".to_string(),
            ReadError::TooLarge { size, .. } => {
                format!("review.json is {size} bytes, over the limit of {MAX_REPORT_BYTES}")
            }
            other => format!("review.json {other}"),
        })?;
    String::from_utf8(bytes).map_err(|_| "review.json is not UTF-8".to_string())
}

/// Names the kind of credential-like content in `text`, if any.
pub fn credential_like(text: &str) -> Option<&'static str> {
    if text.contains("-----BEGIN") && text.contains("PRIVATE KEY") {
        return Some("a private key");
    }
    let tokens = text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'));
    for token in tokens {
        let body = |prefix: &str| token.strip_prefix(prefix).map_or(0, str::len);
        if (token.starts_with("AKIA") || token.starts_with("ASIA"))
            && token.len() == 20
            && token
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
        {
            return Some("a cloud access key");
        }
        if body("ghp_") >= 30 || body("gho_") >= 30 || body("github_pat_") >= 30 {
            return Some("a GitHub token");
        }
        if body("sk-") >= 20 || body("xoxb-") >= 20 || body("xoxp-") >= 20 || body("AIza") >= 30 {
            return Some("an API token");
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Case {
        _dir: tempfile::TempDir,
        output: std::path::PathBuf,
        source: std::path::PathBuf,
    }

    fn case(report: &str) -> Case {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("source");
        std::fs::create_dir_all(source.join("inventory")).unwrap();
        std::fs::write(
            source.join("inventory/reservations.py"),
            "def reserve(item, quantity):\n    remaining = item.stock - quantity\n    return remaining\n",
        )
        .unwrap();
        let output = dir.path().join("output");
        std::fs::create_dir_all(&output).unwrap();
        std::fs::write(output.join("review.json"), report).unwrap();
        Case {
            _dir: dir,
            output,
            source,
        }
    }

    fn report(verdict: &str, findings: &str) -> String {
        format!(r#"{{"verdict": "{verdict}", "summary": "s", "findings": [{findings}]}}"#)
    }

    fn finding(severity: &str, path: &str, line: u64, evidence: &str) -> String {
        format!(
            r#"{{"severity": "{severity}", "path": "{path}", "line": {line}, "summary": "x", "evidence": "{evidence}"}}"#
        )
    }

    fn refused(text: &str, needle: &str) {
        let c = case(text);
        let error = validate(&c.output, &c.source).unwrap_err();
        assert!(error.contains(needle), "{error:?} lacks {needle:?}");
    }

    const GOOD: &str = "remaining = item.stock - quantity";

    #[test]
    fn valid_reports_pass() {
        let c = case(&report(
            "changes_required",
            &finding("high", "inventory/reservations.py", 2, GOOD),
        ));
        let parsed = validate(&c.output, &c.source).unwrap();
        assert!(!parsed.approved);
        assert_eq!(parsed.findings.len(), 1);
        let c = case(&report(
            "approved",
            &finding("low", "inventory/reservations.py", 3, "return remaining"),
        ));
        assert!(validate(&c.output, &c.source).unwrap().approved);
        let c = case(&report("approved", ""));
        assert!(validate(&c.output, &c.source).unwrap().approved);
    }

    #[test]
    fn every_refusal_cause() {
        refused(
            &report(
                "changes_required",
                &finding("high", "inventory/fabricated.py", 1, GOOD),
            ),
            "does not exist",
        );
        refused(
            &report(
                "changes_required",
                &finding("high", "inventory/reservations.py", 99, GOOD),
            ),
            "line 99 does not exist",
        );
        refused(
            &report(
                "changes_required",
                &finding("high", "inventory/reservations.py", 0, GOOD),
            ),
            "line 0 does not exist",
        );
        refused(
            &report(
                "changes_required",
                &finding("high", "inventory/reservations.py", 2, "stock + quantity"),
            ),
            "evidence does not occur",
        );
        refused(
            &report(
                "approved",
                &finding("high", "inventory/reservations.py", 2, GOOD),
            ),
            "cannot keep a high finding",
        );
        refused(
            &report(
                "approved",
                &finding("critical", "inventory/reservations.py", 2, GOOD),
            ),
            "cannot keep a critical finding",
        );
        refused(&report("changes_required", ""), "lists no finding");
        let many = vec![finding("low", "inventory/reservations.py", 2, GOOD); 31].join(",");
        refused(&report("changes_required", &many), "31 findings");
        refused(&report("maybe", ""), "verdict must be");
        refused(
            &report(
                "changes_required",
                &finding("severe", "inventory/reservations.py", 2, GOOD),
            ),
            "severity must be",
        );
        refused(
            &report(
                "changes_required",
                &finding("high", "/etc/passwd", 1, "root"),
            ),
            "must be a relative path",
        );
        refused(
            &report(
                "changes_required",
                &finding("high", "../outside.py", 1, "x"),
            ),
            "must be a relative path",
        );
        refused("{not json", "not valid JSON");
        refused(
            r#"{"verdict": "approved", "summary": "s", "findings": [], "extra": 1}"#,
            "not valid JSON of the required shape",
        );
        refused(
            r#"{"verdict": "approved", "findings": []}"#,
            "not valid JSON of the required shape",
        );
        let big = format!(
            r#"{{"verdict": "approved", "summary": "{}", "findings": []}}"#,
            "x".repeat(300 * 1024)
        );
        refused(&big, "over the limit");
        refused(
            &report("approved", "").replace("\"s\"", "\"key AKIAABCDEFGHIJKLMNOP\""),
            "credential-like content (a cloud access key)",
        );
        refused(
            &report("approved", "").replace("\"s\"", "\"-----BEGIN RSA PRIVATE KEY-----\""),
            "a private key",
        );
        refused(
            &report("approved", "").replace("\"s\"", "\"sk-abcdefghijklmnopqrstuvwxyz\""),
            "an API token",
        );
    }

    #[test]
    fn the_output_folder_must_hold_only_a_plain_review_json() {
        let c = case(&report("approved", ""));
        std::fs::write(c.output.join("notes.txt"), "hi").unwrap();
        assert!(validate(&c.output, &c.source)
            .unwrap_err()
            .contains("also holds: notes.txt"));

        let c = case(&report("approved", ""));
        let elsewhere = c.output.parent().unwrap().join("elsewhere.json");
        std::fs::rename(c.output.join("review.json"), &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, c.output.join("review.json")).unwrap();
        assert!(validate(&c.output, &c.source)
            .unwrap_err()
            .contains("symlink"));

        let c = case(&report("approved", ""));
        std::fs::hard_link(
            c.output.join("review.json"),
            c.output.parent().unwrap().join("link.json"),
        )
        .unwrap();
        assert!(validate(&c.output, &c.source)
            .unwrap_err()
            .contains("hardlink"));

        let c = case(&report("approved", ""));
        std::fs::remove_file(c.output.join("review.json")).unwrap();
        assert!(validate(&c.output, &c.source)
            .unwrap_err()
            .contains("wrote no"));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        fn source() -> tempfile::TempDir {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join("feature.txt"), "round 1\nround 2\n").unwrap();
            dir
        }

        fn severity() -> impl Strategy<Value = &'static str> {
            prop_oneof![
                Just("low"),
                Just("medium"),
                Just("high"),
                Just("critical"),
                Just("urgent")
            ]
        }

        proptest! {
            #[test]
            fn any_text_is_refused_or_accepted_without_panicking(text in any::<String>()) {
                let dir = source();
                let _ = check_report(&text, dir.path());
            }

            #[test]
            fn accepted_reports_keep_every_rule(
                approved in any::<bool>(),
                findings in proptest::collection::vec(
                    (severity(), prop_oneof![Just("feature.txt"), Just("../etc/passwd"), Just("/etc/passwd"), Just("none.txt")],
                     0u64..4, prop_oneof![Just("round 1"), Just("round 2"), Just("absent")]),
                    0..4,
                ),
            ) {
                let dir = source();
                let findings_json: Vec<serde_json::Value> = findings.iter().map(|(severity, path, line, evidence)| {
                    serde_json::json!({"severity": severity, "path": path, "line": line, "summary": "s", "evidence": evidence})
                }).collect();
                let text = serde_json::json!({
                    "verdict": if approved { "approved" } else { "changes_required" },
                    "summary": "x",
                    "findings": findings_json,
                }).to_string();
                let outcome = check_report(&text, dir.path());
                let all_valid = findings.iter().all(|(severity, path, line, evidence)| {
                    *severity != "urgent" && *path == "feature.txt" && (1..=2).contains(line) && *evidence != "absent"
                });
                let severe = findings.iter().any(|(s, ..)| *s == "high" || *s == "critical");
                let expected = all_valid && !(approved && severe) && (approved || !findings.is_empty());
                prop_assert_eq!(outcome.is_ok(), expected, "{:?}", outcome);
            }
        }
    }
}
