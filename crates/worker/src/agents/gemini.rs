//! Gemini CLI, headless: `gemini -p PROMPT --output-format stream-json`.
//!
//! Its settings (API-key auth even with a base URL set, few retries, no telemetry or update
//! checks) are written into its home on the tmpfs before it starts.
//!
//! Output: one JSON object a line: `init` (the model), `message` (the user's, and the
//! assistant's in `delta` pieces), `tool_use` and `tool_result`, `error`, and a last `result`
//! with `status` and `stats` (tokens). A rate limit it gives up on ends with a `result` of
//! status `error` ("Resource has been exhausted") and exit 173 (429 in eight bits); its
//! retries are told on stderr ("Attempt 1 failed with status 429").

use proto::{AgentProfile, Usage};
use serde_json::Value;

use super::read::{answered, called, compact, count, noted, object, said, text};
use super::{AgentReport, Invocation, Role};

/// The exit code Gemini CLI ends with after a 429 (`process.exit(429)`, cut to 8 bits).
pub(super) const EXIT_RATE_LIMITED: i64 = 173;

/// The settings file, written at `$HOME/.gemini/settings.json`.
const SETTINGS: &str = r#"{"security":{"auth":{"selectedType":"gemini-api-key"}},"general":{"maxAttempts":2,"disableAutoUpdate":true,"disableUpdateNag":true},"privacy":{"usageStatisticsEnabled":false},"telemetry":{"enabled":false}}"#;

pub(super) fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Invocation {
    let mode = if role == Role::Reviewer {
        "plan"
    } else {
        "yolo"
    };
    let mut command: Vec<String> = [
        "gemini",
        "-p",
        prompt,
        "--output-format",
        "stream-json",
        "--skip-trust",
        "--approval-mode",
        mode,
    ]
    .map(String::from)
    .to_vec();
    if role == Role::FinalReviewer {
        // Gemini CLI's file tools refuse any path outside its workspace folders: the report
        // goes to /forge/output.
        command.extend([
            "--include-directories".to_string(),
            "/forge/output".to_string(),
        ]);
    }
    if let Some(model) = &profile.model {
        command.extend(["-m".to_string(), model.clone()]);
    }
    command.extend(profile.args.iter().cloned());
    let mut env = vec![
        "GEMINI_CLI_TRUST_WORKSPACE=true".to_string(),
        "GEMINI_TELEMETRY_ENABLED=false".to_string(),
        format!("FORGEPOOL_FILE_GEMINI_SETTINGS={SETTINGS}"),
    ];
    if let Some(url) = &profile.base_url {
        env.push(format!(
            "GOOGLE_GEMINI_BASE_URL={}",
            url.trim_end_matches('/')
        ));
    }
    Invocation {
        command,
        env,
        files: vec![(
            "FORGEPOOL_FILE_GEMINI_SETTINGS",
            "$HOME/.gemini/settings.json",
        )],
    }
}

/// Gemini CLI's stream, read line by line.
#[derive(Debug, Default)]
pub(super) struct Reader {
    /// The assistant's message being streamed in pieces.
    message: String,
    /// Tool names by call id.
    tools: std::collections::HashMap<String, String>,
    /// A 429 was retried (stderr).
    retried_429: bool,
}

impl Reader {
    pub(super) fn line(&mut self, line: &str, report: &mut AgentReport, readable: &mut String) {
        let Some(event) = object(line) else {
            super::read::plain(readable, line);
            return;
        };
        match text(&event, "/type") {
            "init" => noted(
                report,
                readable,
                "system",
                &format!("gemini-cli started: model {}", text(&event, "/model")),
            ),
            "message" if text(&event, "/role") == "assistant" => {
                if self.message.len() < super::MAX_FINAL_TEXT {
                    self.message.push_str(text(&event, "/content"));
                }
                if event.get("delta").and_then(Value::as_bool) != Some(true) {
                    self.flush(report, readable);
                }
            }
            "tool_use" => {
                self.flush(report, readable);
                let name = text(&event, "/tool_name");
                if self.tools.len() < 10_000 {
                    self.tools
                        .insert(text(&event, "/tool_id").to_string(), name.to_string());
                }
                let input = event.get("parameters").map(compact).unwrap_or_default();
                called(report, readable, name, &input);
            }
            "tool_result" => {
                let tool = self.tools.get(text(&event, "/tool_id")).cloned();
                let failed = text(&event, "/status") != "success";
                let output = match event.get("output") {
                    Some(output) => compact(output),
                    None => event.get("error").map(compact).unwrap_or_default(),
                };
                answered(report, readable, tool.as_deref(), &output, failed);
            }
            "error" => noted(report, readable, "error", text(&event, "/message")),
            "result" => self.result(&event, report, readable),
            _ => {}
        }
    }

    /// The assistant's message so far becomes one transcript entry, and the final text.
    fn flush(&mut self, report: &mut AgentReport, readable: &mut String) {
        if self.message.trim().is_empty() {
            self.message.clear();
            return;
        }
        let message = std::mem::take(&mut self.message);
        report.final_text = super::read::cut(&message, super::MAX_FINAL_TEXT);
        said(report, readable, &message);
    }

    fn result(&mut self, event: &Value, report: &mut AgentReport, readable: &mut String) {
        self.flush(report, readable);
        let input = count(event, "/stats/input_tokens");
        let cached = count(event, "/stats/cached");
        let model = event
            .pointer("/stats/models")
            .and_then(Value::as_object)
            .and_then(|models| models.keys().next().cloned());
        let usage = Usage {
            // Gemini counts cached tokens inside the prompt; forgepool keeps them apart.
            input_tokens: input.saturating_sub(cached),
            output_tokens: count(event, "/stats/output_tokens"),
            cache_read_tokens: cached,
            cache_write_tokens: 0,
            cost_usd: 0.0,
            model: model.map(|m| super::read::cut(&m, 128)),
        };
        if text(event, "/status") == "error" {
            let message = text(event, "/error/message");
            noted(report, readable, "error", message);
            let lower = message.to_ascii_lowercase();
            let limited = self.retried_429
                || ["exhausted", "429", "quota", "rate limit"]
                    .iter()
                    .any(|s| lower.contains(s));
            if limited {
                report.rate_limited(message, super::retry_hint(message));
            } else {
                report.failed(message);
            }
        }
        noted(
            report,
            readable,
            "system",
            &format!(
                "gemini-cli {}: {} input and {} output tokens, {} tool calls",
                text(event, "/status"),
                input,
                usage.output_tokens,
                count(event, "/stats/tool_calls")
            ),
        );
        report.usage = Some(usage);
    }

    /// Stderr tells of retries: "Attempt 1 failed with status 429. Retrying with backoff...".
    pub(super) fn stderr_line(&mut self, line: &str, report: &mut AgentReport) {
        if line.contains("status 429") {
            self.retried_429 = true;
            if let super::AgentOutcome::RateLimited { .. } = report.outcome {
                report.rate_limited(line, super::retry_hint(line));
            }
        }
    }

    pub(super) fn finish(&mut self, report: &mut AgentReport) {
        let mut rest = String::new();
        self.flush(report, &mut rest);
    }
}
