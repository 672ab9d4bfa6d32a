//! Reviewer verdicts (SPEC 7.2): reading `APPROVED` or `REJECTED` from a reviewer's stdout.
//!
//! The markers are whole ASCII words, matched case-insensitively; the first one wins; text in
//! fenced code blocks never counts; letters that merely look like ASCII (Cyrillic, fullwidth)
//! never match, and a marker glued to any letter or digit is not a whole word.
//!
//! The feedback of a `REJECTED` verdict is the text after the marker (trimmed, a leading `:` or
//! `-` removed); when nothing follows the marker, the text before it.

/// The longest feedback kept from a reviewer: 64 KiB.
pub const MAX_FEEDBACK_BYTES: usize = 64 * 1024;
/// The feedback of a reviewer whose output holds no marker.
pub const UNPARSED_FEEDBACK: &str = "Verdict could not be parsed";

/// A reviewer's verdict with its feedback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the reviewer approved.
    pub approved: bool,
    /// For REJECTED: what to fix. For APPROVED: optional notes.
    pub feedback: String,
}

impl Verdict {
    /// A rejection with the given feedback, capped.
    pub fn rejected(feedback: impl Into<String>) -> Verdict {
        Verdict {
            approved: false,
            feedback: cap(feedback.into().trim()),
        }
    }

    /// The lowercase verdict word used in cycle files.
    pub fn word(&self) -> &'static str {
        if self.approved {
            "approved"
        } else {
            "rejected"
        }
    }
}

/// Reads the verdict from a reviewer's output.
pub fn parse(output: &str) -> Verdict {
    let searchable = mask_code_fences(output);
    let Some((position, approved)) = first_marker(&searchable) else {
        return Verdict::rejected(UNPARSED_FEEDBACK);
    };
    let marker_len = if approved {
        "APPROVED".len()
    } else {
        "REJECTED".len()
    };
    let after = output[position + marker_len..].trim_start_matches(|c: char| {
        c.is_whitespace() || matches!(c, ':' | '-' | '—' | '.' | ',')
    });
    let after = after.trim();
    let feedback = if after.is_empty() && !approved {
        output[..position].trim()
    } else {
        after
    };
    Verdict {
        approved,
        feedback: cap(feedback),
    }
}

/// Finds the first whole-word marker; returns its byte position and whether it approves.
fn first_marker(text: &str) -> Option<(usize, bool)> {
    let bytes = text.as_bytes();
    let is_word = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
    let mut index = 0;
    while index + 8 <= bytes.len() {
        let candidate = &bytes[index..index + 8];
        let approved = candidate.eq_ignore_ascii_case(b"APPROVED");
        if approved || candidate.eq_ignore_ascii_case(b"REJECTED") {
            let before = text[..index].chars().next_back();
            let after = text[index + 8..].chars().next();
            if !is_word(before) && !is_word(after) {
                return Some((index, approved));
            }
        }
        index += 1;
        while index < bytes.len() && !text.is_char_boundary(index) {
            index += 1;
        }
    }
    None
}

/// Replaces every character inside fenced code blocks (and the fences) with spaces, keeping byte
/// positions, so that markers there are never seen.
fn mask_code_fences(text: &str) -> String {
    let mut masked = String::with_capacity(text.len());
    let mut in_fence = false;
    for line in text.split_inclusive('\n') {
        let is_fence = line.trim_start().starts_with("```");
        if in_fence || is_fence {
            // One space per byte keeps every byte position, even for multi-byte characters.
            let body = line.strip_suffix('\n');
            masked.extend(std::iter::repeat_n(' ', body.unwrap_or(line).len()));
            if body.is_some() {
                masked.push('\n');
            }
        } else {
            masked.push_str(line);
        }
        if is_fence {
            in_fence = !in_fence;
        }
    }
    masked
}

/// Caps text at [`MAX_FEEDBACK_BYTES`] on a character boundary.
fn cap(text: &str) -> String {
    if text.len() <= MAX_FEEDBACK_BYTES {
        return text.to_string();
    }
    let mut end = MAX_FEEDBACK_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(output: &str, approved: bool, feedback: &str) {
        let verdict = parse(output);
        assert_eq!(verdict.approved, approved, "verdict of {output:?}");
        assert_eq!(verdict.feedback, feedback, "feedback of {output:?}");
    }

    #[test]
    fn verdict_table() {
        let cases: &[(&str, bool, &str)] = &[
            ("APPROVED", true, ""),
            ("approved", true, ""),
            (
                "Approved.\nNotes: add edge cases",
                true,
                "Notes: add edge cases",
            ),
            (
                "REJECTED\n\nMissing tests for process_data()",
                false,
                "Missing tests for process_data()",
            ),
            ("rejected: missing tests", false, "missing tests"),
            ("Verdict: REJECTED - no docs", false, "no docs"),
            ("Looked at it all.\nREJECTED", false, "Looked at it all."),
            (
                "REJECTED because x. Earlier I almost said APPROVED",
                false,
                "because x. Earlier I almost said APPROVED",
            ),
            (
                "APPROVED, though I nearly REJECTED it",
                true,
                "though I nearly REJECTED it",
            ),
            ("DISAPPROVED", false, UNPARSED_FEEDBACK),
            ("approvedness is high", false, UNPARSED_FEEDBACK),
            ("PREREJECTED", false, UNPARSED_FEEDBACK),
            ("APPROVED_ok", false, UNPARSED_FEEDBACK),
            ("APPROVED2", false, UNPARSED_FEEDBACK),
            ("", false, UNPARSED_FEEDBACK),
            ("looks fine to me", false, UNPARSED_FEEDBACK),
            ("APROVED", false, UNPARSED_FEEDBACK),
            ("REJECT", false, UNPARSED_FEEDBACK),
            // Cyrillic А (U+0410) and Е (U+0415), fullwidth letters.
            ("\u{0410}PPROVED", false, UNPARSED_FEEDBACK),
            ("REJ\u{0415}CTED", false, UNPARSED_FEEDBACK),
            (
                "\u{FF21}\u{FF30}\u{FF30}\u{FF32}\u{FF2F}\u{FF36}\u{FF25}\u{FF24}",
                false,
                UNPARSED_FEEDBACK,
            ),
            // A marker glued to a non-ASCII letter is not a whole word.
            ("éAPPROVED", false, UNPARSED_FEEDBACK),
            ("APPROVEDé", false, UNPARSED_FEEDBACK),
            // Punctuation and markup around a marker are fine.
            ("**APPROVED**", true, "**"),
            ("Verdict: `REJECTED`: fix it", false, "`: fix it"),
        ];
        for (output, approved, feedback) in cases {
            check(output, *approved, feedback);
        }
    }

    #[test]
    fn code_fences_never_count() {
        check(
            "```\nAPPROVED\n```\nREJECTED: tests fail",
            false,
            "tests fail",
        );
        check("Example:\n```text\nREJECTED\n```\nAPPROVED", true, "");
        check("```\nAPPROVED\n```", false, UNPARSED_FEEDBACK);
        check("  ```rust\n// REJECTED\n  ```\napproved", true, "");
        // An unclosed fence hides everything after it.
        check("```\nAPPROVED", false, UNPARSED_FEEDBACK);
        // Multi-byte text inside a fence keeps positions right.
        check(
            "```\nüü REJECTED ü\n```\nREJECTED: real — reason",
            false,
            "real — reason",
        );
    }

    #[test]
    fn feedback_is_capped() {
        let long = format!("REJECTED\n{}", "é".repeat(MAX_FEEDBACK_BYTES));
        let verdict = parse(&long);
        assert!(!verdict.approved);
        assert!(verdict.feedback.len() <= MAX_FEEDBACK_BYTES);
        assert!(verdict.feedback.len() > MAX_FEEDBACK_BYTES - 4);
    }

    #[test]
    fn crashes_and_timeouts_are_rejections() {
        let verdict = Verdict::rejected("Reviewer timed out after 300 seconds");
        assert_eq!(verdict.word(), "rejected");
        assert_eq!(verdict.feedback, "Reviewer timed out after 300 seconds");
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        fn marker() -> impl Strategy<Value = &'static str> {
            prop_oneof![
                Just("APPROVED"),
                Just("REJECTED"),
                Just("approved"),
                Just("Rejected")
            ]
        }

        proptest! {
            #[test]
            fn any_output_gives_a_verdict_with_bounded_feedback(output in any::<String>()) {
                let verdict = parse(&output);
                prop_assert!(verdict.feedback.len() <= 64 * 1024 + 4);
            }

            #[test]
            fn a_marker_inside_a_code_fence_never_counts(
                before in "[a-z ,.]{0,40}",
                inner in marker(),
                after in "[a-z ,.]{0,40}",
            ) {
                let output = format!("{before}\n```\n{inner}\n```\n{after}\n");
                let verdict = parse(&output);
                prop_assert!(!verdict.approved);
                prop_assert_eq!(verdict.feedback, "Verdict could not be parsed");
            }

            #[test]
            fn the_first_marker_wins(
                first in marker(),
                second in marker(),
                filler in "[a-z ]{0,30}",
            ) {
                let output = format!("{filler} {first}\n{filler} {second}\n");
                let verdict = parse(&output);
                prop_assert_eq!(verdict.approved, first.eq_ignore_ascii_case("approved"));
            }

            #[test]
            fn a_marker_inside_a_word_never_counts(
                prefix in "[a-z]{1,5}",
                inner in marker(),
                suffix in "[a-z]{1,5}",
            ) {
                let output = format!("{prefix}{inner}{suffix}\n");
                prop_assert_eq!(parse(&output).feedback, "Verdict could not be parsed");
            }
        }
    }
}
