//! The final reviewer's `review.json` (SPEC 7.3) against a small source copy: any bytes are
//! accepted or refused with a reason, and an accepted report keeps every rule.
fn main() {
    let source = tempfile::tempdir().expect("a temporary folder");
    std::fs::write(source.path().join("feature.txt"), "round 1\nround 2\n").expect("a file");
    std::os::unix::fs::symlink("/etc/passwd", source.path().join("leak.txt")).expect("a link");
    afl::fuzz!(|data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        match worker::review::final_report::check_report(&text, source.path()) {
            Ok(report) => {
                for finding in &report.findings {
                    assert_eq!(
                        finding.path, "feature.txt",
                        "only the real file may be cited"
                    );
                }
            }
            Err(reason) => assert!(!reason.is_empty()),
        }
    });
}
