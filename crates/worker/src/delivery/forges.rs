//! The forges file (`FORGEPOOL_FORGES_FILE`, SPEC 9): how forgepool's own git reaches each
//! repository host. An HTTPS token is given to git by a credential helper scoped to the host
//! that reads the worker's own environment variable (the value is never on a command line, in
//! a URL, in a stage's environment or in anything stored); an SSH deploy key and a pinned
//! `known_hosts` go into an ssh configuration of forgepool's own; an extra CA file is scoped
//! to the host. Nothing of this reaches a stage container: stages get a `.git` with no remote
//! and only their profile's variables.
//!
//! `Forges::load` checks every entry (host, kind, API root, token variable set, files present);
//! its errors name the file, the entry and the key. `git_config` is what every git process of
//! forgepool gets after `credential.helper=`: a credential helper scoped to each HTTPS host that
//! prints the user and `"$VARIABLE"` (the variable's name is on the command line, its value only
//! in the worker's environment), the host's `sslCAInfo`, and `core.sshCommand` naming
//! forgepool's ssh configuration (one `Host` block per forge with a deploy key and pinned
//! `known_hosts`, `StrictHostKeyChecking yes`). The variables that would outrank them
//! (`GIT_SSL_CAINFO`, `GIT_SSH_COMMAND`, `GIT_SSH`) are taken from forgepool's git. `explain`
//! turns a refused token, key, host key or certificate in git's error into the host and the
//! setting at fault. Token values are redacted from every event of every run.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;

/// What kind of forge a host is (its API, for pull requests and commit statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ForgeKind {
    /// GitHub or GitHub Enterprise (REST v3).
    Github,
    /// GitLab (REST v4).
    Gitlab,
    /// Gitea or Forgejo (REST v1).
    Gitea,
}

impl ForgeKind {
    /// The user name git sends with a token when the entry names none.
    fn token_user(self) -> &'static str {
        match self {
            ForgeKind::Github => "x-access-token",
            ForgeKind::Gitlab => "oauth2",
            ForgeKind::Gitea => "forgepool",
        }
    }
}

/// One `[[forge]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Forge {
    /// The host part of the repository URLs it serves (`github.com`, `git.example:8443`).
    pub host: String,
    /// The forge's kind.
    pub kind: ForgeKind,
    /// The forge's API root.
    pub api_url: String,
    /// GitHub's GraphQL endpoint (a pull request's draft state changes only there); by
    /// default `https://api.github.com/graphql`, or `/api/graphql` beside an Enterprise
    /// Server's `/api/v3`.
    #[serde(default)]
    pub graphql_url: Option<String>,
    /// The worker's environment variable holding the token (git over HTTPS and the API).
    #[serde(default)]
    pub token_env: Option<String>,
    /// The user name sent with the token over HTTPS (by kind: `x-access-token`, `oauth2`,
    /// `forgepool`).
    #[serde(default)]
    pub username: Option<String>,
    /// The SSH deploy key for `ssh://` URLs of this host.
    #[serde(default)]
    pub ssh_key_file: Option<PathBuf>,
    /// The host keys accepted for this host (required with `ssh_key_file`); any other key is
    /// refused.
    #[serde(default)]
    pub known_hosts_file: Option<PathBuf>,
    /// An extra CA trusted for this host's HTTPS certificate.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ForgesFile {
    /// The address of a run for people, `{run_id}` replaced: commit statuses link to it.
    #[serde(default)]
    run_url: Option<String>,
    #[serde(default)]
    forge: Vec<Forge>,
}

/// Every forge of the forges file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Forges {
    forges: Vec<Forge>,
    /// The run link template (`run_url`).
    run_url: Option<String>,
    /// The ssh configuration forgepool's git uses, when an entry has an SSH key.
    ssh_config: Option<PathBuf>,
}

static FORGES: OnceLock<Forges> = OnceLock::new();

/// Sets the process's forges (the first call wins).
pub fn set_forges(forges: Forges) {
    let _ = FORGES.set(forges);
}

/// The process's forges; none unless [`set_forges`] was called.
pub fn forges() -> &'static Forges {
    static NONE: OnceLock<Forges> = OnceLock::new();
    FORGES
        .get()
        .unwrap_or_else(|| NONE.get_or_init(Forges::default))
}

impl Forge {
    /// GitHub's GraphQL endpoint for this entry.
    pub fn graphql(&self) -> String {
        if let Some(url) = &self.graphql_url {
            return url.clone();
        }
        let api = self.api_url.trim_end_matches('/');
        match api.strip_suffix("/api/v3") {
            Some(server) => format!("{server}/api/graphql"),
            None => format!("{api}/graphql"),
        }
    }
}

impl Forges {
    /// Loads and checks a forges file: each entry's host and kind, an `https://` (or, for a
    /// loopback host, `http://`) API root, a token variable that is set in `env`, and files
    /// that exist. Every error names the file, the entry and the key.
    pub fn load(path: &Path, env: impl Fn(&str) -> Option<String>) -> Result<Forges, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("forges file {}: cannot read it: {e}", path.display()))?;
        Forges::parse(&text, path, env)
    }

    /// Parses forges file text; `path` names it in errors.
    pub fn parse(
        text: &str,
        path: &Path,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Forges, String> {
        let file: ForgesFile = toml::from_str(text).map_err(|e| {
            format!(
                "forges file {}: {}",
                path.display(),
                e.to_string().trim_end()
            )
        })?;
        for (index, forge) in file.forge.iter().enumerate() {
            check(forge, &env).map_err(|message| {
                format!(
                    "forges file {}: forge[{index}] (host {:?}): {message}",
                    path.display(),
                    forge.host
                )
            })?;
            if let Some(earlier) = file.forge[..index].iter().find(|f| f.host == forge.host) {
                return Err(format!(
                    "forges file {}: forge[{index}]: host {:?} is served by an earlier entry already ({:?})",
                    path.display(),
                    forge.host,
                    earlier.api_url
                ));
            }
        }
        if let Some(template) = &file.run_url {
            let fine = (template.starts_with("https://") || template.starts_with("http://"))
                && template.contains("{run_id}");
            if !fine {
                return Err(format!(
                    "forges file {}: run_url must be an http(s) address with {{run_id}} in it, like \"https://forgepool.example/runs/{{run_id}}\"",
                    path.display()
                ));
            }
        }
        Ok(Forges {
            forges: file.forge,
            run_url: file.run_url,
            ssh_config: None,
        })
    }

    /// The link to `run_id` commit statuses carry, when the file gives `run_url`.
    pub fn run_link(&self, run_id: &str) -> Option<String> {
        self.run_url
            .as_ref()
            .map(|template| template.replace("{run_id}", run_id))
    }

    /// The entries.
    pub fn entries(&self) -> &[Forge] {
        &self.forges
    }

    /// The entry serving a repository URL (`https://host[:port]/…`, `ssh://[user@]host/…` or
    /// `user@host:path`).
    pub fn for_url(&self, url: &str) -> Option<&Forge> {
        let host = url_host(url)?;
        self.forges.iter().find(|f| {
            f.host.eq_ignore_ascii_case(&host)
                || f.host
                    .split_once(':')
                    .is_some_and(|(name, _)| name.eq_ignore_ascii_case(&host))
        })
    }

    /// Writes the ssh configuration for the entries with an SSH key into `dir` (a folder only
    /// the worker writes), and keeps its path for git. Other hosts keep ssh's own defaults.
    pub fn write_ssh_config(&mut self, dir: &Path) -> std::io::Result<()> {
        let mut text =
            String::from("# Written by forgepool: one block per forge with an SSH key.\n");
        let mut any = false;
        for forge in &self.forges {
            let (Some(key), Some(known)) = (&forge.ssh_key_file, &forge.known_hosts_file) else {
                continue;
            };
            any = true;
            let name = forge.host.split(':').next().unwrap_or(&forge.host);
            text.push_str(&format!(
                "Host {name}\n  IdentityFile \"{}\"\n  IdentitiesOnly yes\n  UserKnownHostsFile \"{}\"\n  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  BatchMode yes\n  PasswordAuthentication no\n",
                key.display(),
                known.display()
            ));
        }
        if !any {
            return Ok(());
        }
        // Other hosts keep the user's own ssh configuration.
        text.push_str("Match all\n  Include ~/.ssh/config\n");
        std::fs::create_dir_all(dir)?;
        let path = dir.join("ssh_config");
        std::fs::write(&path, text)?;
        self.ssh_config = Some(path);
        Ok(())
    }

    /// The configuration forgepool's git gets for the forges, as `-c` pairs: a credential
    /// helper per HTTPS host that prints the user name and the token from the worker's own
    /// variable (the command line names the variable, never its value), the host's CA file,
    /// and the ssh configuration.
    pub fn git_config(&self) -> Vec<String> {
        let mut config = Vec::new();
        // The process's `GIT_SSL_CAINFO` would outrank every host's CA file: it becomes the
        // default instead, and a host's own CA file wins for that host.
        if self.forges.iter().any(|f| f.ca_file.is_some()) {
            if let Ok(ca) = std::env::var("GIT_SSL_CAINFO") {
                config.push(format!("http.sslCAInfo={ca}"));
            }
        }
        for forge in &self.forges {
            let base = format!("https://{}", forge.host);
            if let Some(variable) = &forge.token_env {
                let user = forge
                    .username
                    .clone()
                    .unwrap_or_else(|| forge.kind.token_user().to_string());
                config.push(format!(
                    "credential.{base}.helper=!f() {{ test \"$1\" = get || exit 0; printf 'username=%s\\npassword=%s\\n' '{user}' \"${variable}\"; }}; f"
                ));
            }
            if let Some(ca) = &forge.ca_file {
                config.push(format!("http.{base}/.sslCAInfo={}", ca.display()));
            }
        }
        if let Some(ssh) = &self.ssh_config {
            config.push(format!("core.sshCommand=ssh -F '{}'", ssh.display()));
        }
        config
    }

    /// The variables of this process that would outrank the forges' settings, and are taken
    /// from forgepool's git: `GIT_SSL_CAINFO` when a host has its CA file (it is the default
    /// CA instead), `GIT_SSH_COMMAND` and `GIT_SSH` when a host has an SSH key.
    pub fn overridden_environment(&self) -> Vec<&'static str> {
        let mut names = Vec::new();
        if self.forges.iter().any(|f| f.ca_file.is_some()) {
            names.push("GIT_SSL_CAINFO");
        }
        if self.ssh_config.is_some() {
            names.extend(["GIT_SSH_COMMAND", "GIT_SSH"]);
        }
        names
    }

    /// The values of the forges' tokens in this process's environment, to redact.
    pub fn secrets(&self) -> Vec<String> {
        self.forges
            .iter()
            .filter_map(|f| f.token_env.as_deref())
            .filter_map(|name| std::env::var(name).ok())
            .filter(|value| !value.is_empty())
            .collect()
    }

    /// What a failed git command's error means for a configured forge: which host refused
    /// which credentials, and which setting to look at. `None` when it is nothing of that.
    pub fn explain(&self, stderr: &str) -> Option<String> {
        let forge = self.forges.iter().find(|f| {
            let name = f.host.split(':').next().unwrap_or(&f.host);
            stderr.contains(&f.host) || stderr.contains(name)
        })?;
        let lower = stderr.to_ascii_lowercase();
        if lower.contains("host key verification failed") {
            return Some(format!(
                "the SSH host key of {} is not the one pinned in {} (forges file: known_hosts_file)",
                forge.host,
                forge
                    .known_hosts_file
                    .as_deref()
                    .map_or("no file".into(), |p| p.display().to_string())
            ));
        }
        if lower.contains("permission denied (publickey") {
            return Some(format!(
                "{} refused the SSH key {} (forges file: ssh_key_file)",
                forge.host,
                forge
                    .ssh_key_file
                    .as_deref()
                    .map_or("(none configured)".into(), |p| p.display().to_string())
            ));
        }
        if lower.contains("authentication failed")
            || lower.contains("returned error: 401")
            || lower.contains("returned error: 403")
            || lower.contains("could not read username")
        {
            return Some(match &forge.token_env {
                Some(variable) => format!(
                    "{} refused the token in ${variable} (forges file: token_env for host {})",
                    forge.host, forge.host
                ),
                None => format!(
                    "{} asks for credentials and its forges file entry has no token_env",
                    forge.host
                ),
            });
        }
        if lower.contains("certificate") || lower.contains("ssl") {
            return Some(format!(
                "the TLS certificate of {} is not trusted (forges file: ca_file{})",
                forge.host,
                forge
                    .ca_file
                    .as_deref()
                    .map_or(String::from(", none set"), |p| format!(
                        " = {}",
                        p.display()
                    ))
            ));
        }
        None
    }
}

/// Checks one entry.
fn check(forge: &Forge, env: &impl Fn(&str) -> Option<String>) -> Result<(), String> {
    let host_ok = !forge.host.is_empty()
        && forge.host.len() <= 253
        && forge
            .host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-.:[]".contains(&b));
    if !host_ok {
        return Err(format!(
            "host must be a host name with an optional port, like \"github.com\" or \"git.example:8443\", got {:?}",
            forge.host
        ));
    }
    for (key, url) in [
        ("api_url", Some(&forge.api_url)),
        ("graphql_url", forge.graphql_url.as_ref()),
    ] {
        let Some(url) = url else { continue };
        let loopback = ["127.0.0.1", "localhost", "[::1]"]
            .iter()
            .any(|l| url.starts_with(&format!("http://{l}")));
        if !(url.starts_with("https://") || loopback) {
            return Err(format!(
                "{key} must be an https:// URL (http:// only on loopback), got {url:?}"
            ));
        }
    }
    if let Some(variable) = &forge.token_env {
        let shaped = variable
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_uppercase() || b == b'_')
            && variable
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !shaped {
            return Err(format!(
                "token_env must be an environment variable name like GITHUB_TOKEN, got {variable:?}"
            ));
        }
        if env(variable).is_none_or(|v| v.is_empty()) {
            return Err(format!(
                "token_env names {variable}, which is not set in the worker's environment"
            ));
        }
    }
    if let Some(user) = &forge.username {
        if user.is_empty()
            || !user
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(format!(
                "username must be letters, digits, `-`, `_` or `.`, got {user:?}"
            ));
        }
    }
    match (&forge.ssh_key_file, &forge.known_hosts_file) {
        (Some(_), None) => {
            return Err(
                "ssh_key_file needs known_hosts_file: the host's key is pinned, never learned"
                    .into(),
            )
        }
        (None, Some(_)) => return Err("known_hosts_file only applies with ssh_key_file".into()),
        _ => {}
    }
    for (key, file) in [
        ("ssh_key_file", &forge.ssh_key_file),
        ("known_hosts_file", &forge.known_hosts_file),
        ("ca_file", &forge.ca_file),
    ] {
        if let Some(file) = file {
            let text = file.display().to_string();
            if !file.is_absolute() || text.contains(['\'', '"', '\n']) {
                return Err(format!(
                    "{key} must be an absolute path without quotes, got {text:?}"
                ));
            }
            if !file.is_file() {
                return Err(format!("{key} {text} is not a readable file"));
            }
        }
    }
    Ok(())
}

/// The host of a repository URL, lowercased, without user or port.
fn url_host(url: &str) -> Option<String> {
    let rest = match url.split_once("://") {
        Some((_, rest)) => rest,
        // scp-like `user@host:path`
        None => url.split_once(':').map(|(host, _)| host)?,
    };
    let authority = rest.split('/').next()?;
    let host = authority.rsplit('@').next()?;
    let host = if let Some(bracketed) = host.strip_prefix('[') {
        bracketed.split(']').next()?
    } else {
        host.split(':').next()?
    };
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        (name == "GITHUB_TOKEN").then(|| "ghs_secretvalue".to_string())
    }

    const FILE: &str = r#"
[[forge]]
host = "github.com"
kind = "github"
api_url = "https://api.github.com"
token_env = "GITHUB_TOKEN"

[[forge]]
host = "git.example:8443"
kind = "gitea"
api_url = "https://git.example:8443/api/v1"
"#;

    /// Catches: a token value on git's command line, a credential helper that is not scoped
    /// to its host, or a URL matched to the wrong entry.
    #[test]
    fn tokens_reach_git_by_variable_name_only_and_per_host() {
        let forges = Forges::parse(FILE, Path::new("forges.toml"), env).unwrap();
        let config = forges.git_config().join("\n");
        assert!(!config.contains("ghs_secretvalue"), "{config}");
        assert!(
            config.contains("credential.https://github.com.helper=!f()"),
            "{config}"
        );
        assert!(config.contains("\"$GITHUB_TOKEN\""), "{config}");
        assert!(config.contains("'x-access-token'"), "{config}");
        assert_eq!(
            forges.for_url("https://github.com/o/r.git").unwrap().kind,
            ForgeKind::Github
        );
        assert_eq!(
            forges.for_url("ssh://git@GitHub.com/o/r.git").unwrap().kind,
            ForgeKind::Github
        );
        assert_eq!(
            forges.for_url("git@github.com:o/r.git").unwrap().kind,
            ForgeKind::Github
        );
        assert_eq!(
            forges.for_url("https://git.example:8443/o/r").unwrap().kind,
            ForgeKind::Gitea
        );
        assert!(forges.for_url("https://gitlab.com/o/r").is_none());
        assert_eq!(
            forges.secrets(),
            Vec::<String>::new(),
            "the test's variable is not in this process"
        );
    }

    /// Catches: a bad entry accepted, or an error that does not name the file, the entry and
    /// the key.
    #[test]
    fn every_bad_entry_is_named() {
        let path = Path::new("/etc/forgepool/forges.toml");
        let cases = [
            ("[[forge]]\nhost = \"h\"\nkind = \"bitbucket\"\napi_url = \"https://h\"\n", "kind"),
            ("[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"http://h\"\n", "api_url"),
            ("[[forge]]\nhost = \"h/x\"\nkind = \"github\"\napi_url = \"https://h\"\n", "host must be"),
            ("[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"https://h\"\ntoken_env = \"UNSET_TOKEN\"\n", "UNSET_TOKEN, which is not set"),
            ("[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"https://h\"\nssh_key_file = \"/etc/hostname\"\n", "known_hosts_file"),
            ("[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"https://h\"\nca_file = \"/nonexistent/ca.pem\"\n", "ca_file /nonexistent/ca.pem is not a readable file"),
            ("[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"https://h\"\ncolour = 1\n", "unknown field"),
            ("run_url = \"https://forgepool.example/runs\"\n", "run_url must be"),
            ("run_url = \"file:///runs/{run_id}\"\n", "run_url must be"),
            ("[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"https://h\"\n[[forge]]\nhost = \"h\"\nkind = \"gitlab\"\napi_url = \"https://h\"\n", "earlier entry"),
        ];
        for (text, expected) in cases {
            let error = Forges::parse(text, path, env).unwrap_err();
            assert!(error.contains("/etc/forgepool/forges.toml"), "{error}");
            assert!(error.contains(expected), "`{expected}` not in: {error}");
        }
    }

    /// Catches: a refused token or key reported as a bare git error that names no setting.
    #[test]
    fn refusals_name_the_host_and_the_setting() {
        let forges = Forges::parse(FILE, Path::new("forges.toml"), env).unwrap();
        let https = forges
            .explain("fatal: Authentication failed for 'https://github.com/o/r.git/'")
            .unwrap();
        assert!(
            https.contains("github.com refused the token in $GITHUB_TOKEN"),
            "{https}"
        );
        let none = forges.explain("fatal: repository 'https://gitlab.com/x' not found");
        assert_eq!(none, None);
    }

    /// Catches: draft changes sent to a wrong GraphQL endpoint (GitHub.com's or an Enterprise
    /// Server's), and a plain-HTTP endpoint off loopback accepted.
    #[test]
    fn github_graphql_endpoints_follow_the_api_root() {
        let entry = |api: &str, graphql: Option<&str>| Forge {
            host: "h".into(),
            kind: ForgeKind::Github,
            api_url: api.into(),
            graphql_url: graphql.map(String::from),
            token_env: None,
            username: None,
            ssh_key_file: None,
            known_hosts_file: None,
            ca_file: None,
        };
        assert_eq!(
            entry("https://api.github.com", None).graphql(),
            "https://api.github.com/graphql"
        );
        assert_eq!(
            entry("https://ghe.example/api/v3/", None).graphql(),
            "https://ghe.example/api/graphql"
        );
        assert_eq!(
            entry("https://x", Some("https://y/graphql")).graphql(),
            "https://y/graphql"
        );
        let text = "[[forge]]\nhost = \"h\"\nkind = \"github\"\napi_url = \"https://h\"\ngraphql_url = \"http://h/graphql\"\n";
        let error = Forges::parse(text, Path::new("forges.toml"), |_| None).unwrap_err();
        assert!(
            error.contains("graphql_url must be an https:// URL"),
            "{error}"
        );
    }
}
