//! Name rules (SPEC 2) for tickets, projects, skills, steps and environment variable names,
//! shared by the dispatcher (at submission) and the worker (which trusts no job message).

/// The project key of a ticket that matches `^[A-Za-z][A-Za-z0-9_]*-[0-9]+$`, lowercased.
pub fn project_of(ticket: &str) -> Option<String> {
    let (project, number) = ticket.rsplit_once('-')?;
    let mut chars = project.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
    let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    let number_ok = !number.is_empty() && number.bytes().all(|b| b.is_ascii_digit());
    (first_ok && rest_ok && number_ok && ticket.len() <= 128).then(|| project.to_ascii_lowercase())
}

/// Whether a skill name matches `^[a-z0-9][a-z0-9-]{0,63}$`.
pub fn is_skill(skill: &str) -> bool {
    matches_name(skill, |b| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'
    })
}

/// Whether an agent profile name matches `^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$` (it names
/// queues on the broker: a profile's cap slots).
pub fn is_profile_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    (1..=64).contains(&bytes.len())
        && bytes[0].is_ascii_alphanumeric()
        && bytes[1..]
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

/// Whether a step name matches `^[a-z0-9][a-z0-9_]{0,63}$`.
pub fn is_step(step: &str) -> bool {
    matches_name(step, |b| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'
    })
}

/// Why an environment variable name may not be given to a stage, if it may not: it must look
/// like `ANTHROPIC_API_KEY`, and it must not be one of forgepool's own (`FORGE_*`,
/// `FORGEPOOL_*`) or one that changes how programs run (`PATH`, `HOME`, `LD_*`, proxies).
pub fn env_name_refusal(name: &str) -> Option<&'static str> {
    let shaped = name.len() <= 128
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !shaped {
        return Some("it must be a variable name like ANTHROPIC_API_KEY, never a value");
    }
    let upper = name.to_ascii_uppercase();
    let reserved = upper.starts_with("FORGE_")
        || upper.starts_with("FORGEPOOL_")
        || upper.starts_with("LD_")
        || upper.starts_with("DOCKER_")
        || upper.starts_with("GIT_")
        || matches!(
            upper.as_str(),
            "PATH"
                | "HOME"
                | "USER"
                | "SHELL"
                | "HTTP_PROXY"
                | "HTTPS_PROXY"
                | "NO_PROXY"
                | "ALL_PROXY"
        );
    reserved.then_some("forgepool and the container set it, or it changes how programs run")
}

/// Whether a container user names root (`0`, `0:…`, `root`, `root:…`).
pub fn is_root_user(user: &str) -> bool {
    let name = user.split(':').next().unwrap_or("").trim();
    name == "0" || name == "root" || name.trim_start_matches('0').is_empty()
}

/// The repository URL schemes `forgepool run` accepts when `FORGEPOOL_ALLOWED_URL_SCHEMES` is
/// unset (a local repository is the user's own).
pub const DEFAULT_ALLOWED_SCHEMES: &[&str] = &["https", "ssh", "file"];
/// The schemes the dispatcher and workers accept when it is unset: `file://` would let a
/// submission name any repository on a worker's host, its cache's mirrors included.
pub const SERVICE_ALLOWED_SCHEMES: &[&str] = &["https", "ssh"];
/// Every scheme that may be allowed: git's own transports, never a remote helper.
pub const KNOWN_SCHEMES: &[&str] = &["https", "http", "ssh", "git", "file"];

/// [`DEFAULT_ALLOWED_SCHEMES`] as owned strings.
pub fn default_allowed_schemes() -> Vec<String> {
    DEFAULT_ALLOWED_SCHEMES
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Parses a comma-separated list of allowed schemes; each must be one of [`KNOWN_SCHEMES`].
pub fn parse_schemes(text: &str) -> Result<Vec<String>, String> {
    let schemes: Vec<String> = text
        .split(',')
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    if schemes.is_empty() {
        return Err("must list at least one scheme, like `https,ssh,file`".into());
    }
    if let Some(bad) = schemes
        .iter()
        .find(|s| !KNOWN_SCHEMES.contains(&s.as_str()))
    {
        return Err(format!(
            "lists `{bad}`; the schemes that can be allowed are {}",
            KNOWN_SCHEMES.join(", ")
        ));
    }
    Ok(schemes)
}

/// The scheme of a repository URL as git would treat it: `https://…` is `https`, `x::…` (a
/// remote helper, such as `ext::`) is `x`, `host:path` is `ssh`, a plain path is `file`.
pub fn url_scheme(url: &str) -> String {
    if let Some((scheme, _)) = url.split_once("://") {
        if !scheme.contains("::") {
            return scheme.to_ascii_lowercase();
        }
    }
    if let Some((transport, _)) = url.split_once("::") {
        return transport.to_ascii_lowercase();
    }
    match url.split_once(':') {
        Some((host, _)) if !host.contains('/') && !host.is_empty() => "ssh".into(),
        _ => "file".into(),
    }
}

/// Checks a repository URL against the allowed schemes; the error says what is allowed.
pub fn check_url(url: &str, allowed: &[String]) -> Result<(), String> {
    let scheme = url_scheme(url);
    if !KNOWN_SCHEMES.contains(&scheme.as_str()) || !allowed.contains(&scheme) {
        return Err(format!(
            "uses the scheme `{scheme}`, which is not allowed; allowed schemes are {} (FORGEPOOL_ALLOWED_URL_SCHEMES)",
            allowed.join(", ")
        ));
    }
    if url.is_empty()
        || url.starts_with('-')
        || url.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(
            "must be a git URL without spaces or control characters that does not start with '-'"
                .into(),
        );
    }
    if let Some(what) = credential_in_url(url) {
        return Err(format!(
            "must not carry credentials ({what}): it is shown to the agent and stored with the run; give forgepool the host's token or deploy key in the forges file (FORGEPOOL_FORGES_FILE, SPEC 9)"
        ));
    }
    Ok(())
}

/// What in a repository URL could be a credential: a password (`user:secret@`), a user name
/// on http(s) (a token passed as the user), or a query or fragment (`?token=…`). An ssh
/// user name (`ssh://git@host/…`, `git@host:…`) is not one.
pub fn credential_in_url(url: &str) -> Option<&'static str> {
    let scheme = url_scheme(url);
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or_default();
    if let Some((userinfo, _)) = authority.rsplit_once('@') {
        if userinfo.contains(':') {
            return Some("a password in the URL");
        }
        if scheme == "https" || scheme == "http" {
            return Some("a user name in an http(s) URL, where it is a token");
        }
    }
    if matches!(scheme.as_str(), "https" | "http" | "git")
        && (rest.contains('?') || rest.contains('#'))
    {
        return Some("a query or fragment");
    }
    None
}

/// A repository URL as forgepool shows it: its user information, query and fragment
/// replaced by `***`.
pub fn shown_url(url: &str) -> String {
    let redacted = redact_url_credentials(url);
    match redacted.find(['?', '#']) {
        Some(at) if url.contains("://") => format!("{}{}***", &redacted[..at], &redacted[at..=at]),
        _ => redacted,
    }
}

/// `text` with the credential part of every URL in it (`scheme://userinfo@`) replaced by
/// `***`: what forgepool shows of a git command line or error never carries a password.
pub fn redact_url_credentials(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c == '/' || c.is_whitespace() || c == '\'' || c == '"' || c == '`')
            .unwrap_or(tail.len());
        match tail[..end].rfind('@') {
            Some(user_end) => {
                out.push_str("***");
                out.push_str(&tail[user_end..end]);
            }
            None => out.push_str(&tail[..end]),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    out
}

/// A name of 1..=64 bytes whose first byte is `[a-z0-9]` and whose other bytes pass `rest`.
fn matches_name(name: &str, rest: impl Fn(u8) -> bool) -> bool {
    let bytes = name.as_bytes();
    (1..=64).contains(&bytes.len())
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes[1..].iter().all(|&b| rest(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a token in a repository URL accepted (it would reach the agent's job file,
    /// failure reasons, webhooks and the process list), and an ssh user taken for one.
    #[test]
    fn credentials_in_repository_urls_are_refused_and_redacted() {
        let allowed: Vec<String> = ["https", "ssh", "http", "git"].map(String::from).to_vec();
        for url in [
            "https://github.com/a/b.git",
            "ssh://git@host/a.git",
            "git@github.com:a/b.git",
            "https://host:8443/a/b.git",
        ] {
            assert_eq!(check_url(url, &allowed), Ok(()), "{url}");
        }
        for url in [
            "https://user:ghp_secret@github.com/a/b.git",
            "https://ghp_secret@github.com/a/b.git",
            "http://x-access-token:tok@127.0.0.1/a.git",
            "ssh://git:secret@host/a.git",
            "https://host/a.git?private_token=secret",
            "https://host/a.git#secret",
        ] {
            let refused = check_url(url, &allowed).unwrap_err();
            assert!(
                refused.contains("FORGEPOOL_FORGES_FILE"),
                "{url}: {refused}"
            );
            assert!(
                !refused.contains("secret") && !refused.contains("tok@"),
                "{refused}"
            );
        }
        assert_eq!(
            redact_url_credentials("`git fetch https://user:pw@host/a.git` failed: https://t@h/x"),
            "`git fetch https://***@host/a.git` failed: https://***@h/x"
        );
        assert_eq!(redact_url_credentials("no url here"), "no url here");
        assert_eq!(
            shown_url("https://u:p@host/a.git?private_token=secret"),
            "https://***@host/a.git?***"
        );
        assert_eq!(shown_url("git@host:a/b.git"), "git@host:a/b.git");
        assert_eq!(redact_url_credentials("https://host/a"), "https://host/a");
    }

    #[test]
    fn names_and_refusals() {
        assert_eq!(project_of("MYPROJECT-123").as_deref(), Some("myproject"));
        for bad in ["../x-1", "a/b-1", "-1", "A-", "1A-2", "A-1b"] {
            assert_eq!(project_of(bad), None, "{bad}");
        }
        assert!(is_skill("implement-task") && !is_skill("../etc") && !is_skill("A"));
        assert!(is_step("implement_task") && !is_step("a-b") && !is_step(""));
        assert_eq!(env_name_refusal("ANTHROPIC_API_KEY"), None);
        for bad in [
            "FORGEPOOL_JOB_KEY",
            "LD_PRELOAD",
            "PATH",
            "sk-123",
            "A B",
            "GIT_SSH_COMMAND",
        ] {
            assert!(env_name_refusal(bad).is_some(), "{bad}");
        }
        for root in ["0", "0:0", "root", "root:root", "00:1"] {
            assert!(is_root_user(root), "{root}");
        }
        for user in ["65534:65534", "1000", "agent"] {
            assert!(!is_root_user(user), "{user}");
        }
        let allowed = default_allowed_schemes();
        for (url, scheme) in [
            ("https://github.com/a/b.git", "https"),
            ("ssh://git@host/a.git", "ssh"),
            ("git@github.com:a/b.git", "ssh"),
            ("file:///srv/a.git", "file"),
            ("/srv/a.git", "file"),
            ("ext::sh -c touch% /tmp/x", "ext"),
            ("fd::17", "fd"),
            ("ext::ssh://x", "ext"),
            ("HTTP://x/y", "http"),
        ] {
            assert_eq!(url_scheme(url), scheme, "{url}");
        }
        assert!(check_url("https://github.com/a/b.git", &allowed).is_ok());
        assert!(check_url("file:///srv/a.git", &allowed).is_ok());
        for bad in [
            "ext::sh -c id",
            "fd::3",
            "http://x/y",
            "-u",
            "git://x/y",
            "foo::bar",
        ] {
            let error = check_url(bad, &allowed).unwrap_err();
            assert!(!error.is_empty(), "{bad}");
        }
        assert!(check_url("http://x/y", &parse_schemes("http, https").unwrap()).is_ok());
        assert!(parse_schemes("https,ext").unwrap_err().contains("`ext`"));
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn accepted_tickets_match_the_rule(ticket in "\\PC{0,20}") {
                if let Some(project) = project_of(&ticket) {
                    let (head, number) = ticket.rsplit_once('-').unwrap();
                    prop_assert!(head.chars().next().unwrap().is_ascii_alphabetic());
                    prop_assert!(head.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
                    prop_assert!(!number.is_empty() && number.chars().all(|c| c.is_ascii_digit()));
                    prop_assert_eq!(project, head.to_ascii_lowercase());
                }
            }

            #[test]
            fn accepted_names_never_leave_a_folder(name in "\\PC{0,70}") {
                if is_skill(&name) || is_step(&name) {
                    prop_assert!(!name.contains('/') && !name.contains("..") && !name.is_empty());
                }
            }

            #[test]
            fn only_allowed_schemes_pass(url in "\\PC{0,40}") {
                let allowed = default_allowed_schemes();
                if check_url(&url, &allowed).is_ok() {
                    prop_assert!(allowed.contains(&url_scheme(&url)));
                    prop_assert!(!url.contains("::") || url.contains("://"));
                }
            }
        }
    }
}
