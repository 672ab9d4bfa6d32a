//! mini-swe-agent: `mini -t TASK -y --exit-immediately -o TRAJECTORY`, Chat Completions
//! through litellm, one `bash` tool.
//!
//! Its stdout is text for people and is logged as it is (searched only for a rate limit);
//! its record is the trajectory file it writes into `/forge/output`, read after the stage:
//! the messages with their tool calls, each response's usage, `info.exit_status`
//! (`Submitted`, or the error's name: `RateLimitError` is a pause) and `info.submission`.

use proto::{AgentProfile, Usage};
use serde_json::Value;

use super::read::{add, amount, compact, count, text};
use super::{AgentReport, Invocation, Role};

/// The trajectory's file name in `/forge/output`.
pub(super) const TRAJECTORY: &str = "trajectory.json";

pub(super) fn invocation(profile: &AgentProfile, role: Role, prompt: &str) -> Invocation {
    let model = super::litellm_model(profile);
    // The final reviewer's output folder must hold only its review.json.
    let trajectory = if role == Role::FinalReviewer {
        "/tmp/home/trajectory.json".to_string()
    } else {
        format!("/forge/output/{TRAJECTORY}")
    };
    let mut command: Vec<String> = vec![
        "mini".into(),
        "-m".into(),
        model,
        "-y".into(),
        "--exit-immediately".into(),
        "-o".into(),
        trajectory,
        // `-c` replaces the default configuration, so it is named first; the OpenAI SDK's own
        // retries would multiply mini-swe-agent's (two attempts) against a rate limit.
        "-c".into(),
        "mini.yaml".into(),
        "-c".into(),
        "model.model_kwargs.max_retries=0".into(),
    ];
    command.extend(profile.args.iter().cloned());
    command.extend(["-t".to_string(), prompt.to_string()]);
    let mut env = vec![
        "MSWEA_CONFIGURED=true".to_string(),
        "MSWEA_GLOBAL_CONFIG_DIR=/tmp/home/.config/mini-swe-agent".to_string(),
        "MSWEA_COST_TRACKING=ignore_errors".to_string(),
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT=2".to_string(),
        "LITELLM_LOCAL_MODEL_COST_MAP=True".to_string(),
    ];
    if let Some(url) = &profile.base_url {
        env.push(format!("OPENAI_API_BASE={}", url.trim_end_matches('/')));
    }
    Invocation {
        command,
        env,
        files: vec![],
    }
}

/// mini-swe-agent's stdout, read line by line for what matters while it runs.
#[derive(Debug, Default)]
pub(super) struct Reader;

impl Reader {
    pub(super) fn line(&mut self, line: &str, report: &mut AgentReport, readable: &mut String) {
        if line.contains("RateLimitError") {
            report.rate_limited(line, super::retry_hint(line));
        }
        super::read::plain(readable, line);
    }
}

/// Reads the trajectory into the report: transcript, usage, final text and outcome.
pub(super) fn take_trajectory(report: &mut AgentReport, bytes: &[u8]) {
    let Ok(trajectory) = serde_json::from_slice::<Value>(bytes) else {
        report.unreadable_lines = report.unreadable_lines.saturating_add(1);
        return;
    };
    let mut usage = Usage::default();
    let mut model = None;
    let messages = trajectory
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for message in messages {
        let role = text(message, "/role");
        let content = message_text(message);
        match role {
            "assistant" => {
                if !content.trim().is_empty() {
                    report.transcript.push("assistant", None, &content, false);
                }
                let calls = message
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                for call in calls {
                    let name = text(call, "/function/name");
                    let arguments = text(call, "/function/arguments");
                    report
                        .transcript
                        .push("tool_call", Some(name), arguments, false);
                }
                let response = message.pointer("/extra/response").unwrap_or(&Value::Null);
                let cached = count(response, "/usage/prompt_tokens_details/cached_tokens");
                add(
                    &mut usage.input_tokens,
                    count(response, "/usage/prompt_tokens").saturating_sub(cached),
                );
                add(&mut usage.cache_read_tokens, cached);
                add(
                    &mut usage.output_tokens,
                    count(response, "/usage/completion_tokens"),
                );
                usage.cost_usd += amount(message, "/extra/cost").unwrap_or(0.0);
                if model.is_none() && !text(response, "/model").is_empty() {
                    model = Some(super::read::cut(text(response, "/model"), 128));
                }
            }
            "tool" => report
                .transcript
                .push("tool_result", Some("bash"), &content, false),
            "user" if !report.transcript.entries.is_empty() => {
                report.transcript.push("user", None, &content, false)
            }
            _ => {}
        }
    }
    usage.model = model;
    report.usage = Some(usage);
    let status = text(&trajectory, "/info/exit_status");
    let submission = text(&trajectory, "/info/submission");
    report.final_text = super::read::cut(submission, super::MAX_FINAL_TEXT);
    match status {
        // A rate limit retried on stdout, then overcome: the trajectory has the last word.
        "Submitted" => report.recovered(),
        "" => {}
        "RateLimitError" => {
            let detail = exit_detail(messages);
            report.rate_limited(&detail, super::retry_hint(&detail));
        }
        other => {
            let detail = exit_detail(messages);
            report.failed(&format!("{other}: {detail}"));
        }
    }
}

/// A message's text: a string, or the text parts of a list.
fn message_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| text(p, "/text"))
            .collect::<Vec<_>>()
            .join("\n"),
        Some(other) => compact(other),
        None => String::new(),
    }
}

/// What the last message says of the error that ended the run.
fn exit_detail(messages: &[Value]) -> String {
    messages
        .iter()
        .rev()
        .find_map(|m| {
            let detail = text(m, "/extra/exception_str");
            (!detail.is_empty()).then(|| detail.to_string())
        })
        .or_else(|| messages.last().map(message_text))
        .map(|d| super::read::cut(&d, 2000))
        .unwrap_or_default()
}
