//! Agent kinds (SPEC 16) and the transcript a kind's output becomes.
//!
//! A profile's `kind` names the agent CLI its image runs. The worker then knows the CLI's
//! command line and configuration, and reads its machine-readable output into log lines, a
//! [`Transcript`], usage and an outcome. Only the names and the transcript cross a process
//! boundary; how each CLI is driven and read lives in the worker (`worker::agents`).

use serde::{Deserialize, Serialize};

/// The agent CLI a profile's image runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AgentKind {
    /// The profile's own `command`, under SPEC 6's contract (exit 75, `usage.json`, ...).
    #[default]
    Command,
    /// Claude Code, headless (`claude -p`, stream-json).
    ClaudeCode,
    /// OpenAI's Codex CLI (`codex exec --json`).
    Codex,
    /// Google's Gemini CLI, headless (stream-json).
    GeminiCli,
    /// opencode (`opencode run --format json`).
    Opencode,
    /// aider, one message and exit.
    Aider,
    /// mini-swe-agent (`mini`), with its trajectory file.
    MiniSweAgent,
}

impl AgentKind {
    /// Every kind, in the order the documentation lists them.
    pub const ALL: [AgentKind; 7] = [
        AgentKind::Command,
        AgentKind::ClaudeCode,
        AgentKind::Codex,
        AgentKind::GeminiCli,
        AgentKind::Opencode,
        AgentKind::Aider,
        AgentKind::MiniSweAgent,
    ];

    /// The name profiles use.
    pub fn as_str(self) -> &'static str {
        match self {
            AgentKind::Command => "command",
            AgentKind::ClaudeCode => "claude-code",
            AgentKind::Codex => "codex",
            AgentKind::GeminiCli => "gemini-cli",
            AgentKind::Opencode => "opencode",
            AgentKind::Aider => "aider",
            AgentKind::MiniSweAgent => "mini-swe-agent",
        }
    }

    /// The kind a profile names, if forgepool knows it.
    pub fn parse(name: &str) -> Option<AgentKind> {
        AgentKind::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Whether this is the plain `command` kind (SPEC 6's contract).
    pub fn is_command(&self) -> bool {
        *self == AgentKind::Command
    }

    /// The pinned version of the kind's CLI (`docker/agents/versions`), if it has one.
    pub fn pinned_version(self) -> Option<&'static str> {
        PINNED_VERSIONS.lines().find_map(|line| {
            let (kind, version) = line.split_once('=')?;
            (kind.trim() == self.as_str()).then(|| version.trim())
        })
    }

    /// The image `scripts/build-agent-images.sh` builds for the kind: a profile of the kind
    /// that names no image gets it.
    pub fn default_image(self) -> Option<String> {
        self.pinned_version()
            .map(|version| format!("forgepool-agent-{}:{version}", self.as_str()))
    }
}

/// The agent CLIs' pinned versions, one `KIND=VERSION` a line: the one place a version is
/// written, read by the image build script and by this crate.
const PINNED_VERSIONS: &str = include_str!("../../../docker/agents/versions");

/// The most entries a stage's transcript keeps; later ones are counted in
/// [`Transcript::omitted`].
pub const MAX_TRANSCRIPT_ENTRIES: usize = 2_000;
/// The most text one transcript entry keeps; the rest is cut and said so.
pub const MAX_ENTRY_CHARS: usize = 8 * 1024;
/// The most text a whole transcript keeps (the sum of its entries' texts).
pub const MAX_TRANSCRIPT_BYTES: usize = 512 * 1024;

/// A stage's conversation as its CLI reported it: messages, tool calls and their results, in
/// order, bounded in size. Agent text, untrusted: shown only as text.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Transcript {
    /// The entries, in the order the CLI printed them.
    pub entries: Vec<TranscriptEntry>,
    /// Entries past the size limits: counted, not kept.
    #[serde(default)]
    pub omitted: u32,
}

/// One message, tool call or tool result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TranscriptEntry {
    /// `system`, `assistant`, `user`, `tool_call`, `tool_result` or `error`.
    pub role: String,
    /// The tool's name, for tool calls and results.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The message text, the call's input (JSON text) or the result's output; cut at
    /// [`MAX_ENTRY_CHARS`].
    pub text: String,
    /// A tool result that reported an error.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error: bool,
}

impl Transcript {
    /// Appends an entry, cutting its text, unless the transcript is full (then it is counted).
    pub fn push(&mut self, role: &str, tool: Option<&str>, text: &str, is_error: bool) {
        let used: usize = self.entries.iter().map(|e| e.text.len()).sum();
        if self.entries.len() >= MAX_TRANSCRIPT_ENTRIES || used >= MAX_TRANSCRIPT_BYTES {
            self.omitted = self.omitted.saturating_add(1);
            return;
        }
        let room = MAX_ENTRY_CHARS.min(MAX_TRANSCRIPT_BYTES - used);
        self.entries.push(TranscriptEntry {
            role: role.to_string(),
            tool: tool.map(|t| cut(t, 128)),
            text: cut(text, room),
            is_error,
        });
    }

    /// The number of tool calls it holds.
    pub fn tool_calls(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| e.role == "tool_call")
            .count()
    }
}

/// `text` cut to at most `limit` bytes on a character boundary, with a note of what was cut.
fn cut(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let note = format!(" [… {} bytes in all]", text.len());
    let with_note = limit > note.len();
    let mut end = if with_note { limit - note.len() } else { limit };
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    if with_note {
        format!("{}{note}", &text[..end])
    } else {
        text[..end].to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_by_their_profile_names() {
        for kind in AgentKind::ALL {
            assert_eq!(AgentKind::parse(kind.as_str()), Some(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.as_str()));
            assert_eq!(serde_json::from_str::<AgentKind>(&json).unwrap(), kind);
        }
        assert_eq!(AgentKind::parse("claude"), None);
        assert_eq!(AgentKind::Command.default_image(), None);
        for kind in &AgentKind::ALL[1..] {
            let image = kind.default_image().expect("every agent kind is pinned");
            assert!(image.starts_with(&format!("forgepool-agent-{}:", kind.as_str())));
        }
    }

    #[test]
    fn a_transcript_stays_bounded_whatever_it_is_fed() {
        let mut transcript = Transcript::default();
        let long = "é".repeat(20_000);
        for _ in 0..3_000 {
            transcript.push("tool_result", Some("Read"), &long, false);
        }
        let used: usize = transcript.entries.iter().map(|e| e.text.len()).sum();
        assert!(used <= MAX_TRANSCRIPT_BYTES, "{used}");
        assert!(transcript
            .entries
            .iter()
            .all(|e| e.text.len() <= MAX_ENTRY_CHARS));
        assert_eq!(
            transcript.entries.len() + transcript.omitted as usize,
            3_000,
            "every entry is kept or counted"
        );
        assert!(transcript.entries[0].text.ends_with("bytes in all]"));
        let back: Transcript =
            serde_json::from_str(&serde_json::to_string(&transcript).unwrap()).unwrap();
        assert_eq!(back, transcript);
    }
}
