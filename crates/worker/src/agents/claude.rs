//! Claude Code, headless: `claude -p PROMPT --output-format stream-json --verbose`.
//!
//! Output: one JSON object a line: `system` (`init` with the model and tools, `api_retry`
//! with the delay it waits), `assistant` (text and `tool_use` blocks), `user` (`tool_result`
//! blocks), `rate_limit_event` (a plan's limit, with `resetsAt`), and a last `result` with the
//! usage, the cost and `is_error`/`api_error_status` (429 when the retries gave up on a rate
//! limit; the CLI then exits 1).

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use proto::{AgentProfile, Usage};
use serde_json::Value;

use super::read::{amount, answered, called, compact, count, noted, object, said, text};
use super::{AgentOutcome, AgentReport, Invocation, Role};

/// How often the CLI tries a refused request again before it gives up (its default is 10,
/// which can hold a stage for minutes behind a rate limit the pool should pause for).
const MAX_RETRIES: &str = "2";

pub(super) fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Invocation {
    let mut command: Vec<String> = [
        "claude",
        "-p",
        prompt,
        "--output-format",
        "stream-json",
        "--verbose",
        "--dangerously-skip-permissions",
    ]
    .map(String::from)
    .to_vec();
    if let Some(model) = &profile.model {
        command.extend(["--model".to_string(), model.clone()]);
    }
    if role == Role::Reviewer {
        // A reviewer reads and answers; its copy is read-only anyway.
        command.extend(["--disallowedTools".into(), "Edit,Write,NotebookEdit".into()]);
    }
    command.extend(profile.args.iter().cloned());
    let mut env = vec![
        "DISABLE_AUTOUPDATER=1".to_string(),
        "DISABLE_TELEMETRY=1".to_string(),
        "DISABLE_ERROR_REPORTING=1".to_string(),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1".to_string(),
        format!("CLAUDE_CODE_MAX_RETRIES={MAX_RETRIES}"),
    ];
    if let Some(url) = &profile.base_url {
        env.push(format!("ANTHROPIC_BASE_URL={}", url.trim_end_matches('/')));
    }
    Invocation {
        command,
        env,
        files: vec![],
    }
}

/// Claude Code's stream, read line by line.
#[derive(Debug, Default)]
pub(super) struct Reader {
    model: Option<String>,
    /// Tool names by call id, to name results (bounded).
    tools: HashMap<String, String>,
    /// The delay of the last retry after a rate limit: the provider's `retry-after`.
    retry_delay: Option<Duration>,
}

impl Reader {
    pub(super) fn line(&mut self, line: &str, report: &mut AgentReport, readable: &mut String) {
        let Some(event) = object(line) else {
            super::read::plain(readable, line);
            return;
        };
        match text(&event, "/type") {
            "system" => self.system(&event, report, readable),
            "assistant" => self.assistant(&event, report, readable),
            "user" => self.user(&event, report, readable),
            "rate_limit_event" => rate_limit_event(&event, report, readable),
            "result" => self.result(&event, report, readable),
            _ => {}
        }
    }

    fn system(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        match text(event, "/subtype") {
            "init" => {
                let model = text(event, "/model");
                if !model.is_empty() {
                    self.model = Some(super::read::cut(model, 128));
                }
                let tools = event
                    .get("tools")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len);
                noted(
                    report,
                    readable,
                    "system",
                    &format!("claude-code started: model {model}, {tools} tools"),
                );
            }
            "api_retry" => {
                let status = count(event, "/error_status");
                let delay = Duration::from_millis(count(event, "/retry_delay_ms"));
                if status == 429 || text(event, "/error") == "rate_limit" {
                    self.retry_delay = Some(delay);
                }
                let status = if status == 0 {
                    text(event, "/error").to_string()
                } else {
                    status.to_string()
                };
                noted(
                    report,
                    readable,
                    "system",
                    &format!(
                        "API retry {}/{} after {status}, in {:.1} s",
                        count(event, "/attempt"),
                        count(event, "/max_retries"),
                        delay.as_secs_f64()
                    ),
                );
            }
            _ => {}
        }
    }

    fn assistant(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        let blocks = event
            .pointer("/message/content")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for block in blocks {
            match text(block, "/type") {
                "text" => said(report, readable, text(block, "/text")),
                "tool_use" => {
                    let name = text(block, "/name");
                    if self.tools.len() < 10_000 {
                        self.tools
                            .insert(text(block, "/id").to_string(), name.to_string());
                    }
                    let input = block.get("input").map(compact).unwrap_or_default();
                    called(report, readable, name, &input);
                }
                _ => {}
            }
        }
        if text(event, "/error") == "rate_limit" || count(event, "/api_error_status") == 429 {
            let message = blocks
                .iter()
                .map(|b| text(b, "/text"))
                .collect::<Vec<_>>()
                .join(" ");
            report.rate_limited(&message, self.retry_delay);
        }
    }

    fn user(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        let blocks = event
            .pointer("/message/content")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for block in blocks.iter().filter(|b| text(b, "/type") == "tool_result") {
            let output = match block.get("content") {
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(|p| text(p, "/text"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                Some(other) => compact(other),
                None => String::new(),
            };
            let tool = self.tools.get(text(block, "/tool_use_id")).cloned();
            let is_error = block.get("is_error").and_then(Value::as_bool) == Some(true);
            answered(report, readable, tool.as_deref(), &output, is_error);
        }
    }

    fn result(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        let model = event
            .get("modelUsage")
            .and_then(Value::as_object)
            .and_then(|models| models.keys().next().cloned())
            .or_else(|| self.model.clone());
        let usage = Usage {
            input_tokens: count(event, "/usage/input_tokens"),
            output_tokens: count(event, "/usage/output_tokens"),
            cache_read_tokens: count(event, "/usage/cache_read_input_tokens"),
            cache_write_tokens: count(event, "/usage/cache_creation_input_tokens"),
            cost_usd: amount(event, "/total_cost_usd").unwrap_or(0.0),
            model: model.map(|m| super::read::cut(&m, 128)),
        };
        let result = text(event, "/result");
        report.final_text = super::read::cut(result, super::MAX_FINAL_TEXT);
        let is_error = event.get("is_error").and_then(Value::as_bool) == Some(true);
        let status = count(event, "/api_error_status");
        if is_error {
            if status == 429 || matches!(report.outcome, AgentOutcome::RateLimited { .. }) {
                let hint = self.retry_delay.or_else(|| super::retry_hint(result));
                report.rate_limited(result, hint);
            } else {
                let reason = if result.is_empty() {
                    text(event, "/subtype")
                } else {
                    result
                };
                report.failed(reason);
            }
        }
        noted(
            report,
            readable,
            "system",
            &format!(
                "claude-code {}: {} turns, {} input and {} output tokens, ${:.4}",
                if is_error { "gave up" } else { "finished" },
                count(event, "/num_turns"),
                usage.input_tokens,
                usage.output_tokens,
                usage.cost_usd
            ),
        );
        report.usage = Some(usage);
    }
}

/// A plan's limit: `rejected` means no request passes before `resetsAt` (epoch seconds).
fn rate_limit_event(event: &Value, report: &mut AgentReport, readable: &mut String) {
    if text(event, "/rate_limit_info/status") != "rejected" {
        return;
    }
    let resets = count(event, "/rate_limit_info/resetsAt");
    let kind = text(event, "/rate_limit_info/rateLimitType");
    noted(
        report,
        readable,
        "error",
        &format!("usage limit reached ({kind}), resets at epoch {resets}"),
    );
    report.rate_limited(&format!("usage limit reached ({kind})"), None);
    if let AgentOutcome::RateLimited { resets_at, .. } = &mut report.outcome {
        if resets > 0 {
            *resets_at = SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(resets));
        }
    }
}
