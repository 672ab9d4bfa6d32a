//! What the gateway reads of a request body before it is forwarded: only the fields that
//! decide its worst case and whether it may go at all (model, output limits, how many answers,
//! streaming, tools), read by serde straight from the bytes, every other value skipped
//! without being built (a 31 MiB body costs its own bytes, not a JSON tree of 16 times
//! that). A field of the wrong type, or one named twice, refuses the request: the provider
//! might read it otherwise than the gateway did.

use std::fmt;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::api::Api;
use crate::ledger::Amount;
use crate::providers::{Price, DEFAULT_MAX_OUTPUT_TOKENS};

/// The most answers one request may ask for (`n`, `candidateCount`): OpenAI's own bound.
pub const MAX_CHOICES: u64 = 128;

/// What a request asks for, as far as its cost and reach go.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Asked {
    /// The model in the body (Gemini names it in the path).
    pub model: Option<String>,
    /// The output allowance of one answer, if the request sets one.
    pub output_limit: Option<u64>,
    /// Thinking tokens allowed beside the output allowance (Gemini's `thinkingBudget`).
    pub thinking: u64,
    /// How many answers it asks for.
    pub choices: u64,
    /// Whether it asks for a stream (Chat Completions' `stream`).
    pub stream: bool,
    /// Whether a Chat Completions stream asks for its usage (`stream_options.include_usage`);
    /// `None` when `stream_options` is absent.
    pub include_usage: Option<bool>,
    /// The server-side tools it names (tools the provider runs: web search, fetch, MCP,
    /// code execution), by their normalized names (`web_search`, `mcp`, `url_context`).
    pub server_tools: Vec<String>,
    /// A service tier priced above the price table (`priority`, `scale`), if asked.
    pub dear_tier: Option<String>,
}

/// A request's worst case in tokens of each kind, and its price.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Worst {
    /// Every byte of the body as a prompt token (a token is at least a byte).
    pub input: u64,
    /// Every answer's whole output allowance.
    pub output: u64,
    /// Their price at the dearest rate each may take.
    pub cost_usd: f64,
}

impl Worst {
    /// The request's worst case as the ledger counts it.
    pub fn amount(&self) -> Amount {
        Amount {
            tokens: self.input.saturating_add(self.output),
            cost_usd: self.cost_usd,
        }
    }
}

impl Asked {
    /// Reads a request body of `api`; the error names the field and says what was wrong.
    pub fn read(api: Api, body: &[u8]) -> Result<Asked, String> {
        let mut asked = match api {
            Api::Gemini => {
                let body: GeminiBody =
                    serde_json::from_slice(body).map_err(|e| format!("the request's body: {e}"))?;
                let config = body.generation_config.unwrap_or_default();
                let mut server_tools = Vec::new();
                for tool in body.tools.unwrap_or_default() {
                    server_tools.extend(tool.keys.iter().filter_map(|k| gemini_server_tool(k)));
                }
                Asked {
                    model: None,
                    output_limit: config.max_output_tokens,
                    thinking: config
                        .thinking_config
                        .and_then(|t| t.thinking_budget)
                        .map_or(0, |b| u64::try_from(b).unwrap_or(0)),
                    choices: config.candidate_count.unwrap_or(1),
                    server_tools,
                    ..Asked::default()
                }
            }
            _ => {
                let body: Body =
                    serde_json::from_slice(body).map_err(|e| format!("the request's body: {e}"))?;
                let output_limit = match api {
                    Api::AnthropicMessages => body.max_tokens,
                    Api::OpenaiResponses => body.max_output_tokens,
                    // Either bounds the answer; the larger is the worst case.
                    _ => match (body.max_completion_tokens, body.max_tokens) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        (a, b) => a.or(b),
                    },
                };
                let mut server_tools: Vec<String> = body
                    .tools
                    .unwrap_or_default()
                    .iter()
                    .flat_map(Tool::kinds)
                    .filter_map(|kind| server_tool(api, kind))
                    .collect();
                if api == Api::AnthropicMessages && body.mcp_servers.is_some() {
                    server_tools.push("mcp".into());
                }
                if api == Api::OpenaiChat && body.web_search_options.is_some() {
                    server_tools.push("web_search".into());
                }
                let choices = match api {
                    Api::OpenaiChat => body.n.unwrap_or(1),
                    _ => 1,
                };
                Asked {
                    model: body.model,
                    output_limit,
                    thinking: 0,
                    choices,
                    stream: api == Api::OpenaiChat && body.stream == Some(true),
                    include_usage: body.stream_options.map(|o| o.include_usage == Some(true)),
                    server_tools,
                    dear_tier: body
                        .service_tier
                        .filter(|t| matches!(t.as_str(), "priority" | "scale")),
                }
            }
        };
        if asked.choices > MAX_CHOICES {
            return Err(format!(
                "the request asks for {} answers (n / candidateCount); the gateway forwards at most {MAX_CHOICES}",
                asked.choices
            ));
        }
        asked.choices = asked.choices.max(1);
        asked.server_tools.sort();
        asked.server_tools.dedup();
        Ok(asked)
    }

    /// The request's worst case: every byte of its `body_bytes` a prompt token, every answer
    /// it asks for writing its whole allowance (the request's, else the model's, else
    /// [`DEFAULT_MAX_OUTPUT_TOKENS`]) and its thinking budget, each priced at the dearest
    /// rate it may take.
    pub fn worst_case(&self, body_bytes: usize, price: &Price) -> Worst {
        let allowance = self
            .output_limit
            .or(price.max_output_tokens)
            .unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS)
            .saturating_add(self.thinking);
        let output = allowance.saturating_mul(self.choices.max(1));
        let input = body_bytes as u64;
        Worst {
            input,
            output,
            cost_usd: (input as f64 * price.dearest_per_mtok()
                + output as f64 * price.output_per_mtok)
                / 1_000_000.0,
        }
    }
}

/// Tool types (undated) the provider runs itself, reaching addresses a request names or
/// billing beside the tokens: refused unless a profile allows them by name.
const SERVER_TOOLS: [&str; 14] = [
    "web_search",
    "web_search_preview",
    "web_fetch",
    "code_execution",
    "bash_code_execution",
    "text_editor_code_execution",
    "mcp",
    "mcp_toolset",
    "file_search",
    "code_interpreter",
    "image_generation",
    "url_context",
    "google_search",
    "google_search_retrieval",
];

/// The normalized name of a server-side tool, when `kind` is one (any API's spelling, dated
/// or not: `web_search_20250305`, `web_search_preview_2025_03_11`); `None` for a client's tool.
fn server_tool(_api: Api, kind: Option<&str>) -> Option<String> {
    let name = undated(kind?);
    let known = SERVER_TOOLS.contains(&name.as_str())
        || SERVER_TOOLS
            .iter()
            .any(|tool| name.starts_with(&format!("{tool}_")))
        || name.contains("mcp");
    known.then_some(name)
}

/// `web_search_20250305` → `web_search`; `web_search_preview` stays.
fn undated(kind: &str) -> String {
    match kind.rsplit_once('_') {
        Some((name, date)) if date.len() == 8 && date.bytes().all(|b| b.is_ascii_digit()) => {
            name.to_string()
        }
        _ => kind.to_string(),
    }
}

/// A Gemini tool's key, when it is a server-side tool, in snake case (the API takes
/// `googleSearch` and `google_search` alike).
fn gemini_server_tool(key: &str) -> Option<String> {
    let mut name = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            name.push('_');
            name.push(c.to_ascii_lowercase());
        } else {
            name.push(c);
        }
    }
    const GEMINI: [&str; 8] = [
        "google_search",
        "google_search_retrieval",
        "url_context",
        "code_execution",
        "google_maps",
        "enterprise_web_search",
        "file_search",
        "retrieval",
    ];
    (GEMINI.contains(&name.as_str()) || name.contains("mcp")).then_some(name)
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
    n: Option<u64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    tools: Option<Vec<Tool>>,
    mcp_servers: Option<IgnoredAny>,
    web_search_options: Option<IgnoredAny>,
    service_tier: Option<String>,
}

#[derive(Deserialize, Default)]
struct GeminiBody {
    #[serde(rename = "generationConfig", alias = "generation_config")]
    generation_config: Option<GenerationConfig>,
    tools: Option<Vec<Tool>>,
}

#[derive(Deserialize, Default)]
struct GenerationConfig {
    #[serde(rename = "maxOutputTokens", alias = "max_output_tokens")]
    max_output_tokens: Option<u64>,
    #[serde(rename = "candidateCount", alias = "candidate_count")]
    candidate_count: Option<u64>,
    #[serde(rename = "thinkingConfig", alias = "thinking_config")]
    thinking_config: Option<ThinkingConfig>,
}

#[derive(Deserialize)]
struct ThinkingConfig {
    #[serde(rename = "thinkingBudget", alias = "thinking_budget")]
    thinking_budget: Option<i64>,
}

/// One entry of `tools`: its `type` (OpenAI's and Anthropic's), and every key it has
/// (Gemini's tools are told apart by their key), values skipped.
struct Tool {
    kind: Option<String>,
    keys: Vec<String>,
    /// Tools grouped inside this one (Codex's `namespace`), read the same way.
    nested: Vec<Tool>,
}

impl Tool {
    /// This tool's type and its nested tools' types.
    fn kinds(&self) -> Vec<Option<&str>> {
        let mut kinds = vec![self.kind.as_deref()];
        for tool in &self.nested {
            kinds.extend(tool.kinds());
        }
        kinds
    }
}

impl<'de> Deserialize<'de> for Tool {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Tool, D::Error> {
        struct ToolVisitor;
        impl<'de> Visitor<'de> for ToolVisitor {
            type Value = Tool;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tool object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Tool, A::Error> {
                let mut tool = Tool {
                    kind: None,
                    keys: Vec::new(),
                    nested: Vec::new(),
                };
                while let Some(key) = map.next_key::<String>()? {
                    if key == "type" {
                        if tool.kind.is_some() {
                            return Err(serde::de::Error::duplicate_field("type"));
                        }
                        tool.kind = Some(map.next_value::<String>()?);
                    } else if key == "tools" {
                        tool.nested = map.next_value::<Vec<Tool>>()?;
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                    if tool.keys.len() < 64 {
                        tool.keys.push(key);
                    }
                }
                Ok(tool)
            }
        }
        deserializer.deserialize_map(ToolVisitor)
    }
}

/// Asks a Chat Completions stream for its usage: `"stream_options":{"include_usage":true}`
/// put first in the body's object, in place (the body was read with room for it). Only for a
/// body without `stream_options`, so the key is never named twice.
pub fn ask_for_usage(body: &mut Vec<u8>) -> bool {
    const OPTIONS: &[u8] = br#""stream_options":{"include_usage":true},"#;
    let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace()) else {
        return false;
    };
    if body[open] != b'{' {
        return false;
    }
    let empty = body[open + 1..]
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|b| *b == b'}');
    let insert: &[u8] = if empty {
        &OPTIONS[..OPTIONS.len() - 1]
    } else {
        OPTIONS
    };
    body.splice(open + 1..open + 1, insert.iter().copied());
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn price() -> Price {
        Price {
            input_per_mtok: 1.0,
            output_per_mtok: 10.0,
            max_output_tokens: Some(1000),
            ..Price::default()
        }
    }

    /// Catches: `n` or `candidateCount` not multiplying the allowance (77x past a budget),
    /// Gemini's snake-case spelling or thinking budget missed, a missing limit reserved as
    /// nothing.
    #[test]
    fn the_worst_case_counts_every_answer_asked_for() {
        let chat = Asked::read(
            Api::OpenaiChat,
            br#"{"model":"m","max_tokens":100,"n":64,"messages":[]}"#,
        )
        .unwrap();
        assert_eq!(chat.worst_case(10, &price()).output, 6400);
        let gemini = Asked::read(
            Api::Gemini,
            br#"{"generation_config":{"candidate_count":8,"max_output_tokens":50,"thinkingConfig":{"thinkingBudget":25}}}"#,
        )
        .unwrap();
        assert_eq!(gemini.worst_case(0, &price()).output, 600);
        let none = Asked::read(Api::AnthropicMessages, br#"{"model":"m"}"#).unwrap();
        let worst = none.worst_case(100, &price());
        assert_eq!((worst.input, worst.output), (100, 1000));
        assert!((worst.cost_usd - (100.0 + 10_000.0) / 1e6).abs() < 1e-12);
        assert!(Asked::read(Api::OpenaiChat, br#"{"n":100000}"#)
            .unwrap_err()
            .contains("answers"));
    }

    /// Catches: a field read two ways (named twice, or of another type than the provider
    /// reads), which would let the provider see another allowance than the one reserved.
    #[test]
    fn a_field_named_twice_or_mistyped_is_refused() {
        for body in [
            br#"{"max_tokens":1,"max_tokens":100000}"#.as_slice(),
            br#"{"max_tokens":"100000"}"#,
            br#"{"n":2.5}"#,
            br#"{"generationConfig":{"candidateCount":1},"generation_config":{"candidateCount":9}}"#,
            br#"not json"#,
        ] {
            let api = if body.starts_with(br#"{"gen"#) {
                Api::Gemini
            } else {
                Api::OpenaiChat
            };
            assert!(
                Asked::read(api, body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    /// Catches: a server-side tool (one the provider runs against any address) taken for the
    /// client's, or a client tool refused.
    #[test]
    fn server_side_tools_are_named() {
        let anthropic = Asked::read(
            Api::AnthropicMessages,
            br#"{"tools":[{"name":"Bash","input_schema":{}},{"type":"bash_20250124","name":"bash"},{"type":"web_fetch_20250910","name":"web_fetch"}],"mcp_servers":[{"url":"https://x"}]}"#,
        )
        .unwrap();
        assert_eq!(anthropic.server_tools, ["mcp", "web_fetch"]);
        let responses = Asked::read(
            Api::OpenaiResponses,
            br#"{"tools":[{"type":"function","name":"f"},{"type":"mcp","server_url":"https://x"},{"type":"web_search"},{"type":"namespace","tools":[{"type":"function"},{"type":"web_search_preview"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            responses.server_tools,
            ["mcp", "web_search", "web_search_preview"]
        );
        let codex = Asked::read(
            Api::OpenaiResponses,
            br#"{"tools":[{"type":"namespace","name":"n","tools":[{"type":"function","name":"f"}]},{"type":"local_shell"},{"type":"custom","name":"apply_patch"}]}"#,
        )
        .unwrap();
        assert!(codex.server_tools.is_empty(), "{:?}", codex.server_tools);
        let gemini = Asked::read(
            Api::Gemini,
            br#"{"tools":[{"functionDeclarations":[]},{"urlContext":{}},{"google_search":{}}]}"#,
        )
        .unwrap();
        assert_eq!(gemini.server_tools, ["google_search", "url_context"]);
        let chat = Asked::read(
            Api::OpenaiChat,
            br#"{"web_search_options":{},"tools":[{"type":"function","function":{}}]}"#,
        )
        .unwrap();
        assert_eq!(chat.server_tools, ["web_search"]);
        let tier = Asked::read(Api::OpenaiChat, br#"{"service_tier":"priority"}"#).unwrap();
        assert_eq!(tier.dear_tier.as_deref(), Some("priority"));
    }

    /// Catches: a stream without usage left as it is (settled at nothing), or a body made
    /// invalid by the insertion.
    #[test]
    fn a_chat_stream_is_asked_for_its_usage() {
        for body in [r#"{"stream":true}"#, r#"  { }"#, r#"{}"#] {
            let mut bytes = body.as_bytes().to_vec();
            assert!(ask_for_usage(&mut bytes));
            let value: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(value["stream_options"]["include_usage"], true, "{body}");
        }
        let asked = Asked::read(Api::OpenaiChat, br#"{"stream":true}"#).unwrap();
        assert!(asked.stream && asked.include_usage.is_none());
    }
}
