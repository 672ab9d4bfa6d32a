//! The model APIs the gateway speaks, as data: the paths a stage may call, where a client puts
//! its credential and where the provider wants its key, what a request asks for (model,
//! output limit), and where each answer states its usage.

use http::{HeaderMap, Method};
use serde_json::Value;

use crate::Counts;

/// A model API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// Anthropic Messages (`/v1/messages`).
    AnthropicMessages,
    /// OpenAI Responses (`/v1/responses`).
    OpenaiResponses,
    /// OpenAI Chat Completions and the APIs compatible with it (`/v1/chat/completions`).
    OpenaiChat,
    /// Google Gemini (`/v1beta/models/{model}:generateContent`).
    Gemini,
}

/// A route a stage may call: its method, and its path as fixed segments where `*` is one
/// segment of the caller's choosing (a model name).
struct Route {
    method: Method,
    path: &'static str,
    /// Whether the route spends tokens (it is reserved for and metered).
    spends: bool,
}

const fn post(path: &'static str) -> Route {
    Route {
        method: Method::POST,
        path,
        spends: true,
    }
}

const fn free(method: Method, path: &'static str) -> Route {
    Route {
        method,
        path,
        spends: false,
    }
}

static ANTHROPIC: [Route; 3] = [
    post("/v1/messages"),
    free(Method::POST, "/v1/messages/count_tokens"),
    free(Method::GET, "/v1/models"),
];
static RESPONSES: [Route; 2] = [post("/v1/responses"), free(Method::GET, "/v1/models")];
static CHAT: [Route; 2] = [
    post("/v1/chat/completions"),
    free(Method::GET, "/v1/models"),
];
static GEMINI: [Route; 4] = [
    post("/v1beta/models/*:generateContent"),
    post("/v1beta/models/*:streamGenerateContent"),
    free(Method::POST, "/v1beta/models/*:countTokens"),
    free(Method::GET, "/v1beta/models"),
];

/// What the gateway makes of a request's route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// A call that spends tokens: reserved, forwarded, metered.
    Spending,
    /// A call that spends nothing (token counts, model lists): forwarded.
    Free,
}

impl Api {
    /// Every API, in the order messages list them.
    pub const ALL: [Api; 4] = [
        Api::AnthropicMessages,
        Api::OpenaiResponses,
        Api::OpenaiChat,
        Api::Gemini,
    ];

    /// The name the providers file uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::AnthropicMessages => "anthropic-messages",
            Api::OpenaiResponses => "openai-responses",
            Api::OpenaiChat => "openai-chat",
            Api::Gemini => "gemini",
        }
    }

    /// The API a providers file names.
    pub fn parse(text: &str) -> Option<Api> {
        Api::ALL.into_iter().find(|api| api.as_str() == text)
    }

    /// The API an agent kind's CLI speaks (SPEC 16); `None` for `command`, which may speak any.
    pub fn of_kind(kind: proto::AgentKind) -> Option<Api> {
        use proto::AgentKind::*;
        match kind {
            Command => None,
            ClaudeCode => Some(Api::AnthropicMessages),
            Codex => Some(Api::OpenaiResponses),
            GeminiCli => Some(Api::Gemini),
            Opencode | Aider | MiniSweAgent => Some(Api::OpenaiChat),
        }
    }

    /// What the CLI's base URL adds after the provider's root: OpenAI's clients expect `/v1`
    /// in it, Anthropic's and Gemini's add their version themselves.
    pub fn base_suffix(self) -> &'static str {
        match self {
            Api::OpenaiResponses | Api::OpenaiChat => "/v1",
            Api::AnthropicMessages | Api::Gemini => "",
        }
    }

    fn routes(self) -> &'static [Route] {
        match self {
            Api::AnthropicMessages => &ANTHROPIC,
            Api::OpenaiResponses => &RESPONSES,
            Api::OpenaiChat => &CHAT,
            Api::Gemini => &GEMINI,
        }
    }

    /// Whether a stage may call `method path` (the path after the provider's prefix, without
    /// the query), and what the call is; `None` for anything else.
    pub fn route(self, method: &Method, path: &str) -> Option<Call> {
        self.routes()
            .iter()
            .find(|route| route.method == *method && matches_path(route.path, path))
            .map(|route| {
                if route.spends {
                    Call::Spending
                } else {
                    Call::Free
                }
            })
    }

    /// The credential the client sent: where the API's own clients put the key.
    pub fn client_credential(self, headers: &HeaderMap, query: Option<&str>) -> Option<String> {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let bearer = || {
            header("authorization")
                .and_then(|v| v.strip_prefix("Bearer ").map(|t| t.trim().to_string()))
        };
        match self {
            Api::AnthropicMessages => header("x-api-key").or_else(bearer),
            Api::OpenaiResponses | Api::OpenaiChat => bearer(),
            Api::Gemini => header("x-goog-api-key").or_else(|| {
                query?
                    .split('&')
                    .find_map(|pair| pair.strip_prefix("key=").map(str::to_string))
            }),
        }
    }

    /// The header the provider takes its key in, and its value.
    pub fn key_header(self, key: &str) -> (&'static str, String) {
        match self {
            Api::AnthropicMessages => ("x-api-key", key.to_string()),
            Api::OpenaiResponses | Api::OpenaiChat => ("authorization", format!("Bearer {key}")),
            Api::Gemini => ("x-goog-api-key", key.to_string()),
        }
    }

    /// The query forwarded: the client's, without a credential in it.
    pub fn forwarded_query(self, query: Option<&str>) -> Option<String> {
        let kept: Vec<&str> = query?
            .split('&')
            .filter(|pair| !pair.is_empty() && !pair.starts_with("key="))
            .collect();
        (!kept.is_empty()).then(|| kept.join("&"))
    }

    /// The model a request asks for: for Gemini in its path, else `in_body`.
    pub fn requested_model(self, path: &str, in_body: Option<String>) -> Option<String> {
        match self {
            Api::Gemini => path
                .rsplit('/')
                .next()
                .and_then(|last| last.split(':').next())
                .map(str::to_string),
            _ => in_body,
        }
    }

    /// Reads the usage one JSON value of an answer states (a whole body, or one event of a
    /// stream) into `counts`. Streams state usage more than once: Anthropic's input in
    /// `message_start` and a running output count in each `message_delta`, Gemini a running
    /// total in every chunk; each figure is kept at its largest, so a repeat never adds.
    /// Returns whether the value states the answer's final usage (Anthropic's `message_delta`
    /// or whole message, a Responses answer's end, a Chat Completions usage object, a Gemini
    /// chunk that ends its candidates): an answer that never does is settled at its
    /// reservation.
    pub fn observe(self, value: &Value, counts: &mut Counts) -> bool {
        match self {
            Api::AnthropicMessages => anthropic(value, counts),
            Api::OpenaiResponses => responses(value, counts),
            Api::OpenaiChat => chat(value, counts),
            Api::Gemini => gemini(value, counts),
        }
    }
}

fn matches_path(pattern: &str, path: &str) -> bool {
    let mut expected = pattern.split('/');
    let mut given = path.split('/');
    loop {
        match (expected.next(), given.next()) {
            (None, None) => return true,
            (Some(want), Some(got)) if segment_matches(want, got) => {}
            _ => return false,
        }
    }
}

/// A segment: equal, or `*` followed by an optional fixed tail (`*:generateContent`) where the
/// wildcard part is a plain name (no `..`, no empty name).
fn segment_matches(want: &str, got: &str) -> bool {
    match want.strip_prefix('*') {
        None => want == got,
        Some(tail) => got.strip_suffix(tail).is_some_and(|name| {
            !name.is_empty()
                && name != ".."
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
        }),
    }
}

fn number(value: &Value, path: &[&str]) -> Option<u64> {
    let mut at = value;
    for key in path {
        at = at.get(key)?;
    }
    at.as_u64()
}

fn model_of(value: &Value, counts: &mut Counts) {
    if let Some(model) = value.get("model").and_then(Value::as_str) {
        counts.set_model(model);
    }
}

fn anthropic(value: &Value, counts: &mut Counts) -> bool {
    let kind = value.get("type").and_then(Value::as_str);
    let (usage, holder) = match kind {
        Some("message_start") => match value.get("message") {
            Some(message) => (message.get("usage"), message),
            None => return false,
        },
        Some("message_delta") | Some("message") => (value.get("usage"), value),
        _ => return false,
    };
    model_of(holder, counts);
    let Some(usage) = usage.filter(|u| u.is_object()) else {
        return false;
    };
    counts.keep_max(
        number(usage, &["input_tokens"]),
        number(usage, &["output_tokens"]),
        number(usage, &["cache_read_input_tokens"]),
        number(usage, &["cache_creation_input_tokens"]),
    );
    kind != Some("message_start")
}

/// OpenAI and Gemini count cached tokens inside the prompt's; forgepool, like Anthropic,
/// counts them apart, so the uncached input is the difference. Their usage objects state the
/// whole answer's figures so far (Gemini repeats them in every chunk), so the latest replaces
/// what was read before.
fn openai_counts(
    counts: &mut Counts,
    prompt: Option<u64>,
    output: Option<u64>,
    cached: Option<u64>,
) {
    let cached_tokens = cached.unwrap_or(0);
    if let Some(prompt) = prompt {
        counts.input = prompt.saturating_sub(cached_tokens);
        counts.cache_read = cached_tokens;
    }
    if let Some(output) = output {
        counts.output = output;
    }
}

fn responses(value: &Value, counts: &mut Counts) -> bool {
    let response = match value.get("type").and_then(Value::as_str) {
        Some("response.completed") | Some("response.incomplete") | Some("response.failed") => {
            match value.get("response") {
                Some(response) => response,
                None => return false,
            }
        }
        Some("response") => value,
        _ if value.get("object").and_then(Value::as_str) == Some("response") => value,
        _ => return false,
    };
    model_of(response, counts);
    let Some(usage) = response.get("usage").filter(|u| u.is_object()) else {
        return false;
    };
    openai_counts(
        counts,
        number(usage, &["input_tokens"]),
        number(usage, &["output_tokens"]),
        number(usage, &["input_tokens_details", "cached_tokens"]),
    );
    true
}

fn chat(value: &Value, counts: &mut Counts) -> bool {
    model_of(value, counts);
    let Some(usage) = value.get("usage").filter(|u| u.is_object()) else {
        return false;
    };
    openai_counts(
        counts,
        number(usage, &["prompt_tokens"]),
        number(usage, &["completion_tokens"]),
        number(usage, &["prompt_tokens_details", "cached_tokens"]),
    );
    true
}

fn gemini(value: &Value, counts: &mut Counts) -> bool {
    if let Some(items) = value.as_array() {
        let mut stated = false;
        for item in items {
            stated |= gemini(item, counts);
        }
        return stated;
    }
    if let Some(model) = value.get("modelVersion").and_then(Value::as_str) {
        counts.set_model(model);
    }
    let Some(usage) = value.get("usageMetadata").filter(|u| u.is_object()) else {
        return false;
    };
    // Every chunk states the running figures; the last ends its candidates (or says why the
    // prompt was blocked).
    let ended = value
        .get("candidates")
        .and_then(Value::as_array)
        .is_some_and(|c| c.iter().any(|c| c.get("finishReason").is_some()))
        || value.pointer("/promptFeedback/blockReason").is_some();
    let cached = number(usage, &["cachedContentTokenCount"]);
    let output = match (
        number(usage, &["candidatesTokenCount"]),
        number(usage, &["thoughtsTokenCount"]),
    ) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    };
    openai_counts(counts, number(usage, &["promptTokenCount"]), output, cached);
    ended
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Catches: a path outside the API forwarded with the real key (another provider's path,
    /// an admin path, a traversal), or a real path refused.
    #[test]
    fn only_the_apis_own_paths_are_routes() {
        let cases = [
            (
                Api::AnthropicMessages,
                "POST",
                "/v1/messages",
                Some(Call::Spending),
            ),
            (
                Api::AnthropicMessages,
                "POST",
                "/v1/messages/count_tokens",
                Some(Call::Free),
            ),
            (Api::AnthropicMessages, "GET", "/v1/messages", None),
            (Api::AnthropicMessages, "POST", "/v1/responses", None),
            (
                Api::AnthropicMessages,
                "POST",
                "/v1/messages/../organizations",
                None,
            ),
            (
                Api::AnthropicMessages,
                "POST",
                "/v1/organizations/usage_report",
                None,
            ),
            (
                Api::OpenaiResponses,
                "POST",
                "/v1/responses",
                Some(Call::Spending),
            ),
            (Api::OpenaiResponses, "POST", "/v1/files", None),
            (
                Api::OpenaiChat,
                "POST",
                "/v1/chat/completions",
                Some(Call::Spending),
            ),
            (Api::OpenaiChat, "POST", "/v1/chat/completions/x", None),
            (
                Api::Gemini,
                "POST",
                "/v1beta/models/gemini-2.5-pro:streamGenerateContent",
                Some(Call::Spending),
            ),
            (
                Api::Gemini,
                "POST",
                "/v1beta/models/..:generateContent",
                None,
            ),
            (Api::Gemini, "POST", "/v1beta/models/:generateContent", None),
            (
                Api::Gemini,
                "POST",
                "/v1beta/tunedModels/x:generateContent",
                None,
            ),
        ];
        for (api, method, path, expected) in cases {
            let method = Method::from_bytes(method.as_bytes()).unwrap();
            assert_eq!(
                api.route(&method, path),
                expected,
                "{api:?} {method} {path}"
            );
        }
    }

    /// Catches: usage read from the wrong field, a stream's repeated figures added up, cached
    /// tokens counted twice (OpenAI's prompt count includes them).
    #[test]
    fn usage_is_read_where_each_api_states_it() {
        let mut counts = Counts::default();
        let api = Api::AnthropicMessages;
        api.observe(&json!({"type":"message_start","message":{"model":"claude-x","usage":{"input_tokens":10,"cache_read_input_tokens":5,"cache_creation_input_tokens":3,"output_tokens":1}}}), &mut counts);
        api.observe(
            &json!({"type":"message_delta","usage":{"output_tokens":7}}),
            &mut counts,
        );
        api.observe(
            &json!({"type":"message_delta","usage":{"output_tokens":9}}),
            &mut counts,
        );
        assert_eq!(
            (
                counts.input,
                counts.output,
                counts.cache_read,
                counts.cache_write
            ),
            (10, 9, 5, 3)
        );
        assert_eq!(counts.model.as_deref(), Some("claude-x"));

        let mut counts = Counts::default();
        Api::OpenaiResponses.observe(&json!({"type":"response.completed","response":{"model":"gpt-x","usage":{"input_tokens":100,"output_tokens":20,"input_tokens_details":{"cached_tokens":60}}}}), &mut counts);
        assert_eq!(
            (counts.input, counts.output, counts.cache_read),
            (40, 20, 60)
        );

        let mut counts = Counts::default();
        Api::OpenaiChat.observe(
            &json!({"model":"m","choices":[],"usage":{"prompt_tokens":50,"completion_tokens":5}}),
            &mut counts,
        );
        assert_eq!((counts.input, counts.output), (50, 5));

        let mut counts = Counts::default();
        let api = Api::Gemini;
        api.observe(
            &json!({"usageMetadata":{"promptTokenCount":30,"candidatesTokenCount":2}}),
            &mut counts,
        );
        api.observe(&json!({"usageMetadata":{"promptTokenCount":30,"candidatesTokenCount":6,"thoughtsTokenCount":4,"cachedContentTokenCount":10}}), &mut counts);
        assert_eq!(
            (counts.input, counts.output, counts.cache_read),
            (20, 10, 10)
        );
    }

    /// Catches: a credential looked for where the API's clients never send it, or the
    /// Gemini key forwarded upstream in the query.
    #[test]
    fn credentials_are_found_and_taken_out_of_the_query() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", "Bearer tok".parse().unwrap());
        assert_eq!(
            Api::OpenaiChat.client_credential(&headers, None).as_deref(),
            Some("tok")
        );
        assert_eq!(
            Api::AnthropicMessages
                .client_credential(&headers, None)
                .as_deref(),
            Some("tok")
        );
        assert_eq!(
            Api::Gemini
                .client_credential(&HeaderMap::new(), Some("alt=sse&key=abc"))
                .as_deref(),
            Some("abc")
        );
        assert_eq!(
            Api::Gemini
                .forwarded_query(Some("alt=sse&key=abc"))
                .as_deref(),
            Some("alt=sse")
        );
        assert_eq!(Api::Gemini.forwarded_query(Some("key=abc")), None);
    }
}
