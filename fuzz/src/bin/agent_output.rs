//! An agent CLI's output (SPEC 16): the first byte picks the kind, the rest is its stdout
//! (fed in two pieces), its stderr and, for mini-swe-agent, its trajectory file. Whatever the
//! bytes, the reader never panics, the report stays bounded, and the stage settles.
use proto::AgentKind;
use worker::agents::{AgentReader, MAX_FINAL_TEXT};

const KINDS: [AgentKind; 6] = [
    AgentKind::ClaudeCode,
    AgentKind::Codex,
    AgentKind::GeminiCli,
    AgentKind::Opencode,
    AgentKind::Aider,
    AgentKind::MiniSweAgent,
];

fn main() {
    afl::fuzz!(|data: &[u8]| {
        let Some((&first, rest)) = data.split_first() else {
            return;
        };
        let kind = KINDS[usize::from(first) % KINDS.len()];
        let text = String::from_utf8_lossy(rest);
        let mut reader = AgentReader::new(kind).expect("a reader for every agent kind");
        let split = text
            .char_indices()
            .nth(text.chars().count() / 2)
            .map_or(0, |(at, _)| at);
        let _ = reader.stdout(&text[..split]);
        let _ = reader.stdout(&text[split..]);
        reader.stderr(&text);
        let (mut report, _) = reader.finish();
        report.take_output_file(rest);
        assert!(report.final_text.len() <= MAX_FINAL_TEXT + 64);
        assert!(report.transcript.entries.len() <= proto::MAX_TRANSCRIPT_ENTRIES);
        let settled = report.settle(i64::from(first), std::time::SystemTime::now(), worker::agents::DEFAULT_RATE_LIMIT_PAUSE);
        assert!(settled.exit_code == 75 || settled.pause.is_none());
    });
}
