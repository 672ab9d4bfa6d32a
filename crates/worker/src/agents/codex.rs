//! Codex CLI: `codex exec --json`, against a provider of forgepool's own naming with
//! `wire_api = "responses"` (Codex speaks only the Responses API), configured with `-c`
//! flags so that nothing is written outside its home on the tmpfs.
//!
//! Output: one JSON object a line: `thread.started`, `turn.started`, `item.started` and
//! `item.completed` (`command_execution` with its output and exit code, `agent_message`,
//! `file_change`, `reasoning`, `error`), `turn.completed` with the turn's usage, or
//! `turn.failed` with the error; `error` lines while it reconnects.

use proto::{AgentProfile, Usage};
use serde_json::Value;

use super::read::{add, answered, called, compact, count, noted, object, said, text};
use super::{AgentReport, Invocation, Role};

/// The provider name forgepool's configuration gives Codex.
const PROVIDER: &str = "forgepool";
/// Where the API key is read from, in the stage's environment.
pub(super) const KEY_VARIABLE: &str = "OPENAI_API_KEY";
const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

pub(super) fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Invocation {
    let base_url = profile.base_url.as_deref().unwrap_or(DEFAULT_BASE_URL);
    let settings = [
        format!("model_provider=\"{PROVIDER}\""),
        format!("model_providers.{PROVIDER}.name=\"{PROVIDER}\""),
        format!(
            "model_providers.{PROVIDER}.base_url={}",
            toml_string(base_url)
        ),
        format!("model_providers.{PROVIDER}.env_key=\"{KEY_VARIABLE}\""),
        format!("model_providers.{PROVIDER}.wire_api=\"responses\""),
        format!("model_providers.{PROVIDER}.request_max_retries=1"),
        format!("model_providers.{PROVIDER}.stream_max_retries=1"),
        "check_for_update_on_startup=false".to_string(),
        "analytics.enabled=false".to_string(),
        // Otherwise it syncs "curated plugins" from GitHub and chatgpt.com at start.
        "features.plugins=false".to_string(),
        // Its hosted web search is a server-side tool: the gateway refuses a request naming
        // one unless the profile allows it (server_tools), so Codex does not offer it.
        "web_search=\"disabled\"".to_string(),
    ];
    let mut command: Vec<String> = [
        "codex",
        "exec",
        "--json",
        "--dangerously-bypass-approvals-and-sandbox",
        "--skip-git-repo-check",
        "--ephemeral",
        "-C",
        "/workspace",
    ]
    .map(String::from)
    .to_vec();
    for setting in settings {
        command.extend(["-c".to_string(), setting]);
    }
    if let Some(model) = &profile.model {
        command.extend(["-m".to_string(), model.clone()]);
    }
    let _ = role; // the container is the sandbox; a reviewer's copy is mounted read-only
    command.extend(profile.args.iter().cloned());
    command.push(prompt.to_string());
    Invocation {
        command,
        env: vec!["CODEX_HOME=/tmp/home/.codex".to_string()],
        files: vec![],
    }
}

/// A TOML basic string.
fn toml_string(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_else(|_| "\"\"".into())
}

/// Codex's stream, read line by line.
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The last error message, searched for the wait a rate limit names.
    last_error: String,
}

impl Reader {
    pub(super) fn line(&mut self, line: &str, report: &mut AgentReport, readable: &mut String) {
        let Some(event) = object(line) else {
            super::read::plain(readable, line);
            return;
        };
        match text(&event, "/type") {
            "thread.started" => noted(report, readable, "system", "codex started"),
            "item.started" if text(&event, "/item/type") == "command_execution" => {
                called(report, readable, "shell", text(&event, "/item/command"));
            }
            "item.completed" => self.item(&event, report, readable),
            "turn.completed" => {
                let usage = report.usage.get_or_insert_with(Usage::default);
                let input = count(&event, "/usage/input_tokens");
                let cached = count(&event, "/usage/cached_input_tokens");
                // OpenAI counts cached tokens inside the input; forgepool keeps them apart.
                add(&mut usage.input_tokens, input.saturating_sub(cached));
                add(&mut usage.cache_read_tokens, cached);
                add(
                    &mut usage.cache_write_tokens,
                    count(&event, "/usage/cache_write_input_tokens"),
                );
                add(
                    &mut usage.output_tokens,
                    count(&event, "/usage/output_tokens"),
                );
                let usage = usage.clone();
                noted(
                    report,
                    readable,
                    "system",
                    &format!(
                        "codex finished its turn: {} input and {} output tokens",
                        usage.input_tokens + usage.cache_read_tokens,
                        usage.output_tokens
                    ),
                );
            }
            "turn.failed" => {
                let message = text(&event, "/error/message").to_string();
                noted(report, readable, "error", &message);
                self.judge(&message, report);
            }
            "error" => {
                let message = text(&event, "/message").to_string();
                noted(report, readable, "system", &message);
                self.last_error = super::read::cut(&message, 4096);
            }
            _ => {}
        }
    }

    fn item(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        let item = event.get("item").unwrap_or(&Value::Null);
        match text(item, "/type") {
            "agent_message" => {
                let message = text(item, "/text");
                report.final_text = super::read::cut(message, super::MAX_FINAL_TEXT);
                said(report, readable, message);
            }
            "command_execution" => {
                let code = item.get("exit_code").and_then(Value::as_i64);
                answered(
                    report,
                    readable,
                    Some("shell"),
                    text(item, "/aggregated_output"),
                    code.is_some_and(|c| c != 0),
                );
            }
            "file_change" => {
                let changes = item.get("changes").map(compact).unwrap_or_default();
                called(report, readable, "apply_patch", &changes);
            }
            "mcp_tool_call" => {
                let tool = text(item, "/tool");
                called(
                    report,
                    readable,
                    tool,
                    &item.get("arguments").map(compact).unwrap_or_default(),
                );
            }
            "error" => {
                let message = text(item, "/message").to_string();
                noted(report, readable, "system", &message);
            }
            _ => {}
        }
    }

    /// A failed turn: a rate limit or quota pauses, anything else fails.
    fn judge(&mut self, message: &str, report: &mut AgentReport) {
        let lower = message.to_ascii_lowercase();
        let limited = [
            "429",
            "too many requests",
            "rate limit",
            "quota",
            "usage limit",
        ]
        .iter()
        .any(|signal| lower.contains(signal));
        if limited {
            let hint = super::retry_hint(message).or_else(|| super::retry_hint(&self.last_error));
            report.rate_limited(message, hint);
        } else {
            report.failed(message);
        }
    }
}
