//! The reviewer's stdout (SPEC 7.2): any bytes give a verdict, with bounded feedback.
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        let verdict = worker::review::verdict::parse(&text);
        assert!(verdict.feedback.len() <= 64 * 1024 + 4);
    });
}
