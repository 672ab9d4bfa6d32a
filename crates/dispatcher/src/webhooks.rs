//! Webhooks on terminal states (SPEC 9, `FORGEPOOL_WEBHOOKS_FILE`): a JSON body with the
//! run's id, ticket, state, branch, commit, pull request and usage, signed with HMAC-SHA256 in
//! `X-Forgepool-Signature-256`, retried with back-off; every attempt is an event of the run
//! (`webhook`), so the record shows what each receiver was told. A dispatcher that restarts
//! notifies, once more, the runs of the last hour whose notification had not ended.
//!
//! For each hook the file names its URL (in the file, or a variable), its HMAC key (a variable)
//! and the terminal states it is told of. `Webhooks::notify` makes one notification's attempts
//! (signed body, back-off, `Retry-After`); each attempt is stored as a `webhook` event, never
//! with the URL.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use proto::{EventKind, JobKey, RunState, SCHEMA_VERSION};
use serde::Deserialize;
use tokio::sync::Semaphore;
use tracing::{info, warn};
use uuid::Uuid;

use crate::store::RunRecord;

/// The header of a notification's signature, `sha256=<hex>` of the body.
pub const SIGNATURE_HEADER: &str = "X-Forgepool-Signature-256";
/// The header naming one notification (the same in each of its attempts).
pub const DELIVERY_HEADER: &str = "X-Forgepool-Delivery";
/// The most attempts per notification.
pub const MAX_ATTEMPTS: u32 = 6;
/// How long one attempt may take.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// The first wait between attempts; it doubles each time (2, 4, 8, 16, 32 s).
const FIRST_BACKOFF: Duration = Duration::from_secs(2);
/// The longest `Retry-After` honoured.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(120);
/// The most notifications sent at once.
const MAX_IN_FLIGHT: usize = 16;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct HookEntry {
    name: String,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    url_env: Option<String>,
    secret_env: String,
    #[serde(default)]
    states: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WebhooksFile {
    #[serde(default)]
    webhook: Vec<HookEntry>,
}

/// One receiver. Its `Debug` shows neither its URL (which may be a secret) nor its key.
#[derive(Clone)]
pub struct Hook {
    /// Its name, shown in the run's record.
    pub name: String,
    url: String,
    key: JobKey,
    /// The terminal states it is told of.
    states: Vec<RunState>,
}

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hook")
            .field("name", &self.name)
            .field("states", &self.states)
            .finish_non_exhaustive()
    }
}

/// The webhooks and the client that calls them.
#[derive(Debug, Clone)]
pub struct Webhooks {
    hooks: Vec<Hook>,
    client: reqwest::Client,
    in_flight: Arc<Semaphore>,
}

/// The queue of runs that ended, as the dispatcher fills it.
#[derive(Debug)]
pub struct Ended {
    /// Where a run that ended goes.
    pub sender: tokio::sync::mpsc::Sender<Uuid>,
    /// A run could not be queued (the queue was full): the next check reads the store.
    pub dropped: std::sync::atomic::AtomicBool,
}

/// What a receiver gets.
#[derive(Debug, serde::Serialize)]
pub struct Notification<'a> {
    /// Always [`SCHEMA_VERSION`].
    pub schema_version: u32,
    /// `run.finished`.
    pub event: &'static str,
    /// The run.
    pub run_id: Uuid,
    /// Its ticket.
    pub ticket: &'a str,
    /// Its skill.
    pub skill: &'a str,
    /// Its terminal state.
    pub state: RunState,
    /// Why it ended there.
    pub reason: &'a str,
    /// The delivered branch.
    pub branch: Option<&'a str>,
    /// The delivered commit.
    pub commit: Option<&'a str>,
    /// The pull request's address (none until forges open them).
    pub pull_request: Option<&'a str>,
    /// What the run's agents said they spent.
    pub usage: Option<&'a proto::UsageTotals>,
}

impl Webhooks {
    /// Loads and checks a webhooks file: each entry's name, an `https://` URL (`http://` only
    /// on loopback) or the variable holding one, a signing secret of at least 16 characters
    /// in the named variable, and known terminal states. Errors name the file, the entry and
    /// the key.
    pub fn load(path: &Path, env: impl Fn(&str) -> Option<String>) -> Result<Webhooks, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("webhooks file {}: cannot read it: {e}", path.display()))?;
        let file: WebhooksFile = toml::from_str(&text).map_err(|e| {
            format!(
                "webhooks file {}: {}",
                path.display(),
                e.to_string().trim_end()
            )
        })?;
        let mut hooks = Vec::new();
        for (index, entry) in file.webhook.into_iter().enumerate() {
            let hook = check(entry, &env).map_err(|message| {
                format!(
                    "webhooks file {}: webhook[{index}]: {message}",
                    path.display()
                )
            })?;
            hooks.push(hook);
        }
        let client = reqwest::Client::builder()
            .timeout(ATTEMPT_TIMEOUT)
            .connect_timeout(ATTEMPT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("forgepool/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("webhooks: cannot build the HTTP client: {e}"))?;
        Ok(Webhooks {
            hooks,
            client,
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        })
    }

    /// The hooks told of a run that ended in `state`.
    pub fn hooks_for(&self, state: RunState) -> Vec<Hook> {
        self.hooks
            .iter()
            .filter(|h| h.states.contains(&state))
            .cloned()
            .collect()
    }

    /// Tells `hook` that the run of `record` ended, attempt after attempt; `record` returns
    /// each attempt's event to store. Returns whether the receiver took it.
    pub async fn notify<F, Fut>(&self, hook: &Hook, record: &RunRecord, mut store: F) -> bool
    where
        F: FnMut(EventKind) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let Ok(_permit) = Arc::clone(&self.in_flight).acquire_owned().await else {
            return false;
        };
        let body = body(record);
        let signature = hook.key.sign(&body);
        let delivery = Uuid::new_v4().to_string();
        let mut backoff = FIRST_BACKOFF;
        for attempt in 1..=MAX_ATTEMPTS {
            let sent = self
                .client
                .post(&hook.url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(SIGNATURE_HEADER, &signature)
                .header(DELIVERY_HEADER, &delivery)
                .body(body.clone())
                .send()
                .await;
            let (status, error, retry_after) = match &sent {
                Ok(response) => {
                    let status = response.status();
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok())
                        .map(|s| Duration::from_secs(s).min(MAX_RETRY_AFTER));
                    let error =
                        (!status.is_success()).then(|| format!("the receiver answered {status}"));
                    (Some(status.as_u16()), error, retry_after)
                }
                // Never the URL: it may hold a secret (a Slack webhook's does).
                Err(error) => (None, Some(describe(error)), None),
            };
            let delivered = error.is_none();
            let retryable = match status {
                None => true,
                Some(code) => code == 408 || code == 429 || code >= 500,
            };
            let last = attempt == MAX_ATTEMPTS;
            let outcome = if delivered {
                "delivered"
            } else if retryable && !last {
                "retrying"
            } else {
                "gave_up"
            };
            store(EventKind::Webhook {
                hook: hook.name.clone(),
                attempt,
                status,
                error,
                outcome: outcome.to_string(),
            })
            .await;
            match outcome {
                "delivered" => return true,
                "gave_up" => {
                    warn!(hook = %hook.name, run_id = %record.job.run_id, attempt, "the webhook gave up");
                    return false;
                }
                _ => {}
            }
            tokio::time::sleep(retry_after.unwrap_or(backoff)).await;
            backoff = backoff.saturating_mul(2);
        }
        false
    }
}

/// Why a request failed, without its URL.
fn describe(error: &reqwest::Error) -> String {
    let kind = if error.is_timeout() {
        "it did not answer in time"
    } else if error.is_connect() {
        "it could not be reached"
    } else {
        "the request failed"
    };
    kind.to_string()
}

/// The notification's body.
pub fn body(record: &RunRecord) -> Vec<u8> {
    let result = record.result.as_ref();
    let reason = record
        .states
        .last()
        .map(|(_, reason, _)| reason.as_str())
        .unwrap_or_default();
    let notification = Notification {
        schema_version: SCHEMA_VERSION,
        event: "run.finished",
        run_id: record.job.run_id,
        ticket: &record.job.ticket,
        skill: &record.job.skill,
        state: record.state,
        reason,
        branch: result.and_then(|r| r.branch.as_deref()),
        commit: result.and_then(|r| r.commit.as_deref()),
        pull_request: result.and_then(|r| r.pull_request.as_deref()),
        usage: result.and_then(|r| r.usage.as_ref()),
    };
    serde_json::to_vec(&notification).unwrap_or_default()
}

fn check(entry: HookEntry, env: &impl Fn(&str) -> Option<String>) -> Result<Hook, String> {
    let name_ok = !entry.name.is_empty()
        && entry.name.len() <= 64
        && entry
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !name_ok {
        return Err(format!(
            "name must be 1 to 64 letters, digits, `-`, `_` or `.`, got {:?}",
            entry.name
        ));
    }
    let url = match (&entry.url, &entry.url_env) {
        (Some(url), None) => url.clone(),
        (None, Some(variable)) => env(variable).filter(|v| !v.is_empty()).ok_or_else(|| {
            format!("url_env names {variable}, which is not set in the dispatcher's environment")
        })?,
        _ => return Err("give url or url_env (a URL that is a secret), one of the two".into()),
    };
    check_url(&url)?;
    let secret = env(&entry.secret_env).ok_or_else(|| {
        format!(
            "secret_env names {}, which is not set in the dispatcher's environment",
            entry.secret_env
        )
    })?;
    let key =
        JobKey::new(&secret).map_err(|e| format!("the secret in {}: {e}", entry.secret_env))?;
    let states = if entry.states.is_empty() {
        vec![
            RunState::Delivered,
            RunState::DeliveredWithWarnings,
            RunState::Blocked,
            RunState::Failed,
            RunState::Cancelled,
        ]
    } else {
        entry
            .states
            .iter()
            .map(|s| {
                RunState::parse(s).filter(|s| s.is_terminal()).ok_or_else(|| {
                    format!("states holds {s:?}; give terminal states (delivered, delivered_with_warnings, blocked, failed, cancelled)")
                })
            })
            .collect::<Result<_, _>>()?
    };
    info!(hook = %entry.name, "webhook configured");
    Ok(Hook {
        name: entry.name,
        url,
        key,
        states,
    })
}

/// A webhook's URL: `https://` to any host, `http://` only to a loopback host, judged on the
/// parsed URL (a prefix test let `http://127.0.0.1@other-host/` and
/// `http://127.0.0.1.example.net/` through).
fn check_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("the URL is not valid: {e}"))?;
    let host = parsed.host_str().unwrap_or_default();
    let loopback = match host.trim_start_matches('[').trim_end_matches(']').parse() {
        Ok(ip) => std::net::IpAddr::is_loopback(&ip),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    };
    match parsed.scheme() {
        "https" if !host.is_empty() => Ok(()),
        "http" if loopback => Ok(()),
        _ => Err("the URL must be https:// (http:// only to a loopback host)".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: the loopback rule judged on the URL's text (a user name or a domain that
    /// starts like a loopback address let plain http go to another host).
    #[test]
    fn plain_http_goes_only_to_a_loopback_host() {
        for url in [
            "https://hooks.example.com/forgepool",
            "http://127.0.0.1:9000/hook",
            "http://127.8.0.1/hook",
            "http://localhost/hook",
            "http://[::1]:8080/hook",
        ] {
            assert_eq!(check_url(url), Ok(()), "{url}");
        }
        for url in [
            "http://127.0.0.1@other-host/",
            "http://127.0.0.1.example.net/",
            "http://localhost.example.net/",
            "http://[::2]/",
            "http://example.com/",
            "ftp://127.0.0.1/",
            "https://",
            "not a url",
        ] {
            assert!(check_url(url).is_err(), "{url} was accepted");
        }
    }

    fn env(name: &str) -> Option<String> {
        match name {
            "HOOK_SECRET" => Some("a-secret-of-at-least-16".into()),
            "SLACK_URL" => Some("https://hooks.slack.example/T000/B000/XXXX".into()),
            _ => None,
        }
    }

    /// Catches: a bad entry accepted, or an error that names neither the file nor the key.
    #[test]
    fn every_bad_entry_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("webhooks.toml");
        let cases = [
            ("[[webhook]]\nname = \"a\"\nurl = \"http://example.com\"\nsecret_env = \"HOOK_SECRET\"\n", "https://"),
            ("[[webhook]]\nname = \"a\"\nurl_env = \"NOPE\"\nsecret_env = \"HOOK_SECRET\"\n", "url_env names NOPE"),
            ("[[webhook]]\nname = \"a\"\nurl = \"https://x\"\nsecret_env = \"NOPE\"\n", "secret_env names NOPE"),
            ("[[webhook]]\nname = \"a\"\nurl = \"https://x\"\nsecret_env = \"HOOK_SECRET\"\nstates = [\"running\"]\n", "terminal states"),
            ("[[webhook]]\nname = \"a b\"\nurl = \"https://x\"\nsecret_env = \"HOOK_SECRET\"\n", "name must be"),
            ("[[webhook]]\nname = \"a\"\nurl = \"https://x\"\nsecret_env = \"HOOK_SECRET\"\ncolour = 1\n", "unknown field"),
        ];
        for (text, expected) in cases {
            std::fs::write(&path, text).unwrap();
            let error = Webhooks::load(&path, env).unwrap_err();
            assert!(error.contains("webhooks.toml"), "{error}");
            assert!(error.contains(expected), "`{expected}` not in: {error}");
        }
        std::fs::write(
            &path,
            "[[webhook]]\nname = \"slack\"\nurl_env = \"SLACK_URL\"\nsecret_env = \"HOOK_SECRET\"\nstates = [\"failed\"]\n",
        )
        .unwrap();
        let hooks = Webhooks::load(&path, env).unwrap();
        assert_eq!(hooks.hooks_for(RunState::Failed).len(), 1);
        assert!(hooks.hooks_for(RunState::Delivered).is_empty());
        assert!(!format!("{hooks:?}").contains("a-secret-of-at-least-16"));
    }
}
