//! Agent profiles (SPEC 5): the dispatcher's agents file, loaded and checked once.
//!
//! The file holds `[agents.NAME]` tables and `[defaults]`; every key is checked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gateway::{Api, Providers};
use proto::{AgentKind, AgentProfile, Network};
use serde::Deserialize;

/// A stage's time limit when a profile sets none.
pub const DEFAULT_AGENT_TIMEOUT_SECONDS: u64 = 1800;
/// A stage's memory limit when a profile sets none: 2 GiB.
pub const DEFAULT_AGENT_MEMORY_BYTES: u64 = 2 << 30;
/// A stage's CPU limit when a profile sets none.
pub const DEFAULT_AGENT_CPUS: f64 = 1.0;

/// The loaded agents file: profiles by name and the default choices.
#[derive(Debug, Clone, Default)]
pub struct AgentBook {
    profiles: BTreeMap<String, AgentProfile>,
    default_implementer: Option<String>,
    default_reviewer: Option<String>,
}

/// A problem with the agents file; it names the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum AgentsError {
    /// The file could not be read.
    #[error(
        "cannot read agents file {path}: {source}; pass --agents FILE or set FORGEPOOL_AGENTS_FILE"
    )]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not valid TOML of the expected shape.
    #[error("agents file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the key.
        message: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentsFile {
    #[serde(default)]
    agents: BTreeMap<String, ProfileEntry>,
    #[serde(default)]
    defaults: Defaults,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Defaults {
    implementer: Option<String>,
    reviewer: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileEntry {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    base_url: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    pause_seconds: Option<u64>,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    daily_budget: Option<proto::Budget>,
    #[serde(default)]
    server_tools: Vec<String>,
    #[serde(default)]
    command: Vec<String>,
    #[serde(default)]
    env: Vec<String>,
    #[serde(default)]
    network: Option<String>,
    memory: Option<String>,
    cpus: Option<f64>,
    timeout_seconds: Option<u64>,
    user: Option<String>,
    read_only_root: Option<bool>,
    disk: Option<String>,
    #[serde(default)]
    egress: Vec<String>,
    max_concurrent: Option<i64>,
}

impl AgentBook {
    /// Loads and checks an agents file against the providers this process knows (built-in,
    /// and `FORGEPOOL_PROVIDERS_FILE`'s).
    pub fn load(path: &Path) -> Result<AgentBook, AgentsError> {
        let text = std::fs::read_to_string(path).map_err(|source| AgentsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let providers = Providers::from_environment().map_err(|message| AgentsError::Parse {
            path: path.to_path_buf(),
            message,
        })?;
        AgentBook::parse_with(&text, path, &providers)
    }

    /// Parses the agents file text against the built-in providers; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<AgentBook, AgentsError> {
        AgentBook::parse_with(text, path, &Providers::builtin())
    }

    /// Parses the agents file text against `providers`; `path` names it in errors.
    pub fn parse_with(
        text: &str,
        path: &Path,
        providers: &Providers,
    ) -> Result<AgentBook, AgentsError> {
        let fail = |message: String| AgentsError::Parse {
            path: path.to_path_buf(),
            message,
        };
        let file: AgentsFile =
            toml::from_str(text).map_err(|e| fail(e.to_string().trim_end().to_string()))?;
        let mut profiles = BTreeMap::new();
        for (name, entry) in file.agents {
            let profile = check_profile(&name, entry, providers).map_err(&fail)?;
            profiles.insert(name, profile);
        }
        for (role, choice) in [
            ("implementer", &file.defaults.implementer),
            ("reviewer", &file.defaults.reviewer),
        ] {
            if let Some(name) = choice {
                if !profiles.contains_key(name) {
                    return Err(fail(format!("defaults.{role} names the profile `{name}`, which has no [agents.{name}] table")));
                }
            }
        }
        Ok(AgentBook {
            profiles,
            default_implementer: file.defaults.implementer,
            default_reviewer: file.defaults.reviewer,
        })
    }

    /// Every profile, by name.
    pub fn profiles(&self) -> &BTreeMap<String, AgentProfile> {
        &self.profiles
    }

    /// The profile called `name`.
    pub fn get(&self, name: &str) -> Option<&AgentProfile> {
        self.profiles.get(name)
    }

    /// The profile names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.profiles.keys().map(String::as_str).collect()
    }

    /// The default profile for a role: `[defaults]`, else the only profile there is.
    pub fn default_for(&self, role: &str) -> Option<&str> {
        let chosen = match role {
            "implementer" => self.default_implementer.as_deref(),
            "reviewer" => self.default_reviewer.as_deref(),
            _ => None,
        };
        chosen.or_else(|| {
            (self.profiles.len() == 1)
                .then(|| self.profiles.keys().next().map(String::as_str))
                .flatten()
        })
    }
}

/// The profile's `network` and its `egress` list, which only applies with `"egress"`.
fn check_network(name: &str, entry: &ProfileEntry) -> Result<Network, String> {
    let key = |k: &str| format!("agents.{name}.{k}");
    let network = match entry.network.as_deref() {
        None | Some("none") => Network::None,
        Some("bridge") => Network::Bridge,
        Some("egress") => Network::Egress,
        Some(other) => {
            return Err(format!(
                "{} must be \"none\", \"egress\" or \"bridge\", got {other:?}",
                key("network")
            ))
        }
    };
    for entry in &entry.egress {
        proto::check_egress_entry(entry).map_err(|e| format!("{} {e}", key("egress")))?;
    }
    if network == Network::Egress && entry.egress.is_empty() {
        return Err(format!(
            "{} is \"egress\" but {} lists no host: name the host:port entries the stage may reach",
            key("network"),
            key("egress")
        ));
    }
    if !entry.egress.is_empty() && network != Network::Egress {
        return Err(format!(
            "{} only applies with network = \"egress\"",
            key("egress")
        ));
    }
    Ok(network)
}

fn check_profile(
    name: &str,
    entry: ProfileEntry,
    providers: &Providers,
) -> Result<AgentProfile, String> {
    let key = |k: &str| format!("agents.{name}.{k}");
    let max_concurrent = check_pool_keys(name, entry.max_concurrent)?;
    let (kind, image) = check_kind(name, &entry)?;
    check_provider(name, kind, &entry, providers)?;
    check_daily_budget(name, &entry)?;
    if image.trim().is_empty() {
        return Err(format!("{} must name a container image", key("image")));
    }
    for variable in &entry.env {
        if let Some(why) = proto::names::env_name_refusal(variable) {
            return Err(format!(
                "{} holds {variable:?}, which is not allowed: {why}",
                key("env")
            ));
        }
    }
    if let Some(user) = &entry.user {
        if proto::names::is_root_user(user) {
            return Err(format!(
                "{} is {user:?}, which is root: stages never run as root; name a non-root uid:gid",
                key("user")
            ));
        }
    }
    let disk_bytes = match entry.disk.as_deref() {
        None => proto::DEFAULT_DISK_BYTES,
        Some(text) => parse_memory(text).ok_or_else(|| {
            format!(
                "{} must be a size like \"512m\" or \"4g\" of at least 6m, got {text:?}",
                key("disk")
            )
        })?,
    };
    let network = check_network(name, &entry)?;
    let memory_bytes = match entry.memory.as_deref() {
        None => DEFAULT_AGENT_MEMORY_BYTES,
        Some(text) => parse_memory(text).ok_or_else(|| {
            format!(
                "{} must be a size like \"512m\" or \"4g\" of at least 6m, got {text:?}",
                key("memory")
            )
        })?,
    };
    let cpus = entry.cpus.unwrap_or(DEFAULT_AGENT_CPUS);
    if !(cpus > 0.0 && cpus <= 1024.0) {
        return Err(format!(
            "{} must be a number of cores above 0, got {cpus}",
            key("cpus")
        ));
    }
    let timeout_seconds = entry
        .timeout_seconds
        .unwrap_or(DEFAULT_AGENT_TIMEOUT_SECONDS);
    if timeout_seconds == 0 {
        return Err(format!("{} must be at least 1", key("timeout_seconds")));
    }
    Ok(AgentProfile {
        max_concurrent,
        name: name.to_string(),
        image,
        command: entry.command,
        kind,
        model: entry.model,
        base_url: entry.base_url,
        provider: entry.provider,
        daily_budget: entry.daily_budget,
        args: entry.args,
        pause_seconds: entry.pause_seconds,
        server_tools: entry.server_tools,
        env: entry.env,
        network,
        memory_bytes,
        cpus,
        timeout_seconds,
        user: entry.user,
        read_only_root: entry.read_only_root.unwrap_or(true),
        disk_bytes,
        egress: entry.egress,
    })
}

/// The profile's `daily_budget`: limits that read, on a profile whose calls go through the
/// gateway (the only place spending is seen).
fn check_daily_budget(name: &str, entry: &ProfileEntry) -> Result<(), String> {
    let Some(budget) = &entry.daily_budget else {
        return Ok(());
    };
    let key = format!("agents.{name}.daily_budget");
    if entry.provider.is_none() {
        return Err(format!(
            "{key} needs `provider`: a daily budget is enforced by the worker's model gateway, which only a profile with a provider goes through"
        ));
    }
    if budget.max_cost_usd.is_none() && budget.max_tokens.is_none() {
        return Err(format!(
            "{key} must set max_cost_usd (US dollars) or max_tokens (tokens), or both"
        ));
    }
    budget
        .check()
        .map_err(|reason| format!("{key}: {}", reason.trim_start_matches("budget.")))
}

/// The profile's agent kind and its image (the kind's pinned one when it names none), and
/// the keys that only a kind, or only `command`, may use.
fn check_kind(name: &str, entry: &ProfileEntry) -> Result<(AgentKind, String), String> {
    let key = |k: &str| format!("agents.{name}.{k}");
    let kind = match entry.kind.as_deref() {
        None => AgentKind::Command,
        Some(text) => AgentKind::parse(text).ok_or_else(|| {
            let known: Vec<&str> = AgentKind::ALL.iter().map(|k| k.as_str()).collect();
            format!(
                "{} is {text:?}; forgepool knows {}",
                key("kind"),
                known.join(", ")
            )
        })?,
    };
    if kind.is_command() {
        for (field, set) in [
            ("model", entry.model.is_some()),
            ("base_url", entry.base_url.is_some()),
            ("args", !entry.args.is_empty()),
            ("pause_seconds", entry.pause_seconds.is_some()),
        ] {
            if set {
                return Err(format!(
                    "{} applies to agent kinds only: set {} (see docs/AGENTS.md)",
                    key(field),
                    key("kind")
                ));
            }
        }
    } else if !entry.command.is_empty() {
        return Err(format!(
            "{} is for kind \"command\": a {} profile's command line comes from its kind; add arguments with {}",
            key("command"),
            kind.as_str(),
            key("args")
        ));
    }
    if !entry.server_tools.is_empty() && entry.provider.is_none() {
        return Err(format!(
            "{} applies to a profile with a {}: only the model gateway can refuse or allow a server-side tool",
            key("server_tools"),
            key("provider")
        ));
    }
    if let Some(tool) = entry.server_tools.iter().find(|t| {
        t.is_empty()
            || t.len() > 64
            || !t
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    }) {
        return Err(format!(
            "{} holds {tool:?}: a tool's name is a-z, 0-9 and '_' (web_search, web_fetch, mcp, google_search, url_context)",
            key("server_tools")
        ));
    }
    if let Some(seconds) = entry.pause_seconds {
        if !(1..=proto::MAX_PAUSE_SECONDS).contains(&seconds) {
            return Err(format!(
                "{} must be a number of seconds from 1 to {} (a day), got {seconds}",
                key("pause_seconds"),
                proto::MAX_PAUSE_SECONDS
            ));
        }
    }
    if let Some(url) = &entry.base_url {
        let scheme_ok = url.starts_with("http://") || url.starts_with("https://");
        if !scheme_ok || url.contains('@') || url.chars().any(|c| c.is_control() || c == ' ') {
            return Err(format!(
                "{} must be an http:// or https:// address without credentials, got {url:?}",
                key("base_url")
            ));
        }
    }
    let image = match (entry.image.clone(), kind.default_image()) {
        (Some(image), _) => image,
        (None, Some(image)) => image,
        (None, None) => {
            return Err(format!(
                "{} is missing: a profile of kind \"command\" must name a container image",
                key("image")
            ))
        }
    };
    Ok((kind, image))
}

/// The profile's `provider` (SPEC 16): one the providers know, speaking its kind's API, and
/// never beside a `base_url`; and its `env`, which may never pass a provider's key: keys stay
/// in the worker, behind the model gateway.
fn check_provider(
    name: &str,
    kind: AgentKind,
    entry: &ProfileEntry,
    providers: &Providers,
) -> Result<(), String> {
    let key = |k: &str| format!("agents.{name}.{k}");
    if let Some(variable) = entry.env.iter().find(|v| providers.is_key_variable(v)) {
        return Err(format!(
            "{} passes {variable}, a model provider's key, into the stage, where the agent could read, print or spend it: set {} instead (SPEC 16); the worker's gateway holds the key and the stage gets a token of its own",
            key("env"),
            key("provider")
        ));
    }
    let Some(wanted) = &entry.provider else {
        return Ok(());
    };
    let provider = providers.get(wanted).ok_or_else(|| {
        format!(
            "{} is {wanted:?}; the providers are {} (add one in the file FORGEPOOL_PROVIDERS_FILE names)",
            key("provider"),
            providers.names().join(", ")
        )
    })?;
    if let Some(api) = Api::of_kind(kind) {
        if api != provider.api {
            return Err(format!(
                "{} is `{wanted}`, which speaks {}; a {} profile's CLI speaks {}: name a provider of that API",
                key("provider"),
                provider.api.as_str(),
                kind.as_str(),
                api.as_str()
            ));
        }
    }
    if entry.base_url.is_some() {
        return Err(format!(
            "{} and {} exclude each other: with a provider, the stage's base URL is the worker's gateway",
            key("base_url"),
            key("provider")
        ));
    }
    Ok(())
}

/// The profile's name (it names queues on the broker) and its `max_concurrent`.
fn check_pool_keys(name: &str, max_concurrent: Option<i64>) -> Result<Option<u32>, String> {
    if !proto::names::is_profile_name(name) {
        return Err(format!(
            "agents.{name}: a profile name must be 1 to 64 letters, digits, `_`, `-` or `.`, beginning with a letter or digit"
        ));
    }
    match max_concurrent {
        None => Ok(None),
        Some(n) if (1..=1024).contains(&n) => Ok(Some(n as u32)),
        Some(n) => Err(format!(
            "agents.{name}.max_concurrent must be a number of stages from 1 to 1024, got {n}"
        )),
    }
}

/// Parses `512m`, `4g`, `1024k` or a number of bytes. Docker refuses less than 6 MiB.
fn parse_memory(text: &str) -> Option<u64> {
    let text = text.trim().to_ascii_lowercase();
    let text = text.strip_suffix('b').unwrap_or(&text);
    let (digits, unit) = match text.char_indices().last()? {
        (i, 'k') => (&text[..i], 1u64 << 10),
        (i, 'm') => (&text[..i], 1 << 20),
        (i, 'g') => (&text[..i], 1 << 30),
        _ => (text, 1),
    };
    let bytes = digits.parse::<u64>().ok()?.checked_mul(unit)?;
    (bytes >= 6 << 20).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC_EXAMPLE: &str = r#"
        [agents.claude]
        kind = "claude-code"
        provider = "anthropic"
        memory = "4g"
        cpus = 2.0
        timeout_seconds = 1800

        [agents.linter]
        image = "registry.example.com/agents/lint-bot:1.2"
        command = ["lint-bot", "--fix"]
        env = ["LINT_BOT_TOKEN"]
        network = "egress"
        egress = ["api.lint-bot.example:443"]
    "#;

    #[test]
    fn spec_example_loads() {
        let book = AgentBook::parse(SPEC_EXAMPLE, Path::new("agents.toml")).unwrap();
        let claude = book.get("claude").unwrap();
        assert_eq!(claude.network, Network::None);
        assert_eq!(claude.memory_bytes, 4 << 30);
        assert_eq!(claude.provider.as_deref(), Some("anthropic"));
        assert!(claude.env.is_empty());
        let linter = book.get("linter").unwrap();
        assert_eq!(linter.env, ["LINT_BOT_TOKEN"]);
        assert_eq!(linter.network, Network::Egress);
    }

    /// Catches: a daily budget dropped on the way into the frozen profile (the gateways would
    /// never ask for allotments).
    #[test]
    fn a_daily_budget_reaches_the_profile() {
        let text = "[agents.c]\nkind = \"claude-code\"\nprovider = \"anthropic\"\ndaily_budget = { max_cost_usd = 250.0, max_tokens = 9000000 }\n";
        let book = AgentBook::parse(text, Path::new("agents.toml")).unwrap();
        let budget = book.get("c").unwrap().daily_budget.clone().unwrap();
        assert_eq!(budget.max_cost_usd, Some(250.0));
        assert_eq!(budget.max_tokens, Some(9_000_000));
    }

    #[test]
    fn defaults_are_safe() {
        let book =
            AgentBook::parse("[agents.a]\nimage = \"x\"\n", Path::new("agents.toml")).unwrap();
        let a = book.get("a").unwrap();
        assert_eq!(a.network, Network::None);
        assert_eq!(a.timeout_seconds, DEFAULT_AGENT_TIMEOUT_SECONDS);
        assert_eq!(a.max_concurrent, None, "unlimited unless set");
        let capped = AgentBook::parse(
            "[agents.a]\nimage = \"x\"\nmax_concurrent = 2\n",
            Path::new("agents.toml"),
        )
        .unwrap();
        assert_eq!(capped.get("a").unwrap().max_concurrent, Some(2));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let cases = [
            (
                "[agents.a]\nimage = \"x\"\nnetwork = \"host\"\n",
                "agents.a.network",
            ),
            (
                "[agents.a]\nimage = \"x\"\nmemory = \"lots\"\n",
                "agents.a.memory",
            ),
            (
                "[agents.a]\nimage = \"x\"\nmax_concurrent = 0\n",
                "agents.a.max_concurrent",
            ),
            (
                "[agents.\"a b\"]\nimage = \"x\"\n",
                "agents.a b: a profile name",
            ),
            (
                "[agents.a]\nimage = \"x\"\nenv = [\"KEY=value\"]\n",
                "agents.a.env",
            ),
            ("[agents.a]\nimage = \"x\"\ncpus = 0.0\n", "agents.a.cpus"),
            ("[agents.a]\nimage = \"\"\n", "agents.a.image"),
            ("[agents.a]\nimage = \"x\"\ncolour = 1\n", "colour"),
            (
                "[agents.a]\nimage = \"x\"\n[defaults]\nreviewer = \"b\"\n",
                "defaults.reviewer",
            ),
            ("[agents.a]\n", "image"),
            (
                "[agents.a]\nimage = \"x\"\ndaily_budget = { max_tokens = 5 }\n",
                "agents.a.daily_budget needs `provider`",
            ),
            (
                "[agents.a]\nkind = \"codex\"\nprovider = \"openai\"\ndaily_budget = {}\n",
                "agents.a.daily_budget must set max_cost_usd",
            ),
            (
                "[agents.a]\nkind = \"codex\"\nprovider = \"openai\"\ndaily_budget = { max_cost_usd = -1.0 }\n",
                "agents.a.daily_budget: max_cost_usd must be a positive amount",
            ),
            (
                "[agents.a]\nkind = \"claude\"\n",
                "agents.a.kind is \"claude\"; forgepool knows command, claude-code, codex",
            ),
            (
                "[agents.a]\nkind = \"codex\"\ncommand = [\"codex\"]\n",
                "agents.a.command is for kind \"command\"",
            ),
            (
                "[agents.a]\nimage = \"x\"\nmodel = \"m\"\n",
                "agents.a.model applies to agent kinds only",
            ),
            (
                "[agents.a]\nkind = \"claude-code\"\nprovider = \"nobody\"\n",
                "agents.a.provider is \"nobody\"; the providers are anthropic, openai, openai-chat, gemini",
            ),
            (
                "[agents.a]\nkind = \"claude-code\"\nprovider = \"openai\"\n",
                "a claude-code profile's CLI speaks anthropic-messages",
            ),
            (
                "[agents.a]\nkind = \"claude-code\"\nprovider = \"anthropic\"\nbase_url = \"http://h\"\n",
                "agents.a.base_url and agents.a.provider exclude each other",
            ),
            (
                "[agents.a]\nkind = \"claude-code\"\nenv = [\"ANTHROPIC_API_KEY\"]\n",
                "agents.a.env passes ANTHROPIC_API_KEY, a model provider's key",
            ),
            (
                "[agents.a]\nimage = \"x\"\nenv = [\"GEMINI_API_KEY\"]\n",
                "set agents.a.provider instead",
            ),
            (
                "[agents.a]\nkind = \"aider\"\nbase_url = \"http://user:pw@host/v1\"\n",
                "agents.a.base_url",
            ),
            (
                "[agents.a]\nimage = \"x\"\npause_seconds = 60\n",
                "agents.a.pause_seconds applies to agent kinds only",
            ),
            (
                "[agents.a]\nkind = \"codex\"\npause_seconds = 0\n",
                "agents.a.pause_seconds must be a number of seconds from 1 to 86400",
            ),
        ];
        for (text, needle) in cases {
            let error = AgentBook::parse(text, Path::new("conf/agents.toml"))
                .unwrap_err()
                .to_string();
            assert!(error.contains("conf/agents.toml"), "{error}");
            assert!(error.contains(needle), "{error} lacks {needle}");
        }
    }

    /// Catches: a kind's profile without an image refused, or given no pinned image; the
    /// kind's own fields lost on the way into the job.
    #[test]
    fn an_agent_kind_needs_no_image_and_keeps_its_fields() {
        let text = r#"
            [agents.claude]
            kind = "claude-code"
            model = "claude-sonnet-4-5"
            base_url = "http://172.17.0.1:8089"
            args = ["--max-turns", "40"]
            network = "egress"
            egress = ["172.17.0.1:8089"]
        "#;
        let book = AgentBook::parse(text, Path::new("agents.toml")).unwrap();
        let claude = book.get("claude").unwrap();
        assert_eq!(claude.kind, AgentKind::ClaudeCode);
        assert_eq!(claude.image, AgentKind::ClaudeCode.default_image().unwrap());
        assert_eq!(claude.model.as_deref(), Some("claude-sonnet-4-5"));
        assert_eq!(claude.base_url.as_deref(), Some("http://172.17.0.1:8089"));
        assert_eq!(claude.args, ["--max-turns", "40"]);
        assert!(claude.command.is_empty());
    }

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory("512m"), Some(512 << 20));
        assert_eq!(parse_memory("4G"), Some(4 << 30));
        assert_eq!(parse_memory("4gb"), Some(4 << 30));
        assert_eq!(parse_memory("1m"), None);
        assert_eq!(parse_memory("g"), None);
    }
}
