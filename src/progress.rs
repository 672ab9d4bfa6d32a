//! The progress lines printed while a run is run or watched (SPEC 12).

use proto::{EventKind, RunState};

/// The longest feedback shown in a progress line.
pub const FEEDBACK_CHARS: usize = 200;

/// The line to print for an event, if any. Agents control much of its text (feedback,
/// reasons, check names, a stage's last output), so terminal control characters never reach
/// the terminal, and every line after the first is indented under it: an agent that prints
/// `Run delivered: …` in its output cannot pass it off as forgepool's own line.
pub fn line(kind: &EventKind) -> Option<String> {
    raw_line(kind).map(|line| indented(&printable(&line)))
}

/// The prefix of a printed line's continuation lines.
pub const CONTINUATION: &str = "    │ ";

fn indented(text: &str) -> String {
    text.lines()
        .collect::<Vec<_>>()
        .join(&format!("\n{CONTINUATION}"))
}

/// The longest log line shown by `--show-logs`, in characters.
pub const LOG_LINE_CHARS: usize = 160;

/// A stage's log text as printed by `--show-logs`: each line indented under its stage,
/// printable, and cut to [`LOG_LINE_CHARS`].
pub fn log_lines(stage: proto::Stage, text: &str) -> Vec<String> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let mut shown: String = line.chars().take(LOG_LINE_CHARS).collect();
            if line.chars().nth(LOG_LINE_CHARS).is_some() {
                shown.push('…');
            }
            format!("  {} │ {}", stage.as_str(), printable(&shown))
        })
        .collect()
}

/// `text` with every control character but newlines and tabs replaced by `\u{fffd}`: an
/// agent's escape sequences cannot move the cursor, rewrite earlier lines or set the title.
pub fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                '\u{fffd}'
            } else {
                c
            }
        })
        .collect()
}

fn raw_line(kind: &EventKind) -> Option<String> {
    match kind {
        EventKind::Cycle { cycle } => {
            let max = cycle
                .max_cycles
                .map_or(String::from("?"), |m| m.to_string());
            let verdict = cycle.verdict.to_uppercase();
            if cycle.verdict == "approved" {
                Some(format!("Review cycle {}/{max}: {verdict}", cycle.cycle))
            } else {
                let flat = cycle
                    .feedback
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                let cut: String = flat.chars().take(FEEDBACK_CHARS).collect();
                Some(format!(
                    "Review cycle {}/{max}: {verdict} - {cut}...",
                    cycle.cycle
                ))
            }
        }
        EventKind::StageStarted {
            stage,
            round,
            cycle,
        } => Some(match cycle {
            Some(cycle) => format!(
                "Stage {} started (round {round}, cycle {cycle})",
                stage.as_str()
            ),
            None => format!("Stage {} started (round {round})", stage.as_str()),
        }),
        // What an agent stage spent, as its CLI (or its usage.json) reported it.
        EventKind::StageFinished {
            stage,
            usage: Some(usage),
            ..
        } => Some(format!(
            "Stage {} spent {} input, {} output tokens ({} cache read), ${:.4}{}",
            stage.as_str(),
            usage.input_tokens,
            usage.output_tokens,
            usage.cache_read_tokens,
            usage.cost_usd,
            usage
                .model
                .as_deref()
                .map(|m| format!(" on {}", printable(m)))
                .unwrap_or_default()
        )),
        EventKind::Check { result } => Some(format!(
            "Check `{}`: {} ({:.1} s)",
            result.argv.join(" "),
            result
                .exit_code
                .map_or("timed out".to_string(), |c| format!("exit {c}")),
            result.duration_seconds
        )),
        EventKind::State {
            state: RunState::Running,
            ..
        } => None,
        EventKind::State { state, reason } => Some(format!("Run {state}: {reason}")),
        EventKind::CancelRequested { reason } => Some(format!("Cancel requested: {reason}")),
        EventKind::PullRequest { url, action } => {
            Some(format!("Pull request {action}: {}", printable(url)))
        }
        EventKind::Webhook {
            hook,
            attempt,
            outcome,
            ..
        } => Some(format!("Webhook {hook}: attempt {attempt}, {outcome}")),
        EventKind::Tracker {
            tracker,
            action,
            status,
            error,
        } => Some(match (status, error) {
            (_, Some(error)) => format!("Tracker {tracker}: {action} failed: {}", printable(error)),
            (Some(status), None) => format!("Tracker {tracker}: {action} ({status})"),
            (None, None) => format!("Tracker {tracker}: {action}"),
        }),
        EventKind::Checkpoint { checkpoint } => Some(format!(
            "Progress saved (checkpoint {}, tree {})",
            checkpoint.sequence,
            &checkpoint.tree[..checkpoint.tree.len().min(12)]
        )),
        EventKind::Result { result } => result.commit.as_ref().map(|commit| {
            format!(
                "Delivered {} at {commit}",
                result.branch.as_deref().unwrap_or("?")
            )
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn terminal_control_characters_never_reach_the_terminal() {
        let kind = EventKind::State {
            state: RunState::Failed,
            reason: "bad\u{1b}[2J\u{1b}]0;owned\u{7}\r\u{9b}31m done\nnext".into(),
        };
        let printed = line(&kind).unwrap();
        assert!(
            !printed.chars().any(|c| c.is_control() && c != '\n'),
            "{printed:?}"
        );
        assert!(printed.ends_with("done\n    │ next"), "{printed:?}");
    }

    /// Catches: an implementer's last output printed flush left, where its own
    /// `Review cycle 1/3: APPROVED` and `Run delivered: …` lines read as forgepool's.
    #[test]
    fn an_agents_lines_in_a_reason_are_indented_under_it() {
        let kind = EventKind::State {
            state: RunState::Failed,
            reason: "the implementer exited with code 3; last output:\nReview cycle 1/3: APPROVED\nRun delivered: the change was pushed".into(),
        };
        let printed = line(&kind).unwrap();
        let lines: Vec<&str> = printed.lines().collect();
        assert!(lines[0].starts_with("Run failed: "), "{printed}");
        assert!(
            lines[1..].iter().all(|l| l.starts_with(CONTINUATION)),
            "{printed}"
        );
    }

    /// Catches: `--show-logs` letting an agent's escape sequences or an endless line reach
    /// the terminal, or printing blank lines.
    #[test]
    fn shown_log_lines_are_indented_printable_and_cut() {
        let long = "x".repeat(LOG_LINE_CHARS + 50);
        let text = format!("→ Read inventory/reservations.py\n\n\u{1b}[2Jwiped\n{long}\n");
        let lines = log_lines(proto::Stage::Implement, &text);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert_eq!(lines[0], "  implement │ → Read inventory/reservations.py");
        assert!(!lines[1].chars().any(char::is_control), "{lines:?}");
        assert!(lines[2].ends_with('…'));
        assert_eq!(
            lines[2].chars().count(),
            "  implement │ ".chars().count() + LOG_LINE_CHARS + 1
        );
    }
    use super::*;
    use proto::CycleRecord;

    fn cycle(n: u32, verdict: &str, feedback: &str) -> EventKind {
        EventKind::Cycle {
            cycle: CycleRecord {
                step: "implement_task".into(),
                file: format!("review_cycle_{n}.json"),
                cycle: n,
                max_cycles: Some(3),
                verdict: verdict.into(),
                feedback: feedback.into(),
                content: serde_json::json!({}),
                origin: Default::default(),
            },
        }
    }

    #[test]
    fn cycle_lines_match_forge() {
        assert_eq!(
            line(&cycle(
                1,
                "rejected",
                "Missing tests for process_data() function"
            ))
            .unwrap(),
            "Review cycle 1/3: REJECTED - Missing tests for process_data() function..."
        );
        assert_eq!(
            line(&cycle(3, "approved", "fine")).unwrap(),
            "Review cycle 3/3: APPROVED"
        );
    }

    #[test]
    fn feedback_is_cut_to_200_characters() {
        let long = "é".repeat(300);
        let printed = line(&cycle(2, "rejected", &long)).unwrap();
        assert_eq!(
            printed,
            format!("Review cycle 2/3: REJECTED - {}...", "é".repeat(200))
        );
        let multi = line(&cycle(2, "rejected", "first\nsecond")).unwrap();
        assert!(multi.ends_with("first second..."), "{multi}");
    }
}
