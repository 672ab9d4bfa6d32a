//! Agent kinds (SPEC 16): how each known agent CLI is started in a stage, and how its output
//! is read.
//!
//! In the data flow this wing sits on both sides of a stage container. Before it,
//! [`invocation`] turns a profile of a kind, the stage and its prompt into the CLI's command
//! line and environment (headless, permissions bypassed because the container is the
//! sandbox, telemetry and updates off, a home on the stage's tmpfs, the model endpoint).
//! While it runs, an [`AgentReader`] reads the CLI's stdout (after redaction, before the log
//! caps) and turns it into readable log lines; when it ends, the reader's [`AgentReport`]
//! holds the final message (a reviewer's verdict is read from it), the transcript, the usage
//! and the outcome, which [`AgentReport::settle`] maps onto the stage's exit: a rate limit or
//! a quota is a pause whatever the CLI's exit code.
//!
//! Everything a CLI prints is untrusted: lines are bounded, JSON is parsed with serde (no
//! recursion past its limit, no panic), and nothing here fails on unexpected shapes.
//! One file per kind; each holds its command line and its reader.
//!
//! A rate limit with no named reset pauses for the profile's `pause_seconds`. `fixtures/` holds
//! each real CLI's output against the fake model (success, rate limit, reviewer, retry
//! recovered), read back by `tests.rs`; the end of a kind's stage is `crate::engine`'s
//! (`engine/agent.rs`).
//!
//! Why the CLIs' own machine output (stream-JSON, `exec --json`, trajectories), rather than a
//! script of ours wrapping each CLI in its image: the images stay the vendors' CLIs plus a user,
//! the output is parsed here, where it is bounded and redacted, and a version bump is one line in
//! `docker/agents/versions`. CLI retries are cut to one or two, so a rate-limited container ends
//! and the pool pauses the profile instead of holding a slot.

mod aider;
mod claude;
mod codex;
mod gemini;
mod mini;
mod opencode;
mod read;

use std::time::{Duration, SystemTime};

use proto::{AgentKind, AgentProfile, PauseRequest, Stage, Transcript, Usage};

/// The exit code with which a stage says its provider paused (quota, rate limit, login).
pub const EXIT_PAUSED: i64 = 75;

pub use read::retry_hint;

/// The longest line of a CLI's output that is parsed; a longer one is skipped and counted.
pub const MAX_AGENT_LINE: usize = 1024 * 1024;
/// The longest prompt passed on the command line; a longer one is left in
/// `/forge/input/prompt.md` and the CLI is told to read it (one argument may hold 128 KiB).
pub const MAX_INLINE_PROMPT: usize = 96 * 1024;
/// How long a profile rests after a rate limit whose reset time nobody named.
pub const DEFAULT_RATE_LIMIT_PAUSE: Duration = Duration::from_secs(300);
/// The longest final message kept (a reviewer's verdict and feedback come from it).
pub const MAX_FINAL_TEXT: usize = 256 * 1024;
/// The file in `/forge/output` a kind's CLI writes its record to, read after the stage.
pub fn output_file(kind: AgentKind) -> Option<&'static str> {
    match kind {
        AgentKind::MiniSweAgent => Some(mini::TRAJECTORY),
        _ => None,
    }
}

/// The model asked for by the kinds that speak OpenAI's API (opencode, aider,
/// mini-swe-agent) when the profile names none.
pub(super) const OPENAI_DEFAULT_MODEL: &str = "gpt-4.1";

/// The profile's model as litellm names it (aider, mini-swe-agent): a name without a
/// provider goes through litellm's `openai/` provider.
pub(super) fn litellm_model(profile: &AgentProfile) -> String {
    let model = profile.model.as_deref().unwrap_or(OPENAI_DEFAULT_MODEL);
    if model.contains('/') {
        model.to_string()
    } else {
        format!("openai/{model}")
    }
}

/// What a stage of an agent kind is for, which decides the CLI's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Changes `/workspace`.
    Implementer,
    /// Reads a read-only copy and answers with a verdict.
    Reviewer,
    /// Reads a read-only copy and writes `/forge/output/review.json`.
    FinalReviewer,
}

impl Role {
    /// The role of an agent stage.
    pub fn of(stage: Stage) -> Role {
        match stage {
            Stage::Review => Role::Reviewer,
            Stage::FinalReview => Role::FinalReviewer,
            Stage::Implement | Stage::Verify => Role::Implementer,
        }
    }

    /// Whether the stage may change `/workspace`.
    pub fn writes(self) -> bool {
        self == Role::Implementer
    }
}

/// A CLI's command line and environment for one stage.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Invocation {
    /// The command line.
    pub command: Vec<String>,
    /// `NAME=value` entries added to the stage's environment.
    pub env: Vec<String>,
    /// Files the CLI needs in its home, made before it starts: the variable of `env` that
    /// holds the content, and the path (under `$HOME`).
    pub files: Vec<(&'static str, &'static str)>,
}

/// The command line and environment of a stage of `profile`'s kind; `None` for `command`.
pub fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Option<Invocation> {
    let prompt = inline_prompt(prompt);
    let mut invocation = match profile.kind {
        AgentKind::Command => return None,
        AgentKind::ClaudeCode => claude::invocation(profile, role, &prompt),
        AgentKind::Codex => codex::invocation(profile, role, &prompt),
        AgentKind::GeminiCli => gemini::invocation(profile, role, &prompt),
        AgentKind::Opencode => opencode::invocation(profile, role, &prompt),
        AgentKind::Aider => aider::invocation(profile, role, &prompt),
        AgentKind::MiniSweAgent => mini::invocation(profile, role, &prompt),
    };
    // Every kind's home is on the stage's tmpfs: the root filesystem is read-only.
    invocation.env.push("HOME=/tmp/home".to_string());
    invocation
        .env
        .push("XDG_CONFIG_HOME=/tmp/home/.config".to_string());
    invocation
        .env
        .push("XDG_DATA_HOME=/tmp/home/.local/share".to_string());
    invocation
        .env
        .push("XDG_CACHE_HOME=/tmp/home/.cache".to_string());
    invocation
        .env
        .push("XDG_STATE_HOME=/tmp/home/.local/state".to_string());
    invocation.env.push("NO_COLOR=1".to_string());
    invocation.env.push("TERM=dumb".to_string());
    invocation.command = prelude(&invocation.files, std::mem::take(&mut invocation.command));
    Some(invocation)
}

/// The command behind a short shell prelude that makes the CLI's home on the tmpfs and
/// writes its files there. The paths are forgepool's constants; the contents come from the
/// environment, so nothing in them is ever shell code.
fn prelude(files: &[(&str, &str)], command: Vec<String>) -> Vec<String> {
    let mut script = String::from(
        "set -e; mkdir -p \"$HOME\" \"$XDG_CONFIG_HOME\" \"$XDG_DATA_HOME\" \"$XDG_CACHE_HOME\" \"$XDG_STATE_HOME\" ${CODEX_HOME:+\"$CODEX_HOME\"}; ",
    );
    for (variable, path) in files {
        script.push_str(&format!(
            "f=\"{path}\"; mkdir -p \"${{f%/*}}\"; printf '%s' \"${variable}\" > \"$f\"; "
        ));
    }
    script.push_str("exec \"$@\"");
    let mut wrapped = vec![
        "/bin/sh".to_string(),
        "-c".to_string(),
        script,
        "forgepool-agent".to_string(),
    ];
    wrapped.extend(command);
    wrapped
}

/// The prompt as the CLI gets it: whole, or, when it is too long for one argument, a pointer
/// to the file that holds it.
fn inline_prompt(prompt: &str) -> String {
    if prompt.len() <= MAX_INLINE_PROMPT && !prompt.contains('\0') {
        return prompt.to_string();
    }
    "Your full instructions are in the file /forge/input/prompt.md (too long to give here). \
     Read that whole file first, then do exactly what it says."
        .to_string()
}

/// How an agent CLI's stage ended, as its own output tells.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentOutcome {
    /// It finished its turn.
    Completed,
    /// It gave up, for this reason.
    Failed(String),
    /// The provider refused for a rate limit or a quota.
    RateLimited {
        /// What the CLI or the provider said.
        reason: String,
        /// When the limit resets, if anyone said.
        resets_at: Option<SystemTime>,
        /// Or how long to wait, if that is what was said.
        retry_after: Option<Duration>,
    },
}

/// What a stage's CLI reported, read from its output.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentReport {
    /// The kind that ran.
    pub kind: AgentKind,
    /// Its last message: a reviewer's verdict is read from it.
    pub final_text: String,
    /// The tokens and cost it reported, if it did.
    pub usage: Option<Usage>,
    /// How it ended.
    pub outcome: AgentOutcome,
    /// The conversation.
    pub transcript: Transcript,
    /// Lines that could not be read (too long, not JSON where JSON was due).
    pub unreadable_lines: u32,
}

impl AgentReport {
    fn new(kind: AgentKind) -> AgentReport {
        AgentReport {
            kind,
            final_text: String::new(),
            usage: None,
            outcome: AgentOutcome::Completed,
            transcript: Transcript::default(),
            unreadable_lines: 0,
        }
    }

    /// Marks the stage rate-limited (a later, more precise signal may add the reset time).
    fn rate_limited(&mut self, reason: &str, retry_after: Option<Duration>) {
        let reason = read::cut(reason.trim(), 300);
        match &mut self.outcome {
            AgentOutcome::RateLimited {
                retry_after: known, ..
            } => {
                if retry_after.is_some() {
                    *known = retry_after;
                }
            }
            outcome => {
                *outcome = AgentOutcome::RateLimited {
                    reason,
                    resets_at: None,
                    retry_after,
                }
            }
        }
    }

    /// A model answer came after a rate limit the CLI retried (aider and mini-swe-agent tell
    /// of each retry): the limit was overcome and does not pause the stage.
    fn recovered(&mut self) {
        if matches!(self.outcome, AgentOutcome::RateLimited { .. }) {
            self.outcome = AgentOutcome::Completed;
        }
    }

    /// Marks the stage failed, unless a rate limit was already seen (that decides).
    fn failed(&mut self, reason: &str) {
        if !matches!(self.outcome, AgentOutcome::RateLimited { .. }) {
            self.outcome = AgentOutcome::Failed(read::cut(reason.trim(), 2000));
        }
    }

    /// Reads the record a kind's CLI left in `/forge/output` ([`output_file`]).
    pub fn take_output_file(&mut self, bytes: &[u8]) {
        if self.kind == AgentKind::MiniSweAgent {
            mini::take_trajectory(self, bytes);
        }
    }

    /// The stage's ending as forgepool treats it, given how its container ended: a rate limit
    /// is a pause (exit 75) with its end, whatever the exit code; a CLI that says it failed
    /// fails even when it exited 0; otherwise the exit stands.
    pub fn settle(&self, exit_code: i64, now: SystemTime, unnamed_pause: Duration) -> Settled {
        let mut outcome = self.outcome.clone();
        if self.kind == AgentKind::GeminiCli
            && exit_code == gemini::EXIT_RATE_LIMITED
            && !matches!(outcome, AgentOutcome::RateLimited { .. })
        {
            outcome = AgentOutcome::RateLimited {
                reason: "gemini-cli exited 173 (a 429 from the provider)".to_string(),
                resets_at: None,
                retry_after: None,
            };
        }
        match &outcome {
            AgentOutcome::RateLimited {
                reason,
                resets_at,
                retry_after,
            } => {
                let wait = resets_at
                    .and_then(|at| at.duration_since(now).ok())
                    .or(*retry_after)
                    .unwrap_or(unnamed_pause);
                Settled {
                    exit_code: EXIT_PAUSED,
                    pause: Some(PauseRequest::after(reason, wait, now)),
                    reason: Some(format!("{} was rate-limited: {reason}", self.kind.as_str())),
                }
            }
            AgentOutcome::Failed(reason) => Settled {
                exit_code: if exit_code == 0 { 1 } else { exit_code },
                pause: None,
                reason: Some(format!("{} failed: {reason}", self.kind.as_str())),
            },
            AgentOutcome::Completed => Settled {
                exit_code,
                pause: None,
                reason: None,
            },
        }
    }
}

/// A stage's ending after its CLI's report was read.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    /// The exit code the stage counts as: 75 for a pause.
    pub exit_code: i64,
    /// For a pause: why, and until when.
    pub pause: Option<PauseRequest>,
    /// A line for the stage's log and its failure reason.
    pub reason: Option<String>,
}

/// Reads one stage's output as its kind prints it: whole lines are parsed as they come, each
/// giving readable log text; partial lines wait, up to [`MAX_AGENT_LINE`].
#[derive(Debug)]
pub struct AgentReader {
    report: AgentReport,
    parser: Parser,
    partial: String,
    /// The partial line grew past the limit: the rest of it is skipped.
    skipping: bool,
}

#[derive(Debug)]
enum Parser {
    Claude(claude::Reader),
    Codex(codex::Reader),
    Gemini(gemini::Reader),
    Opencode(opencode::Reader),
    Aider(aider::Reader),
    Mini(mini::Reader),
}

impl AgentReader {
    /// A reader for `kind`; `None` for `command`, whose output is logged as it is.
    pub fn new(kind: AgentKind) -> Option<AgentReader> {
        let parser = match kind {
            AgentKind::Command => return None,
            AgentKind::ClaudeCode => Parser::Claude(claude::Reader::default()),
            AgentKind::Codex => Parser::Codex(codex::Reader::default()),
            AgentKind::GeminiCli => Parser::Gemini(gemini::Reader::default()),
            AgentKind::Opencode => Parser::Opencode(opencode::Reader::default()),
            AgentKind::Aider => Parser::Aider(aider::Reader::default()),
            AgentKind::MiniSweAgent => Parser::Mini(mini::Reader),
        };
        Some(AgentReader {
            report: AgentReport::new(kind),
            parser,
            partial: String::new(),
            skipping: false,
        })
    }

    /// Takes stdout text (any split) and returns the readable log text of the lines it ended.
    pub fn stdout(&mut self, text: &str) -> String {
        let mut readable = String::new();
        let mut rest = text;
        while let Some(end) = rest.find('\n') {
            let piece = &rest[..end];
            rest = &rest[end + 1..];
            if self.skipping {
                self.skipping = false;
                continue;
            }
            let line = if self.partial.is_empty() {
                piece.to_string()
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.push_str(piece);
                line
            };
            self.line(&line, &mut readable);
        }
        if !self.skipping {
            self.partial.push_str(rest);
            if self.partial.len() > MAX_AGENT_LINE {
                self.partial = String::new();
                self.skipping = true;
                self.report.unreadable_lines = self.report.unreadable_lines.saturating_add(1);
                readable.push_str(&format!(
                    "[forgepool] a line of over {MAX_AGENT_LINE} bytes was not read\n"
                ));
            }
        }
        readable
    }

    /// Takes stderr text: never parsed as the CLI's record, only searched for rate-limit
    /// signals (some CLIs print their retries there). It is logged as it is by the caller.
    pub fn stderr(&mut self, text: &str) {
        for line in text.lines().take(10_000) {
            let line = read::cut(line, 4096);
            match &mut self.parser {
                Parser::Gemini(reader) => reader.stderr_line(&line, &mut self.report),
                Parser::Aider(_) | Parser::Mini(_) if line.contains("RateLimitError") => {
                    self.report.rate_limited(&line, retry_hint(&line));
                }
                _ => {}
            }
        }
    }

    fn line(&mut self, line: &str, readable: &mut String) {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if line.trim().is_empty() {
            return;
        }
        let report = &mut self.report;
        match &mut self.parser {
            Parser::Claude(reader) => reader.line(line, report, readable),
            Parser::Codex(reader) => reader.line(line, report, readable),
            Parser::Gemini(reader) => reader.line(line, report, readable),
            Parser::Opencode(reader) => reader.line(line, report, readable),
            Parser::Aider(reader) => reader.line(line, report, readable),
            Parser::Mini(reader) => reader.line(line, report, readable),
        }
    }

    /// Reads what is left (a last line without its end) and returns the report with the
    /// readable text of that line.
    pub fn finish(mut self) -> (AgentReport, String) {
        let mut readable = String::new();
        if !self.skipping && !self.partial.is_empty() {
            let line = std::mem::take(&mut self.partial);
            self.line(&line, &mut readable);
        }
        match &mut self.parser {
            Parser::Gemini(reader) => reader.finish(&mut self.report),
            Parser::Opencode(reader) => reader.finish(&mut self.report),
            Parser::Aider(reader) => reader.finish(&mut self.report),
            _ => {}
        }
        (self.report, readable)
    }

    /// Reads a whole output at once (the fake runtime, tests).
    pub fn read_all(kind: AgentKind, stdout: &str) -> Option<(AgentReport, String)> {
        let mut reader = AgentReader::new(kind)?;
        let mut readable = reader.stdout(stdout);
        let (report, rest) = reader.finish();
        readable.push_str(&rest);
        Some((report, readable))
    }
}

#[cfg(test)]
mod tests;
