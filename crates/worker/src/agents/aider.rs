//! aider: one `--message`, then exit; Chat Completions through litellm. aider has no tool
//! calls: it edits files from the reply's text, and prints plain text.
//!
//! The reader keeps the replies as assistant messages, each `Applied edit to PATH` as an
//! edit, and sums `Tokens: N sent, M received. Cost: $x message` lines. aider exits 0 after
//! it gives up on a rate limit (`litellm.RateLimitError`): that is read as a pause.

use proto::{AgentProfile, Usage};

use super::read::{called, noted, said};
use super::{AgentReport, Invocation, Role};

/// Where aider's model settings are written, and the variable that carries them.
const SETTINGS_PATH: &str = "/tmp/home/.aider.model.settings.yml";
const SETTINGS_VARIABLE: &str = "FORGEPOOL_FILE_AIDER_SETTINGS";

pub(super) fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Invocation {
    let model = super::litellm_model(profile);
    let mut command: Vec<String> = vec!["aider".into(), "--model".into(), model.clone()];
    command.extend(
        [
            "--yes-always",
            "--no-auto-commits",
            "--no-dirty-commits",
            "--no-gitignore",
            "--no-analytics",
            "--no-check-update",
            "--no-show-model-warnings",
            "--no-pretty",
            "--no-stream",
            "--no-fancy-input",
            // The repository map keeps a cache folder in the repository, which would be
            // delivered with the change.
            "--map-tokens",
            "0",
            "--chat-history-file",
            "/tmp/home/aider.chat.history.md",
            "--input-history-file",
            "/tmp/home/aider.input.history",
        ]
        .map(String::from),
    );
    if role != Role::Implementer {
        // A reviewer's copy is read-only: aider's git handling would write to it. aider has
        // no tools to look around, so the change is put in its chat.
        command.extend(["--no-git", "--read", "/forge/input/diff.patch"].map(String::from));
    }
    if role == Role::Reviewer {
        command.extend(["--chat-mode".to_string(), "ask".to_string()]);
    }
    // aider retries a rate limit for about a minute by itself; the OpenAI SDK under it would
    // retry each of those again, tripling the requests a paused provider gets.
    command.extend([
        "--model-settings-file".to_string(),
        SETTINGS_PATH.to_string(),
    ]);
    command.extend(profile.args.iter().cloned());
    command.extend(["--message".to_string(), prompt.to_string()]);
    let settings = format!(
        "- name: {}\n  extra_params:\n    max_retries: 0\n",
        serde_json::to_string(&model).unwrap_or_default()
    );
    let mut env = vec![
        "LITELLM_LOCAL_MODEL_COST_MAP=True".to_string(),
        "AIDER_CHECK_UPDATE=false".to_string(),
        // aider's messages are wrapped to the terminal's width, 80 without a terminal: an
        // error's reason (and its "try again in") would be cut across lines.
        "COLUMNS=4096".to_string(),
        format!("{SETTINGS_VARIABLE}={settings}"),
    ];
    if let Some(url) = &profile.base_url {
        env.push(format!("OPENAI_API_BASE={}", url.trim_end_matches('/')));
    }
    Invocation {
        command,
        env,
        files: vec![(SETTINGS_VARIABLE, SETTINGS_PATH)],
    }
}

/// aider's text, read line by line.
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The reply being printed.
    reply: String,
    model: Option<String>,
}

impl Reader {
    pub(super) fn line(&mut self, line: &str, report: &mut AgentReport, readable: &mut String) {
        if let Some(rest) = line.strip_prefix("Tokens: ") {
            // A metered answer: a rate limit aider retried before it was overcome.
            report.recovered();
            self.flush(report, readable);
            add_usage(rest, self.model.as_deref(), report);
            readable.push_str(line);
            readable.push('\n');
            return;
        }
        if line.contains("RateLimitError") || line.contains("rate limited you") {
            report.rate_limited(line, super::retry_hint(line));
            noted(report, readable, "error", line);
            return;
        }
        if let (super::AgentOutcome::RateLimited { .. }, Some(wait)) =
            (&report.outcome, super::retry_hint(line))
        {
            // The provider's message wrapped onto the next line (a narrow terminal).
            report.rate_limited(line, Some(wait));
        }
        if line.starts_with("litellm.") && line.contains("Error") {
            // aider exits 0 after it gives up on any provider error.
            report.failed(line);
            noted(report, readable, "error", line);
            return;
        }
        if let Some(path) = line.strip_prefix("Applied edit to ") {
            self.flush(report, readable);
            called(report, readable, "edit", path.trim());
            return;
        }
        if let Some(model) = line
            .strip_prefix("Model: ")
            .or_else(|| line.strip_prefix("Main model: "))
        {
            let name = model.split_whitespace().next().unwrap_or("");
            self.model = Some(super::read::cut(name, 128));
        }
        let banner = [
            "Aider v",
            "Model: ",
            "Main model: ",
            "Weak model: ",
            "Git repo: ",
            "Repo-map: ",
            "https://aider.chat",
            "Warning: ",
            "Added ",
        ]
        .iter()
        .any(|prefix| line.starts_with(prefix));
        if banner {
            readable.push_str(line);
            readable.push('\n');
        } else if self.reply.len() < super::MAX_FINAL_TEXT {
            self.reply.push_str(line);
            self.reply.push('\n');
        }
    }

    fn flush(&mut self, report: &mut AgentReport, readable: &mut String) {
        if self.reply.trim().is_empty() {
            return;
        }
        let reply = std::mem::take(&mut self.reply);
        report.final_text = super::read::cut(reply.trim(), super::MAX_FINAL_TEXT);
        said(report, readable, &reply);
    }

    pub(super) fn finish(&mut self, report: &mut AgentReport) {
        let mut rest = String::new();
        self.flush(report, &mut rest);
    }
}

/// `1.2k sent, 56 received. Cost: $0.0026 message, $0.0026 session.`
fn add_usage(text: &str, model: Option<&str>, report: &mut AgentReport) {
    let number_before = |word: &str| {
        let end = text.find(word)?;
        let token = text[..end].trim_end().rsplit([' ', ',']).next()?;
        tokens(token)
    };
    let usage = report.usage.get_or_insert_with(Usage::default);
    super::read::add(&mut usage.input_tokens, number_before(" sent").unwrap_or(0));
    super::read::add(
        &mut usage.output_tokens,
        number_before(" received").unwrap_or(0),
    );
    if let Some(cost) = text
        .split_once("Cost: $")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.trim_end_matches([',', '.']).parse::<f64>().ok())
        .filter(|c| c.is_finite() && *c >= 0.0)
    {
        usage.cost_usd += cost.min(1e6);
    }
    if usage.model.is_none() {
        usage.model = model.map(str::to_string);
    }
}

/// aider's token counts: `56`, `1.2k`, `12k`, `1.5M`.
fn tokens(text: &str) -> Option<u64> {
    let text = text.trim().replace(',', "");
    let (digits, scale) = match text.chars().last()? {
        'k' | 'K' => (&text[..text.len() - 1], 1e3),
        'm' | 'M' => (&text[..text.len() - 1], 1e6),
        _ => (text.as_str(), 1.0),
    };
    let value = digits.parse::<f64>().ok()? * scale;
    (value.is_finite() && value >= 0.0).then(|| (value.round() as u64).min(1 << 40))
}
