//! opencode: `opencode run --format json`, with a provider of forgepool's own naming on the
//! OpenAI-compatible (Chat Completions) SDK, configured through `OPENCODE_CONFIG_CONTENT`.
//!
//! Output: one JSON object a line: `step_start`, `tool_use` (a call with its input and, once
//! done, its output), `text`, `step_finish` (one per model call, with its tokens and cost:
//! the stage's usage is their sum), and `error` (with the provider's status code and raw
//! response headers, so a 429's `retry-after` is known).

use proto::{AgentProfile, Usage};
use serde_json::{json, Value};

use super::read::{add, amount, answered, called, compact, count, noted, object, said, text};
use super::{AgentReport, Invocation, Role};

const PROVIDER: &str = "forgepool";
const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

pub(super) fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Invocation {
    let model = profile
        .model
        .as_deref()
        .unwrap_or(super::OPENAI_DEFAULT_MODEL);
    let base_url = profile.base_url.as_deref().unwrap_or(DEFAULT_BASE_URL);
    let permission = if role == Role::Reviewer {
        json!({"edit": "deny", "bash": "allow", "webfetch": "deny"})
    } else {
        json!("allow")
    };
    let config = json!({
        "model": format!("{PROVIDER}/{model}"),
        "small_model": format!("{PROVIDER}/{model}"),
        "autoupdate": false,
        "share": "disabled",
        "permission": permission,
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "options": {"baseURL": base_url, "apiKey": "{env:OPENAI_API_KEY}"},
                "models": {model: {}},
            }
        },
    });
    let mut command: Vec<String> = ["opencode", "run", "--format", "json"]
        .map(String::from)
        .to_vec();
    if role == Role::Reviewer {
        command.extend(["--agent".to_string(), "plan".to_string()]);
    }
    command.extend(profile.args.iter().cloned());
    command.push(prompt.to_string());
    Invocation {
        command,
        env: vec![
            format!("OPENCODE_CONFIG_CONTENT={config}"),
            "OPENCODE_DISABLE_AUTOUPDATE=1".to_string(),
            "OPENCODE_DISABLE_MODELS_FETCH=1".to_string(),
            "OPENCODE_DISABLE_LSP_DOWNLOAD=1".to_string(),
        ],
        files: vec![],
    }
}

/// opencode's stream, read line by line.
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The text of the current step: the last one is the final message.
    text: String,
}

impl Reader {
    pub(super) fn line(&mut self, line: &str, report: &mut AgentReport, readable: &mut String) {
        let Some(event) = object(line) else {
            super::read::plain(readable, line);
            return;
        };
        match text(&event, "/type") {
            "step_start" => self.text.clear(),
            "text" => {
                let piece = text(&event, "/part/text");
                if self.text.len() < super::MAX_FINAL_TEXT {
                    self.text.push_str(piece);
                }
                report.final_text = super::read::cut(&self.text, super::MAX_FINAL_TEXT);
                said(report, readable, piece);
            }
            "tool_use" => {
                let tool = text(&event, "/part/tool");
                let state = event.pointer("/part/state").unwrap_or(&Value::Null);
                called(
                    report,
                    readable,
                    tool,
                    &state.get("input").map(compact).unwrap_or_default(),
                );
                match text(state, "/status") {
                    "completed" => {
                        answered(report, readable, Some(tool), text(state, "/output"), false)
                    }
                    "error" => answered(report, readable, Some(tool), text(state, "/error"), true),
                    _ => {}
                }
            }
            "step_finish" => {
                let usage = report.usage.get_or_insert_with(Usage::default);
                add(&mut usage.input_tokens, count(&event, "/part/tokens/input"));
                add(
                    &mut usage.output_tokens,
                    count(&event, "/part/tokens/output") + count(&event, "/part/tokens/reasoning"),
                );
                add(
                    &mut usage.cache_read_tokens,
                    count(&event, "/part/tokens/cache/read"),
                );
                add(
                    &mut usage.cache_write_tokens,
                    count(&event, "/part/tokens/cache/write"),
                );
                usage.cost_usd += amount(&event, "/part/cost").unwrap_or(0.0);
            }
            "error" => self.error(&event, report, readable),
            _ => {}
        }
    }

    fn error(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        let data = event.pointer("/error/data").unwrap_or(&Value::Null);
        let message = match text(data, "/message") {
            "" => text(event, "/error/name").to_string(),
            message => message.to_string(),
        };
        noted(report, readable, "error", &message);
        let status = count(data, "/statusCode");
        let lower = message.to_ascii_lowercase();
        if status == 429 || lower.contains("rate limit") || lower.contains("quota") {
            let headers = data.get("responseHeaders").unwrap_or(&Value::Null);
            let hint = header_wait(headers)
                .or_else(|| super::retry_hint(&message))
                .or_else(|| super::retry_hint(text(data, "/responseBody")));
            report.rate_limited(&message, hint);
        } else {
            report.failed(&message);
        }
    }

    pub(super) fn finish(&mut self, report: &mut AgentReport) {
        if let Some(usage) = &report.usage {
            let summary = format!(
                "opencode used {} input and {} output tokens, ${:.4}",
                usage.input_tokens, usage.output_tokens, usage.cost_usd
            );
            report.transcript.push("system", None, &summary, false);
        }
    }
}

/// The wait a provider's rate-limit headers name: `retry-after` in seconds, or
/// `retry-after-ms`.
fn header_wait(headers: &Value) -> Option<std::time::Duration> {
    let header = |name: &str| {
        headers
            .as_object()?
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .and_then(|(_, value)| value.as_str())
            .and_then(|value| value.trim().parse::<f64>().ok())
            .filter(|n| n.is_finite() && *n >= 0.0)
    };
    header("retry-after-ms")
        .map(|ms| ms / 1000.0)
        .or_else(|| header("retry-after"))
        .map(|seconds| std::time::Duration::from_secs_f64(seconds.min(86_400.0)))
}
