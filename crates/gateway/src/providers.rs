//! The providers the gateway forwards to (SPEC 16): the built-in `anthropic`, `openai` and
//! `gemini`, and the operator's providers file (`FORGEPOOL_PROVIDERS_FILE`), whose entries add
//! providers or replace built-ins of the same name. A provider names its API (which decides
//! the paths forwarded, how the key is sent and how usage is read), its root URL, the worker's
//! variable holding its key, an optional CA file, and a price table.
//!
//! Both services read this file: the dispatcher to refuse a profile naming an unknown provider
//! or passing a key variable in `env`, the worker to forward. Only the worker reads keys.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::api::Api;

/// The variable naming the providers file.
pub const PROVIDERS_FILE_VARIABLE: &str = "FORGEPOOL_PROVIDERS_FILE";

/// Variables that hold a provider's key in the agents' own conventions: a profile's `env` may
/// never pass one into a stage, whatever the providers file says.
pub const KNOWN_KEY_VARIABLES: &[&str] = &[
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "OPENAI_API_KEY",
    "AZURE_OPENAI_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "OPENROUTER_API_KEY",
    "MISTRAL_API_KEY",
    "DEEPSEEK_API_KEY",
    "GROQ_API_KEY",
];

/// The output limit reserved for a request that names none and a model the price table does
/// not know: no current model writes more in one answer.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 128_000;

/// The Anthropic beta features forwarded when a providers file lists none (`betas`): those
/// Claude Code sends that change neither the price nor what the provider reaches. Features
/// priced apart (`context-1m-*`, `fast-mode-*`, `extended-cache-ttl-*`) or reaching other
/// addresses (`mcp-*`, `web-fetch-*`, `web-search-*`, `files-api-*`) are not among them.
pub const DEFAULT_BETAS: [&str; 11] = [
    "claude-code-20250219",
    "interleaved-thinking-2025-05-14",
    "context-management-2025-06-27",
    "advanced-tool-use-2025-11-20",
    "thinking-display-updates-2026-08-18",
    "thinking-token-count-2026-05-13",
    "fine-grained-tool-streaming-2025-05-14",
    "token-efficient-tools-2025-02-19",
    "effort-2025-11-24",
    "structured-outputs-2025-12-15",
    "redact-thinking-2026-02-12",
];

/// A model's prices in US dollars per million tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Uncached prompt tokens.
    #[serde(default)]
    pub input_per_mtok: f64,
    /// Completion tokens (thinking included).
    #[serde(default)]
    pub output_per_mtok: f64,
    /// Prompt tokens read from the cache.
    #[serde(default)]
    pub cache_read_per_mtok: f64,
    /// Prompt tokens written to the cache.
    #[serde(default)]
    pub cache_write_per_mtok: f64,
    /// The most tokens the model writes in one answer: reserved for a request that names
    /// no `max_tokens`.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
}

impl Price {
    /// What these counts cost.
    pub fn cost(&self, counts: &crate::Counts) -> f64 {
        (counts.input as f64 * self.input_per_mtok
            + counts.output as f64 * self.output_per_mtok
            + counts.cache_read as f64 * self.cache_read_per_mtok
            + counts.cache_write as f64 * self.cache_write_per_mtok)
            / 1_000_000.0
    }

    /// The most of any kind a token may cost: a request's worst case is priced with it.
    pub fn dearest_per_mtok(&self) -> f64 {
        [
            self.input_per_mtok,
            self.cache_write_per_mtok,
            self.cache_read_per_mtok,
        ]
        .into_iter()
        .fold(0.0, f64::max)
    }
}

/// One provider.
#[derive(Debug, Clone, PartialEq)]
pub struct Provider {
    /// The name profiles use (`provider = "anthropic"`).
    pub name: String,
    /// The API it speaks.
    pub api: Api,
    /// Its root, without a trailing slash: `https://api.anthropic.com`.
    pub base_url: String,
    /// The worker's variable holding its key.
    pub key_env: String,
    /// A CA file trusted beside the system roots for this provider.
    pub ca_file: Option<PathBuf>,
    /// Prices by model name; `"*"` prices every model not named.
    pub prices: BTreeMap<String, Price>,
    /// The `anthropic-beta` values a stage may send ([`DEFAULT_BETAS`] unless the file says).
    pub betas: Vec<String>,
    /// The organization the gateway names (`openai-organization`); a stage cannot choose one.
    pub organization: Option<String>,
    /// The project the gateway names (`openai-project`).
    pub project: Option<String>,
}

impl Provider {
    /// The price of `model`: its own, else the `"*"` entry, else nothing (free).
    pub fn price(&self, model: Option<&str>) -> Price {
        model
            .and_then(|m| {
                self.prices
                    .get(m)
                    .or_else(|| self.prices.get(base_model(m)))
            })
            .or_else(|| self.prices.get("*"))
            .copied()
            .unwrap_or_default()
    }
}

/// A dated model name's family (`claude-sonnet-4-5-20250929` → `claude-sonnet-4-5`), so
/// that a price table naming the family prices its snapshots.
fn base_model(model: &str) -> &str {
    match model.rsplit_once('-') {
        Some((family, date)) if date.len() == 8 && date.bytes().all(|b| b.is_ascii_digit()) => {
            family
        }
        _ => model,
    }
}

/// Every provider a process knows.
#[derive(Debug, Clone, PartialEq)]
pub struct Providers {
    list: Vec<Provider>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProvidersFile {
    #[serde(default)]
    provider: Vec<ProviderEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProviderEntry {
    name: String,
    api: String,
    base_url: String,
    key_env: String,
    #[serde(default)]
    ca_file: Option<PathBuf>,
    #[serde(default)]
    prices: BTreeMap<String, Price>,
    #[serde(default)]
    betas: Option<Vec<String>>,
    #[serde(default)]
    organization: Option<String>,
    #[serde(default)]
    project: Option<String>,
}

fn default_betas() -> Vec<String> {
    DEFAULT_BETAS.iter().map(|b| b.to_string()).collect()
}

impl Providers {
    /// The built-in providers (`anthropic`, `openai` through the Responses API, `openai-chat`
    /// through Chat Completions, `gemini`), with list prices as published in 2025 (override them in the
    /// providers file).
    pub fn builtin() -> Providers {
        let price = |input: f64, output: f64, read: f64, write: f64, max: u64| Price {
            input_per_mtok: input,
            output_per_mtok: output,
            cache_read_per_mtok: read,
            cache_write_per_mtok: write,
            max_output_tokens: Some(max),
        };
        let table = |entries: &[(&str, Price)]| {
            entries
                .iter()
                .map(|(model, price)| (model.to_string(), *price))
                .collect::<BTreeMap<_, _>>()
        };
        Providers {
            list: vec![
                Provider {
                    name: "anthropic".into(),
                    api: Api::AnthropicMessages,
                    base_url: "https://api.anthropic.com".into(),
                    key_env: "ANTHROPIC_API_KEY".into(),
                    ca_file: None,
                    betas: default_betas(),
                    organization: None,
                    project: None,
                    prices: table(&[
                        ("claude-opus-4-1", price(15.0, 75.0, 1.5, 18.75, 32_000)),
                        ("claude-sonnet-4-5", price(3.0, 15.0, 0.3, 3.75, 64_000)),
                        ("claude-haiku-4-5", price(1.0, 5.0, 0.1, 1.25, 64_000)),
                    ]),
                },
                Provider {
                    name: "openai".into(),
                    api: Api::OpenaiResponses,
                    base_url: "https://api.openai.com".into(),
                    key_env: "OPENAI_API_KEY".into(),
                    ca_file: None,
                    betas: default_betas(),
                    organization: None,
                    project: None,
                    prices: table(&[
                        ("gpt-5", price(1.25, 10.0, 0.125, 0.0, 128_000)),
                        ("gpt-5-mini", price(0.25, 2.0, 0.025, 0.0, 128_000)),
                        ("gpt-4.1", price(2.0, 8.0, 0.5, 0.0, 32_768)),
                    ]),
                },
                // The same provider through Chat Completions, for the kinds that speak it.
                Provider {
                    name: "openai-chat".into(),
                    api: Api::OpenaiChat,
                    base_url: "https://api.openai.com".into(),
                    key_env: "OPENAI_API_KEY".into(),
                    ca_file: None,
                    betas: default_betas(),
                    organization: None,
                    project: None,
                    prices: table(&[
                        ("gpt-5", price(1.25, 10.0, 0.125, 0.0, 128_000)),
                        ("gpt-5-mini", price(0.25, 2.0, 0.025, 0.0, 128_000)),
                        ("gpt-4.1", price(2.0, 8.0, 0.5, 0.0, 32_768)),
                    ]),
                },
                Provider {
                    name: "gemini".into(),
                    api: Api::Gemini,
                    base_url: "https://generativelanguage.googleapis.com".into(),
                    key_env: "GEMINI_API_KEY".into(),
                    ca_file: None,
                    betas: default_betas(),
                    organization: None,
                    project: None,
                    prices: table(&[
                        ("gemini-2.5-pro", price(1.25, 10.0, 0.31, 0.0, 65_536)),
                        ("gemini-2.5-flash", price(0.3, 2.5, 0.075, 0.0, 65_536)),
                    ]),
                },
            ],
        }
    }

    /// The built-ins plus the file `FORGEPOOL_PROVIDERS_FILE` names, if it names one.
    pub fn from_environment() -> Result<Providers, String> {
        match std::env::var_os(PROVIDERS_FILE_VARIABLE) {
            Some(path) if !path.is_empty() => Providers::load(Path::new(&path)),
            _ => Ok(Providers::builtin()),
        }
    }

    /// The built-ins plus a providers file's entries (an entry replaces a built-in of the
    /// same name, keeping its prices unless it names its own).
    pub fn load(path: &Path) -> Result<Providers, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the providers file {}: {e}", path.display()))?;
        Providers::parse(&text).map_err(|e| format!("providers file {}: {e}", path.display()))
    }

    /// Parses a providers file's text; the error names the entry and the field.
    pub fn parse(text: &str) -> Result<Providers, String> {
        let file: ProvidersFile =
            toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())?;
        let mut providers = Providers::builtin();
        let mut seen = Vec::new();
        for (index, entry) in file.provider.into_iter().enumerate() {
            let at = |field: &str| format!("provider[{index}].{field}");
            if !is_name(&entry.name) {
                return Err(format!(
                    "{} is {:?}: a provider's name is 1 to 64 of a-z, 0-9, - and _, starting with a letter",
                    at("name"),
                    entry.name
                ));
            }
            if seen.contains(&entry.name) {
                return Err(format!("{} {:?} is named twice", at("name"), entry.name));
            }
            seen.push(entry.name.clone());
            let api = Api::parse(&entry.api).ok_or_else(|| {
                format!(
                    "{} is {:?}; forgepool knows {}",
                    at("api"),
                    entry.api,
                    Api::ALL.map(Api::as_str).join(", ")
                )
            })?;
            let base_url =
                check_base_url(&entry.base_url).map_err(|e| format!("{}: {e}", at("base_url")))?;
            if !is_variable(&entry.key_env) {
                return Err(format!(
                    "{} is {:?}: name an environment variable of the worker ([A-Z_][A-Z0-9_]*)",
                    at("key_env"),
                    entry.key_env
                ));
            }
            for (model, price) in &entry.prices {
                let figures = [
                    price.input_per_mtok,
                    price.output_per_mtok,
                    price.cache_read_per_mtok,
                    price.cache_write_per_mtok,
                ];
                if figures.iter().any(|f| !f.is_finite() || *f < 0.0) {
                    return Err(format!(
                        "{}: prices are US dollars per million tokens, finite and not negative",
                        at(&format!("prices.{model:?}"))
                    ));
                }
            }
            for (field, value) in [
                ("organization", &entry.organization),
                ("project", &entry.project),
            ] {
                if value.as_ref().is_some_and(|v| {
                    v.is_empty() || v.len() > 200 || v.bytes().any(|b| !b.is_ascii_graphic())
                }) {
                    return Err(format!(
                        "{}: 1 to 200 printable characters without spaces",
                        at(field)
                    ));
                }
            }
            if let Some(beta) = entry.betas.iter().flatten().find(|b| {
                b.is_empty()
                    || b.len() > 100
                    || !b.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
            }) {
                return Err(format!(
                    "{} holds {beta:?}: a beta is letters, digits and '-'",
                    at("betas")
                ));
            }
            let provider = Provider {
                name: entry.name,
                api,
                base_url,
                key_env: entry.key_env,
                ca_file: entry.ca_file,
                prices: entry.prices,
                betas: entry.betas.unwrap_or_else(default_betas),
                organization: entry.organization,
                project: entry.project,
            };
            match providers.list.iter_mut().find(|p| p.name == provider.name) {
                // A built-in replaced without prices keeps its list prices.
                Some(existing) if provider.prices.is_empty() => {
                    let prices = std::mem::take(&mut existing.prices);
                    *existing = Provider { prices, ..provider };
                }
                Some(existing) => *existing = provider,
                None => providers.list.push(provider),
            }
        }
        Ok(providers)
    }

    /// The provider called `name`.
    pub fn get(&self, name: &str) -> Option<&Provider> {
        self.list.iter().find(|p| p.name == name)
    }

    /// Every provider.
    pub fn iter(&self) -> impl Iterator<Item = &Provider> {
        self.list.iter()
    }

    /// Whether `variable` holds a provider's key: a profile's `env` may not pass it.
    pub fn is_key_variable(&self, variable: &str) -> bool {
        KNOWN_KEY_VARIABLES.contains(&variable) || self.list.iter().any(|p| p.key_env == variable)
    }

    /// The names, for messages.
    pub fn names(&self) -> Vec<&str> {
        self.list.iter().map(|p| p.name.as_str()).collect()
    }
}

/// A provider's root: `https://` anywhere, plain `http://` only to a loopback address (a
/// local fake or a sidecar), no credentials, query or fragment; kept without a trailing slash.
pub fn check_base_url(url: &str) -> Result<String, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?} is not a URL ({e})"))?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("a provider's URL may not hold credentials: the key comes from key_env".into());
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(format!("{url:?} may not have a query or a fragment"));
    }
    match parsed.scheme() {
        "https" => {}
        "http" => {
            let loopback = match parsed.host() {
                Some(url::Host::Ipv4(a)) => a.is_loopback(),
                Some(url::Host::Ipv6(a)) => a.is_loopback(),
                Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
                None => false,
            };
            if !loopback {
                return Err(format!(
                    "{url:?}: plain http is allowed only to a loopback address; use https"
                ));
            }
        }
        other => return Err(format!("{url:?}: the scheme {other:?} is not https")),
    }
    if parsed.host().is_none() {
        return Err(format!("{url:?} names no host"));
    }
    Ok(url.trim_end_matches('/').to_string())
}

fn is_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

fn is_variable(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a file entry that does not replace the built-in of its name, or a price
    /// table lost on the way.
    #[test]
    fn a_file_entry_replaces_the_builtin_and_adds_its_prices() {
        let providers = Providers::parse(
            "[[provider]]\nname = \"anthropic\"\napi = \"anthropic-messages\"\nbase_url = \"http://127.0.0.1:9/\"\nkey_env = \"FAKE_KEY\"\n[provider.prices.\"*\"]\ninput_per_mtok = 2.0\noutput_per_mtok = 4.0\n",
        )
        .unwrap();
        let anthropic = providers.get("anthropic").unwrap();
        assert_eq!(anthropic.base_url, "http://127.0.0.1:9");
        assert_eq!(anthropic.key_env, "FAKE_KEY");
        assert_eq!(anthropic.price(Some("any")).output_per_mtok, 4.0);
        assert!(providers.get("openai").is_some());
        assert!(providers.is_key_variable("FAKE_KEY"));
        let moved = Providers::parse(
            "[[provider]]\nname = \"anthropic\"\napi = \"anthropic-messages\"\nbase_url = \"http://127.0.0.1:9\"\nkey_env = \"K\"\n",
        )
        .unwrap();
        let moved = moved.get("anthropic").unwrap();
        assert_eq!(moved.base_url, "http://127.0.0.1:9");
        assert_eq!(moved.price(Some("claude-sonnet-4-5")).input_per_mtok, 3.0);
        assert!(providers.is_key_variable("OPENAI_API_KEY"));
        assert!(!providers.is_key_variable("LINT_BOT_TOKEN"));
    }

    /// Catches: a dated snapshot priced as free, or a family price not found.
    #[test]
    fn a_dated_model_takes_its_family_price() {
        let anthropic = Providers::builtin().get("anthropic").unwrap().clone();
        assert_eq!(
            anthropic
                .price(Some("claude-sonnet-4-5-20250929"))
                .input_per_mtok,
            3.0
        );
        assert_eq!(anthropic.price(Some("unknown")), Price::default());
    }

    /// Catches: a provider URL that sends the key in clear text to another host, or that
    /// carries credentials; errors that do not name the entry and field.
    #[test]
    fn bad_entries_are_refused_naming_the_field() {
        let entry = |name: &str, api: &str, url: &str, key: &str| {
            format!("[[provider]]\nname = \"{name}\"\napi = \"{api}\"\nbase_url = \"{url}\"\nkey_env = \"{key}\"\n")
        };
        for (text, expected) in [
            (
                entry("x", "anthropic-messages", "http://models.example.com", "K"),
                "provider[0].base_url",
            ),
            (
                entry(
                    "x",
                    "anthropic-messages",
                    "https://u:p@models.example.com",
                    "K",
                ),
                "credentials",
            ),
            (
                entry(
                    "x",
                    "anthropic-messages",
                    "http://127.0.0.1.example.net",
                    "K",
                ),
                "loopback",
            ),
            (
                entry(
                    "x",
                    "anthropic-messages",
                    "https://models.example.com/?key=1",
                    "K",
                ),
                "query",
            ),
            (
                entry("x", "soap", "https://models.example.com", "K"),
                "provider[0].api",
            ),
            (
                entry("X y", "gemini", "https://models.example.com", "K"),
                "provider[0].name",
            ),
            (
                entry("x", "gemini", "https://models.example.com", "lower"),
                "provider[0].key_env",
            ),
            (
                format!(
                    "{}{}",
                    entry("x", "gemini", "https://a.example", "K"),
                    entry("x", "gemini", "https://a.example", "K")
                ),
                "named twice",
            ),
        ] {
            let error = Providers::parse(&text).unwrap_err();
            assert!(error.contains(expected), "{expected}: {error}");
        }
    }
}
