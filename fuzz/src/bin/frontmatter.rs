//! A skill's `review.md`: frontmatter and body, with every warning case.
fn main() {
    afl::fuzz!(|data: &[u8]| {
        let text = String::from_utf8_lossy(data);
        let (file, _warnings) = dispatcher::skills::parse_review(&text, "default/s/review.md");
        assert!(file.max_retries.is_none_or(|n| n <= 20));
    });
}
