//! A fake model server for the real agent CLIs: Anthropic Messages (SSE), OpenAI Responses
//! (SSE), Chat Completions (SSE and not) and Gemini `streamGenerateContent` (SSE) and
//! `generateContent`, on one port, recording every request it gets.
//!
//! It plays one script for every test: an implementer's first request gets a tool call that
//! writes [`Script::file`] with the CLI's own edit tool (aider, which has no tools, gets its
//! `whole` edit format), a request that carries the tool's result gets a final text; a
//! reviewer (its prompt holds [`REVIEWER_MARK`]) rejects with [`FEEDBACK`] until an
//! implementer's request carried the feedback, then approves. The first
//! `rate_limited` requests get a 429 with `retry-after`. Every answer reports
//! [`INPUT_TOKENS`] and [`OUTPUT_TOKENS`], so a run's usage is those times the answers.
//!
//! axum rather than wiremock or `@copilotkit/aimock`: the script depends on what earlier
//! requests carried (the reviewer's verdict), which wiremock's matchers cannot express, and a
//! Rust server in the test process needs no Node.js at test time.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// Written into the test skill's review.md: tells the reviewer's requests apart.
pub const REVIEWER_MARK: &str = "FAKE-REVIEWER-CHECKLIST";
/// The reviewer's feedback when it rejects.
pub const FEEDBACK: &str = "the greeting lacks an exclamation mark";
/// What only forgepool's prompt of a final reviewer (SPEC 7.3) holds.
pub const FINAL_REVIEW_MARK: &str = "# Independent final review";
/// Where a final reviewer writes its report.
pub const FINAL_REVIEW_FILE: &str = "/forge/output/review.json";
/// The summary of the report the fake's final reviewer writes.
pub const FINAL_SUMMARY: &str = "The greeting file is written as the brief asks.";
/// Input tokens every answer reports.
pub const INPUT_TOKENS: u64 = 321;
/// Output tokens every answer reports.
pub const OUTPUT_TOKENS: u64 = 45;

/// What the fake plays.
#[derive(Debug, Clone)]
pub struct Script {
    /// The file the implementer writes, relative to the workspace.
    pub file: String,
    /// Its content.
    pub content: String,
    /// The first this many requests are answered 429.
    pub rate_limited: usize,
    /// The `retry-after` of a 429, in seconds.
    pub retry_after: u64,
    /// Text only the reviewer's prompt holds (the tests' [`REVIEWER_MARK`]).
    pub reviewer_mark: String,
    /// What the reviewer says when it rejects (the tests' [`FEEDBACK`]).
    pub feedback: String,
    /// What the reviewer says when it approves.
    pub approval: String,
    /// The file and content the implementer writes once the feedback came back; the same
    /// as the first round's when `None`.
    pub after_feedback: Option<(String, String)>,
}

impl Script {
    /// The tests' script: the implementer writes `file`; the first `rate_limited` requests
    /// get a 429 with `retry-after: 2`.
    pub fn writing(file: &str, content: &str, rate_limited: usize) -> Script {
        Script {
            file: file.into(),
            content: content.into(),
            rate_limited,
            retry_after: 2,
            reviewer_mark: REVIEWER_MARK.into(),
            feedback: FEEDBACK.into(),
            approval: "APPROVED: the greeting is right.".into(),
            after_feedback: None,
        }
    }
}

/// One request the fake got.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    /// Header names (values are not kept: they may be keys).
    pub headers: Vec<String>,
    /// The authorization the request carried (`x-api-key`, `authorization` or
    /// `x-goog-api-key`), to check which key reached the model.
    pub key: Option<String>,
    pub body: Value,
    /// What it was answered: `429`, `tool`, `text`, `verdict:…`.
    pub answer: String,
    /// When it arrived.
    pub at: std::time::SystemTime,
}

#[derive(Debug, Default)]
struct Book {
    requests: Vec<Recorded>,
    /// Answers given that reported usage.
    usage_answers: u64,
    feedback_seen: bool,
}

/// A running fake model server.
pub struct FakeModel {
    pub port: u16,
    book: Arc<Mutex<Book>>,
    stop: tokio::sync::oneshot::Sender<()>,
}

struct Shared {
    script: Script,
    book: Arc<Mutex<Book>>,
}

impl FakeModel {
    /// Starts it on `0.0.0.0` (stage containers reach it at the bridge's gateway).
    pub async fn start(script: Script) -> FakeModel {
        let book = Arc::new(Mutex::new(Book::default()));
        let shared = Arc::new(Shared {
            script,
            book: Arc::clone(&book),
        });
        let app = axum::Router::new().fallback(answer).with_state(shared);
        let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await;
        });
        FakeModel { port, book, stop }
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.book.lock().unwrap().requests.clone()
    }

    /// How many answers reported usage (each [`INPUT_TOKENS`] and [`OUTPUT_TOKENS`]).
    pub fn usage_answers(&self) -> u64 {
        self.book.lock().unwrap().usage_answers
    }

    /// Stops it.
    pub fn stop(self) {
        let _ = self.stop.send(());
    }
}

/// The API a request speaks, from its path.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Api {
    Anthropic,
    Responses,
    Chat,
    Gemini { stream: bool },
}

async fn answer(
    State(shared): State<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let api = if path.ends_with("/messages") {
        Api::Anthropic
    } else if path.ends_with("/responses") {
        Api::Responses
    } else if path.ends_with("/chat/completions") {
        Api::Chat
    } else if path.contains(":streamGenerateContent") {
        Api::Gemini { stream: true }
    } else if path.contains(":generateContent") {
        Api::Gemini { stream: false }
    } else {
        // Model lists, token counts and the like: an empty success.
        return (
            StatusCode::OK,
            axum::Json(json!({"data": [], "models": []})),
        )
            .into_response();
    };
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = body.to_string();
    let key = ["x-api-key", "authorization", "x-goog-api-key"]
        .iter()
        .find_map(|name| headers.get(*name))
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let script = &shared.script;
    let mut book = shared.book.lock().unwrap();
    let (decision, response) = if book.requests.len() < script.rate_limited {
        ("429".to_string(), rate_limited(api, script.retry_after))
    } else {
        let reviewer = text.contains(&script.reviewer_mark);
        // A final reviewer works as an implementer does, writing its report instead.
        let final_review = !reviewer && text.contains(FINAL_REVIEW_MARK);
        let report =
            json!({"verdict": "approved", "summary": FINAL_SUMMARY, "findings": []}).to_string();
        let edit = |feedback_seen: bool| {
            if final_review {
                (FINAL_REVIEW_FILE, report.as_str())
            } else {
                script.edit(feedback_seen)
            }
        };
        let has_result = carries_tool_result(api, &body);
        let tools = offers_tools(api, &body);
        // The feedback itself, not the section's heading: a skill may name the heading.
        if !reviewer && text.contains(&script.feedback) {
            book.feedback_seen = true;
        }
        let title = !tools && text.contains("title generator");
        let (decision, reply) = if title {
            // opencode names its session; it reports no usage for this request, so neither
            // does the fake.
            ("title".to_string(), Reply::Text("forgepool task".into()))
        } else if reviewer {
            let verdict = if book.feedback_seen {
                script.approval.clone()
            } else {
                format!("REJECTED: {}", script.feedback)
            };
            if api == Api::Chat && only_bash(&body) && !has_result {
                // mini-swe-agent ends by submitting through its bash tool.
                let command =
                    format!("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo '{verdict}'");
                (
                    format!("verdict:{verdict}"),
                    Reply::Tool("bash", json!({"command": command})),
                )
            } else {
                (format!("verdict:{verdict}"), Reply::Text(verdict))
            }
        } else if !has_result && has_tool(&body, "Read") && has_tool(&body, "Write") {
            // Claude Code writes over an existing file only once it has read it.
            let (file, _) = edit(book.feedback_seen);
            let path = absolute(file);
            (
                "read".to_string(),
                Reply::Tool("Read", json!({"file_path": path})),
            )
        } else if has_result && last_tool_use(api, &body).as_deref() != Some("Read") {
            if api == Api::Chat && only_bash(&body) {
                let command = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo done";
                (
                    "submit".to_string(),
                    Reply::Tool("bash", json!({"command": command})),
                )
            } else {
                (
                    "text".to_string(),
                    Reply::Text("DONE: the file is written.".into()),
                )
            }
        } else if matches!(api, Api::Gemini { stream: false }) {
            // Gemini CLI's side questions (who speaks next, which model): the user, the same.
            let answer = r#"{"reasoning": "the task is done", "next_speaker": "user", "model_choice": "flash"}"#;
            ("side".to_string(), Reply::Text(answer.into()))
        } else if !tools {
            // aider: the edit as a whole file in its reply.
            let (file, content) = edit(book.feedback_seen);
            let reply = format!("{file}\n```\n{content}\n```\n");
            ("whole-edit".to_string(), Reply::Text(reply))
        } else {
            let (file, content) = edit(book.feedback_seen);
            ("tool".to_string(), tool_call(api, &body, file, content))
        };
        if !title {
            book.usage_answers += 1;
        }
        (decision, render(api, &body, reply, !title))
    };
    book.requests.push(Recorded {
        path,
        headers: headers.keys().map(|k| k.to_string()).collect(),
        key,
        body,
        answer: decision,
        at: std::time::SystemTime::now(),
    });
    response
}

enum Reply {
    Text(String),
    Tool(&'static str, Value),
}

impl Script {
    /// The file the implementer writes, and its content.
    fn edit(&self, feedback_seen: bool) -> (&str, &str) {
        match (&self.after_feedback, feedback_seen) {
            (Some((file, content)), true) => (file, content),
            _ => (&self.file, &self.content),
        }
    }
}

/// The implementer's edit, with the tool its CLI offers.
fn tool_call(api: Api, body: &Value, file: &str, content: &str) -> Reply {
    let absolute = absolute(file);
    if has_tool(body, "Write") {
        return Reply::Tool("Write", json!({"file_path": absolute, "content": content}));
    }
    if has_tool(body, "write_file") {
        return Reply::Tool(
            "write_file",
            json!({"file_path": absolute, "content": content}),
        );
    }
    if has_tool(body, "write") {
        return Reply::Tool("write", json!({"filePath": absolute, "content": content}));
    }
    let shell = format!("printf '%s\\n' '{}' > {}", content, absolute);
    if has_tool(body, "exec_command") {
        return Reply::Tool("exec_command", json!({"cmd": shell}));
    }
    if has_tool(body, "shell") {
        return Reply::Tool("shell", json!({"command": ["bash", "-lc", shell]}));
    }
    let _ = api;
    Reply::Tool("bash", json!({"command": shell}))
}

/// A file's path in the container: relative ones are the workspace's.
fn absolute(file: &str) -> String {
    if file.starts_with('/') {
        file.to_string()
    } else {
        format!("/workspace/{file}")
    }
}

/// Whether the request offers a tool of this name.
fn has_tool(body: &Value, name: &str) -> bool {
    let tools = body.get("tools").and_then(Value::as_array);
    let mut names = Vec::new();
    for tool in tools.into_iter().flatten() {
        for pointer in ["/name", "/function/name"] {
            if let Some(n) = tool.pointer(pointer).and_then(Value::as_str) {
                names.push(n.to_string());
            }
        }
        for declaration in tool
            .get("functionDeclarations")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(n) = declaration.get("name").and_then(Value::as_str) {
                names.push(n.to_string());
            }
        }
    }
    names.iter().any(|n| n == name)
}

/// mini-swe-agent's one tool: `bash`, with which it also submits.
fn only_bash(body: &Value) -> bool {
    body.get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| tools.len() == 1)
        && has_tool(body, "bash")
}

fn offers_tools(_api: Api, body: &Value) -> bool {
    body.get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
}

/// The name of the tool the model called last (Anthropic Messages only).
fn last_tool_use(api: Api, body: &Value) -> Option<String> {
    if api != Api::Anthropic {
        return None;
    }
    let messages = body.get("messages")?.as_array()?;
    let assistant = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))?;
    let blocks = assistant.get("content")?.as_array()?;
    blocks
        .iter()
        .rev()
        .find(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
        .and_then(|b| b.get("name")?.as_str().map(str::to_string))
}

/// Whether the request's last turn carries a tool's result.
fn carries_tool_result(api: Api, body: &Value) -> bool {
    match api {
        Api::Anthropic => body
            .get("messages")
            .and_then(Value::as_array)
            .and_then(|m| m.last())
            .is_some_and(|m| m.to_string().contains("\"tool_result\"")),
        Api::Responses => body
            .get("input")
            .and_then(Value::as_array)
            .is_some_and(|items| {
                items
                    .iter()
                    .any(|i| i.get("type").and_then(Value::as_str) == Some("function_call_output"))
            }),
        Api::Chat => body
            .get("messages")
            .and_then(Value::as_array)
            .and_then(|m| m.last())
            .is_some_and(|m| m.get("role").and_then(Value::as_str) == Some("tool")),
        Api::Gemini { .. } => body
            .get("contents")
            .and_then(Value::as_array)
            .and_then(|c| c.last())
            .is_some_and(|c| c.to_string().contains("functionResponse")),
    }
}

fn rate_limited(api: Api, retry_after: u64) -> Response {
    let message = format!("Rate limit reached for requests. Please try again in {retry_after}s.");
    let body = match api {
        Api::Anthropic => {
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": message}})
        }
        Api::Gemini { .. } => {
            json!({"error": {"code": 429, "message": format!("Resource has been exhausted (e.g. check quota). Please retry in {retry_after}s."), "status": "RESOURCE_EXHAUSTED"}})
        }
        Api::Responses | Api::Chat => {
            json!({"error": {"message": message, "type": "requests", "code": "rate_limit_exceeded"}})
        }
    };
    (
        StatusCode::TOO_MANY_REQUESTS,
        [
            ("retry-after", retry_after.to_string()),
            ("content-type", "application/json".to_string()),
        ],
        body.to_string(),
    )
        .into_response()
}

fn sse(events: Vec<(Option<&str>, Value)>) -> Response {
    let mut text = String::new();
    for (name, data) in events {
        if let Some(name) = name {
            text.push_str(&format!("event: {name}\n"));
        }
        text.push_str(&format!("data: {data}\n\n"));
    }
    (
        StatusCode::OK,
        [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
        ],
        text,
    )
        .into_response()
}

/// The answer in the request's API; `metered` answers report [`INPUT_TOKENS`] and
/// [`OUTPUT_TOKENS`], the others none.
fn render(api: Api, body: &Value, reply: Reply, metered: bool) -> Response {
    let (input, output) = if metered {
        (INPUT_TOKENS, OUTPUT_TOKENS)
    } else {
        (0, 0)
    };
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("fake-model")
        .to_string();
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    match api {
        Api::Anthropic => anthropic(&model, reply, input, output),
        Api::Responses => responses(&model, reply, input, output),
        Api::Chat if stream => chat_stream(&model, reply, input, output),
        Api::Chat => chat(&model, reply, input, output),
        Api::Gemini { stream } => gemini(reply, stream, input, output),
    }
}

fn anthropic(model: &str, reply: Reply, input: u64, output: u64) -> Response {
    let (block, delta, stop) = match reply {
        Reply::Text(text) => (
            json!({"type": "text", "text": ""}),
            json!({"type": "text_delta", "text": text}),
            "end_turn",
        ),
        Reply::Tool(name, input) => (
            json!({"type": "tool_use", "id": format!("toolu_{}", uuid::Uuid::new_v4().simple()), "name": name, "input": {}}),
            json!({"type": "input_json_delta", "partial_json": input.to_string()}),
            "tool_use",
        ),
    };
    sse(vec![
        (
            Some("message_start"),
            json!({"type": "message_start", "message": {"id": "msg_fake", "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "usage": {"input_tokens": input, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}),
        ),
        (
            Some("content_block_start"),
            json!({"type": "content_block_start", "index": 0, "content_block": block}),
        ),
        (
            Some("content_block_delta"),
            json!({"type": "content_block_delta", "index": 0, "delta": delta}),
        ),
        (
            Some("content_block_stop"),
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            Some("message_delta"),
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": output}}),
        ),
        (Some("message_stop"), json!({"type": "message_stop"})),
    ])
}

fn responses(model: &str, reply: Reply, input: u64, output: u64) -> Response {
    let item = match reply {
        Reply::Text(text) => {
            json!({"type": "message", "id": "msg_fake", "role": "assistant", "status": "completed", "content": [{"type": "output_text", "text": text, "annotations": []}]})
        }
        Reply::Tool(name, input) => {
            json!({"type": "function_call", "id": "fc_fake", "call_id": format!("call_{}", uuid::Uuid::new_v4().simple()), "name": name, "arguments": input.to_string(), "status": "completed"})
        }
    };
    let usage = json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input + output});
    let response = json!({"id": "resp_fake", "object": "response", "model": model, "status": "completed", "output": [item.clone()], "usage": usage});
    sse(vec![
        (
            Some("response.created"),
            json!({"type": "response.created", "response": {"id": "resp_fake", "model": model, "status": "in_progress", "output": []}}),
        ),
        (
            Some("response.output_item.added"),
            json!({"type": "response.output_item.added", "output_index": 0, "item": item}),
        ),
        (
            Some("response.output_item.done"),
            json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
        ),
        (
            Some("response.completed"),
            json!({"type": "response.completed", "response": response}),
        ),
    ])
}

fn chat_message(reply: Reply) -> (Value, &'static str) {
    match reply {
        Reply::Text(text) => (json!({"role": "assistant", "content": text}), "stop"),
        Reply::Tool(name, input) => (
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("call_{}", uuid::Uuid::new_v4().simple()), "type": "function", "function": {"name": name, "arguments": input.to_string()}}]}),
            "tool_calls",
        ),
    }
}

fn chat_usage(input: u64, output: u64) -> Value {
    json!({"prompt_tokens": input, "completion_tokens": output, "total_tokens": input + output})
}

fn chat(model: &str, reply: Reply, input: u64, output: u64) -> Response {
    let (message, finish) = chat_message(reply);
    axum::Json(json!({"id": "chatcmpl-fake", "object": "chat.completion", "created": 1_700_000_000, "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": chat_usage(input, output)})).into_response()
}

fn chat_stream(model: &str, reply: Reply, input: u64, output: u64) -> Response {
    let (message, finish) = chat_message(reply);
    let mut delta = message.clone();
    if let Some(calls) = delta.get_mut("tool_calls").and_then(Value::as_array_mut) {
        for (index, call) in calls.iter_mut().enumerate() {
            call["index"] = json!(index);
        }
    }
    let chunk = |choices: Value, usage: Value| json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1_700_000_000, "model": model, "choices": choices, "usage": usage});
    let mut text = String::new();
    for data in [
        chunk(
            json!([{"index": 0, "delta": delta, "finish_reason": null}]),
            Value::Null,
        ),
        chunk(
            json!([{"index": 0, "delta": {}, "finish_reason": finish}]),
            Value::Null,
        ),
        chunk(json!([]), chat_usage(input, output)),
    ] {
        text.push_str(&format!("data: {data}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    (
        StatusCode::OK,
        [("content-type", "text/event-stream")],
        text,
    )
        .into_response()
}

fn gemini(reply: Reply, stream: bool, input: u64, output: u64) -> Response {
    let part = match reply {
        Reply::Text(text) => json!({"text": text}),
        Reply::Tool(name, input) => json!({"functionCall": {"name": name, "args": input}}),
    };
    let chunk = json!({"candidates": [{"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}], "usageMetadata": {"promptTokenCount": input, "candidatesTokenCount": output, "totalTokenCount": input + output}, "modelVersion": "fake-model"});
    if stream {
        sse(vec![(None, chunk)])
    } else {
        axum::Json(chunk).into_response()
    }
}
