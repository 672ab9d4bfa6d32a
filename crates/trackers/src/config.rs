//! The trackers file (`FORGEPOOL_TRACKERS_FILE`, SPEC 17): one `[[tracker]]` per source,
//! validated whole at start, each error naming the entry and the setting. The token and the
//! webhook secret are read from the variables the entry names, here and nowhere else, and are
//! kept in [`Secret`]s, whose `Debug` shows nothing.

use std::collections::HashSet;
use std::fmt;
use std::path::Path;

use serde::Deserialize;

/// A tracker's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// GitHub issues and pull requests.
    Github,
    /// GitLab issues and merge requests.
    Gitlab,
    /// Jira issues.
    Jira,
}

impl Kind {
    /// The kind's name, as the file spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Github => "github",
            Kind::Gitlab => "gitlab",
            Kind::Jira => "jira",
        }
    }
}

/// A secret read from the environment: its `Debug` and `Display` show nothing.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `value`.
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(…)")
    }
}

/// A Jira project: its issues' repository.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Project {
    /// The project key (`SHOP`).
    pub key: String,
    /// The repository its issues change.
    pub repository: String,
    /// The branch runs start from.
    #[serde(default = "default_ref", rename = "ref")]
    pub git_ref: String,
}

fn default_ref() -> String {
    "main".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    kind: Kind,
    api_url: String,
    token_env: String,
    secret_env: String,
    #[serde(default)]
    email_env: Option<String>,
    #[serde(default = "default_label")]
    label: String,
    #[serde(default = "default_mention")]
    mention: String,
    #[serde(default)]
    repositories: Vec<String>,
    skill: String,
    #[serde(default)]
    agents: Option<toml::Value>,
    #[serde(default)]
    commands: Option<toml::Value>,
    #[serde(default)]
    repair_attempts: Option<toml::Value>,
    #[serde(default)]
    budget: Option<toml::Value>,
    #[serde(default)]
    min_permission: Option<String>,
    #[serde(default)]
    allowed_groups: Vec<String>,
    #[serde(default)]
    allowed_accounts: Vec<String>,
    #[serde(default = "default_poll")]
    poll_seconds: u64,
    #[serde(default)]
    reply_refused: bool,
    #[serde(default)]
    ticket_prefix: Option<String>,
    #[serde(default = "default_follow_ups")]
    max_follow_ups: u32,
    #[serde(default)]
    project: Vec<Project>,
}

fn default_label() -> String {
    "forgepool".into()
}
fn default_mention() -> String {
    "@forgepool".into()
}
fn default_poll() -> u64 {
    300
}
fn default_follow_ups() -> u32 {
    5
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    run_url: Option<String>,
    #[serde(default)]
    tracker: Vec<Entry>,
}

/// The trackers file, validated.
#[derive(Debug, Clone)]
pub struct TrackersFile {
    /// The address of a run's page for people (`{run_id}` in it), linked from each comment.
    pub run_url: Option<String>,
    /// Its trackers.
    pub trackers: Vec<TrackerConfig>,
}

/// One tracker of the file, validated, with its secrets read.
#[derive(Debug, Clone)]
pub struct TrackerConfig {
    /// Its name, in the webhook route, events and metrics.
    pub name: String,
    /// Its kind.
    pub kind: Kind,
    /// Its API's root, without a trailing `/`.
    pub api_url: String,
    /// The variable holding the token (for messages).
    pub token_env: String,
    /// The token: comments, reactions, look-ups.
    pub token: Secret,
    /// Jira: the account's email, with the token (basic authentication).
    pub email: Option<Secret>,
    /// The variable holding the webhook secret (for messages).
    pub secret_env: String,
    /// The webhook secret.
    pub secret: Secret,
    /// The label that starts a run.
    pub label: String,
    /// The handle a comment mentions.
    pub mention: String,
    /// Which repositories may start runs (`owner/name` globs, `*` within a part).
    pub repositories: Vec<String>,
    /// The skill of its runs.
    pub skill: String,
    /// What else its runs' requests say (`agents`, `commands`, `repair_attempts`, `budget`).
    pub request: serde_json::Map<String, serde_json::Value>,
    /// GitHub and GitLab: the least permission of a person who may start a run.
    pub min_permission: String,
    /// Jira: the groups whose members may start runs.
    pub allowed_groups: Vec<String>,
    /// Jira: the accounts that may start runs.
    pub allowed_accounts: Vec<String>,
    /// How often the reconciling poll runs (0: never).
    pub poll_seconds: u64,
    /// Whether a refused trigger gets a reply.
    pub reply_refused: bool,
    /// The ticket key's prefix, instead of the repository's name.
    pub ticket_prefix: Option<String>,
    /// The most follow-up runs of one ticket.
    pub max_follow_ups: u32,
    /// Jira: the projects and their repositories.
    pub projects: Vec<Project>,
}

impl TrackerConfig {
    /// What the reconciling poll can list: the repositories named without a glob, or for
    /// Jira the projects' keys.
    pub fn listable(&self) -> Vec<String> {
        if self.kind == Kind::Jira {
            return self.projects.iter().map(|p| p.key.clone()).collect();
        }
        self.repositories
            .iter()
            .filter(|r| !r.contains('*'))
            .cloned()
            .collect()
    }

    /// Whether `full_name` (`owner/name`) may start runs.
    /// For Jira, `full_name` is a project key, allowed when `[[tracker.project]]` lists it.
    pub fn allows_repository(&self, full_name: &str) -> bool {
        if self.kind == Kind::Jira {
            return self
                .projects
                .iter()
                .any(|p| p.key.eq_ignore_ascii_case(full_name));
        }
        self.repositories
            .iter()
            .any(|pattern| glob_matches(pattern, full_name))
    }
}

/// What is wrong with the trackers file: where, which setting, and what is expected.
#[derive(Debug, thiserror::Error)]
#[error("trackers file {file}: {place}: {message}")]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// The entry and setting (`tracker "github" (entry 1), \`api_url\``).
    pub place: String,
    /// What is expected.
    pub message: String,
}

/// Reads and validates the trackers file at `path`, with secrets from `env`.
pub fn load(
    path: &Path,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TrackersFile, ConfigError> {
    let file = path.display().to_string();
    let fail = |place: String, message: String| ConfigError {
        file: file.clone(),
        place,
        message,
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| fail("the file".into(), format!("cannot be read: {e}")))?;
    if text.len() > 1 << 20 {
        return Err(fail("the file".into(), "is larger than 1 MiB".into()));
    }
    parse(&text, env).map_err(|(place, message)| fail(place, message))
}

/// Validates the text of a trackers file; the error is (place, message).
pub fn parse(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TrackersFile, (String, String)> {
    let parsed: File = toml::from_str(text).map_err(|e| {
        (
            "the file".to_string(),
            format!("is not a valid trackers file: {}", e.message()),
        )
    })?;
    if let Some(url) = &parsed.run_url {
        if !(url.starts_with("https://") || url.starts_with("http://")) || !url.contains("{run_id}")
        {
            return Err((
                "`run_url`".to_string(),
                format!("is {url:?}: an http(s) address with `{{run_id}}` in it"),
            ));
        }
    }
    let mut names = HashSet::new();
    let mut trackers = Vec::new();
    for (index, entry) in parsed.tracker.into_iter().enumerate() {
        let name = entry.name.clone();
        let place =
            move |setting: &str| format!("tracker \"{name}\" (entry {}), `{setting}`", index + 1);
        if entry.name.is_empty()
            || entry.name.len() > 40
            || !entry
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        {
            return Err((
                place("name"),
                "must be 1 to 40 lower-case letters, digits and `-` (it is a URL path part)".into(),
            ));
        }
        if !names.insert(entry.name.clone()) {
            return Err((
                place("name"),
                "names another entry too; names are unique".into(),
            ));
        }
        trackers.push(validate(entry, &place, env)?);
    }
    Ok(TrackersFile {
        run_url: parsed.run_url,
        trackers,
    })
}

fn validate(
    entry: Entry,
    place: &dyn Fn(&str) -> String,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<TrackerConfig, (String, String)> {
    let api_url = entry.api_url.trim_end_matches('/').to_string();
    if !api_url_allowed(&api_url) {
        return Err((
            place("api_url"),
            format!("is {api_url:?}: an `https://` URL, or plain `http://` only to a loopback host (127.0.0.1, ::1, localhost)"),
        ));
    }
    let token = read_secret(&entry.token_env, place("token_env"), env, 1)?;
    let secret = read_secret(&entry.secret_env, place("secret_env"), env, 16)?;
    let email = match (&entry.email_env, entry.kind) {
        (Some(name), _) => Some(read_secret(name, place("email_env"), env, 3)?),
        (None, Kind::Jira) => {
            return Err((
                place("email_env"),
                "is missing: Jira's API takes the token with the account's email (basic authentication); name the variable holding it".into(),
            ))
        }
        (None, _) => None,
    };
    if entry.label.trim().is_empty() {
        return Err((
            place("label"),
            "is empty: name the label that starts a run".into(),
        ));
    }
    if !entry.mention.starts_with('@') || entry.mention.len() < 2 || entry.mention.contains(' ') {
        return Err((
            place("mention"),
            format!("is {:?}: a handle such as \"@forgepool\"", entry.mention),
        ));
    }
    let min_permission = who_may(&entry, place)?;
    if entry.skill.trim().is_empty() {
        return Err((
            place("skill"),
            "is empty: name the skill of its runs".into(),
        ));
    }
    if let Some(prefix) = &entry.ticket_prefix {
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        {
            return Err((
                place("ticket_prefix"),
                "is upper-case letters, digits and `_`".into(),
            ));
        }
    }
    let mut request = serde_json::Map::new();
    for (key, value) in [
        ("agents", entry.agents),
        ("commands", entry.commands),
        ("repair_attempts", entry.repair_attempts),
        ("budget", entry.budget),
    ] {
        if let Some(value) = value {
            let json = serde_json::to_value(value)
                .map_err(|e| (place(key), format!("cannot be read: {e}")))?;
            request.insert(key.to_string(), json);
        }
    }
    Ok(TrackerConfig {
        name: entry.name,
        kind: entry.kind,
        api_url,
        token_env: entry.token_env,
        token,
        email,
        secret_env: entry.secret_env,
        secret,
        label: entry.label,
        mention: entry.mention,
        repositories: entry.repositories,
        skill: entry.skill,
        request,
        min_permission,
        allowed_groups: entry.allowed_groups,
        allowed_accounts: entry.allowed_accounts,
        poll_seconds: entry.poll_seconds,
        reply_refused: entry.reply_refused,
        ticket_prefix: entry.ticket_prefix,
        max_follow_ups: entry.max_follow_ups,
        projects: entry.project,
    })
}

/// The kind's rules: who may start runs (its `min_permission`, or Jira's groups and
/// accounts) and where tickets come from (`repositories`, Jira's projects).
fn who_may(entry: &Entry, place: &dyn Fn(&str) -> String) -> Result<String, (String, String)> {
    let min_permission = match entry.kind {
        Kind::Github => one_of(
            entry.min_permission.clone(),
            "write",
            &["write", "maintain", "admin"],
            place,
        )?,
        Kind::Gitlab => one_of(
            entry.min_permission.clone(),
            "developer",
            &["developer", "maintainer", "owner"],
            place,
        )?,
        Kind::Jira => {
            if entry.min_permission.is_some() {
                return Err((
                    place("min_permission"),
                    "is for GitHub and GitLab: a Jira tracker names `allowed_groups` or `allowed_accounts`".into(),
                ));
            }
            String::new()
        }
    };
    match entry.kind {
        Kind::Github | Kind::Gitlab => {
            if entry.repositories.is_empty() {
                return Err((
                    place("repositories"),
                    "is missing or empty: list the repositories (`owner/name`, `*` allowed within a part) whose issues may start runs".into(),
                ));
            }
            if let Some(bad) = entry
                .repositories
                .iter()
                .find(|r| r.split('/').count() < 2 || r.split('/').any(str::is_empty))
            {
                return Err((
                    place("repositories"),
                    format!("holds {bad:?}: each is `owner/name`"),
                ));
            }
        }
        Kind::Jira => {
            if entry.project.is_empty() {
                return Err((
                    place("project"),
                    "is missing: a Jira tracker lists `[[tracker.project]]` entries (key, repository, ref)".into(),
                ));
            }
            if entry.allowed_groups.is_empty() && entry.allowed_accounts.is_empty() {
                return Err((
                    place("allowed_groups"),
                    "and `allowed_accounts` are both empty: name who may start runs".into(),
                ));
            }
        }
    }
    Ok(min_permission)
}

fn one_of(
    value: Option<String>,
    default: &str,
    allowed: &[&str],
    place: &dyn Fn(&str) -> String,
) -> Result<String, (String, String)> {
    let value = value.unwrap_or_else(|| default.to_string());
    if allowed.contains(&value.as_str()) {
        Ok(value)
    } else {
        Err((
            place("min_permission"),
            format!("is {value:?}: one of {}", allowed.join(", ")),
        ))
    }
}

fn read_secret(
    name: &str,
    place: String,
    env: &dyn Fn(&str) -> Option<String>,
    at_least: usize,
) -> Result<Secret, (String, String)> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err((
            place,
            format!("is {name:?}: the name of an environment variable"),
        ));
    }
    match env(name) {
        Some(value) if value.chars().count() >= at_least => Ok(Secret(value)),
        Some(_) => Err((
            place,
            format!("names {name}, which holds fewer than {at_least} characters"),
        )),
        None => Err((place, format!("names {name}, which is not set"))),
    }
}

/// Whether a tracker's API address is allowed: `https://`, or `http://` to a loopback host.
pub fn api_url_allowed(url: &str) -> bool {
    if let Some(rest) = url.strip_prefix("https://") {
        return !rest.is_empty();
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let host_port = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = host_port.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        host_port.split(':').next().unwrap_or("")
    };
    matches!(host, "127.0.0.1" | "::1" | "localhost")
}

/// `*` matches any run of characters other than `/`; everything else matches itself
/// (case-insensitively, as GitHub and GitLab names do).
pub fn glob_matches(pattern: &str, name: &str) -> bool {
    let (pattern, name) = (pattern.to_ascii_lowercase(), name.to_ascii_lowercase());
    let pattern: Vec<&str> = pattern.split('/').collect();
    let name: Vec<&str> = name.split('/').collect();
    pattern.len() == name.len() && pattern.iter().zip(&name).all(|(p, n)| part_matches(p, n))
}

fn part_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            let Some(rest) = name.strip_prefix(head) else {
                return false;
            };
            (0..=rest.len())
                .filter(|i| rest.is_char_boundary(*i))
                .any(|i| part_matches(tail, &rest[i..]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "TOKEN" => Some("ghp_token".into()),
            "SECRET" => Some("a-webhook-secret-of-32-characters".into()),
            "SHORT" => Some("short".into()),
            _ => None,
        }
    }

    const GOOD: &str = "[[tracker]]\nname = \"github\"\nkind = \"github\"\napi_url = \"https://api.github.com\"\ntoken_env = \"TOKEN\"\nsecret_env = \"SECRET\"\nrepositories = [\"acme/shop\", \"acme/infra-*\"]\nskill = \"implement-task\"\n";

    /// Catches: a valid file refused, defaults not applied, a secret shown by `Debug`.
    #[test]
    fn a_valid_file_is_read_with_its_defaults() {
        let trackers = parse(GOOD, &env).unwrap().trackers;
        assert_eq!(trackers.len(), 1);
        let t = &trackers[0];
        assert_eq!(
            (t.label.as_str(), t.mention.as_str()),
            ("forgepool", "@forgepool")
        );
        assert_eq!(
            (t.min_permission.as_str(), t.poll_seconds, t.max_follow_ups),
            ("write", 300, 5)
        );
        assert!(t.allows_repository("acme/shop") && t.allows_repository("ACME/infra-web"));
        assert!(!t.allows_repository("acme/shopping") && !t.allows_repository("evil/shop"));
        let shown = format!("{t:?}");
        assert!(
            !shown.contains("ghp_token") && !shown.contains("webhook-secret"),
            "{shown}"
        );
    }

    /// Catches: an error that does not name the entry and the setting, or lets a bad value by.
    #[test]
    fn each_mistake_is_named_with_its_entry_and_setting() {
        let cases = [
            (
                GOOD.replace("https://api.github.com", "http://api.github.com"),
                "`api_url`",
            ),
            (
                GOOD.replace("\"SECRET\"", "\"MISSING\""),
                "`secret_env`: names MISSING, which is not set",
            ),
            (
                GOOD.replace("\"SECRET\"", "\"SHORT\""),
                "fewer than 16 characters",
            ),
            (
                GOOD.replace("\"TOKEN\"", "\"NOPE\""),
                "`token_env`: names NOPE",
            ),
            (
                GOOD.replace("[\"acme/shop\", \"acme/infra-*\"]", "[]"),
                "`repositories`",
            ),
            (
                GOOD.replace("name = \"github\"", "name = \"Git Hub\""),
                "`name`",
            ),
            (
                format!("{GOOD}min_permission = \"read\"\n"),
                "`min_permission`: is \"read\"",
            ),
            (format!("{GOOD}{GOOD}"), "entry 2), `name`"),
            (
                GOOD.replace("kind = \"github\"", "kind = \"jira\""),
                "`email_env`",
            ),
            (
                format!("{GOOD}colour = \"blue\"\n"),
                "unknown field `colour`",
            ),
        ];
        for (text, expected) in cases {
            let (place, message) = parse(&text, &env).unwrap_err();
            let said = format!("{place}: {message}");
            assert!(said.contains(expected), "expected {expected:?} in {said:?}");
            assert!(
                said.contains("tracker \"") || said.contains("the file"),
                "{said}"
            );
        }
    }

    /// Catches: a non-loopback plain-HTTP API address allowed (the token would cross in clear).
    #[test]
    fn plain_http_only_to_loopback() {
        assert!(api_url_allowed("http://127.0.0.1:4010"));
        assert!(api_url_allowed("http://localhost/api/v4"));
        assert!(api_url_allowed("http://[::1]:80"));
        assert!(!api_url_allowed("http://127.0.0.1.evil.example"));
        assert!(!api_url_allowed("http://10.0.0.1"));
        assert!(!api_url_allowed("ftp://x"));
    }
}
