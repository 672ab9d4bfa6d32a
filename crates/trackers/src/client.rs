//! The HTTP client of every tracker call: a connect and a total timeout, answers read to at
//! most [`MAX_ANSWER_BYTES`], the tracker's rate limits honoured (`Retry-After`, GitHub's
//! `x-ratelimit-remaining: 0` with `x-ratelimit-reset`): while a limit holds, calls fail at
//! once with [`TrackerError::RateLimited`] and never reach the tracker. No error carries the
//! token. Each answer's status is told to the observer (the dispatcher's metrics).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The most bytes of a tracker's answer read.
pub const MAX_ANSWER_BYTES: usize = 4 << 20;
/// The limit on one call, connection included.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest rate-limit wait honoured from one answer.
const MAX_WAIT: Duration = Duration::from_secs(3600);

/// What went wrong talking to a tracker.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TrackerError {
    /// The tracker asked for calls to wait this long.
    #[error("rate-limited by the tracker for {} s more", .0.as_secs())]
    RateLimited(Duration),
    /// The tracker answered with an error status.
    #[error("the tracker answered {status}: {message}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The start of its message.
        message: String,
    },
    /// The tracker could not be reached, or did not answer in time.
    #[error("the tracker could not be reached: {0}")]
    Unreachable(String),
    /// The answer was not what its API describes.
    #[error("the tracker's answer could not be read: {0}")]
    Answer(String),
}

/// Told the status of each answer (0 when none came).
pub type Observer = Arc<dyn Fn(u16) + Send + Sync>;

/// A tracker's API.
pub struct Client {
    http: reqwest::Client,
    base: String,
    authorization: String,
    extra: Vec<(&'static str, &'static str)>,
    blocked_until: Mutex<Option<Instant>>,
    observer: Mutex<Option<Observer>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the API at `base`, sending `authorization` and the `extra` headers.
    pub fn new(
        base: &str,
        authorization: String,
        extra: Vec<(&'static str, &'static str)>,
    ) -> Result<Client, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .timeout(CALL_TIMEOUT)
            .user_agent(concat!("forgepool/", env!("CARGO_PKG_VERSION")))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Client {
            http,
            base: base.trim_end_matches('/').to_string(),
            authorization,
            extra,
            blocked_until: Mutex::new(None),
            observer: Mutex::new(None),
        })
    }

    /// Tells `observer` each answer's status from now on.
    pub fn observe(&self, observer: Observer) {
        *self.observer.lock().unwrap_or_else(|p| p.into_inner()) = Some(observer);
    }

    /// Sends a call; its JSON answer (`null` for an empty one).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<serde_json::Value, TrackerError> {
        if let Some(until) = *self.blocked_until.lock().unwrap_or_else(|p| p.into_inner()) {
            let now = Instant::now();
            if until > now {
                return Err(TrackerError::RateLimited(until - now));
            }
        }
        let mut request = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("authorization", &self.authorization)
            .header("accept", "application/json");
        for (name, value) in &self.extra {
            request = request.header(*name, *value);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let answer = request.send().await;
        let mut answer = match answer {
            Ok(answer) => answer,
            Err(e) => {
                self.tell(0);
                // reqwest's error names the URL, never the headers.
                return Err(TrackerError::Unreachable(e.without_url().to_string()));
            }
        };
        let status = answer.status().as_u16();
        self.tell(status);
        if let Some(wait) = rate_limit_wait(status, answer.headers()) {
            *self.blocked_until.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(Instant::now() + wait);
            if status == 403 || status == 429 {
                return Err(TrackerError::RateLimited(wait));
            }
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = answer
            .chunk()
            .await
            .map_err(|e| TrackerError::Unreachable(e.without_url().to_string()))?
        {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(TrackerError::Answer(format!(
                    "larger than {MAX_ANSWER_BYTES} bytes"
                )));
            }
            bytes.extend_from_slice(&chunk);
        }
        if !(200..300).contains(&status) {
            let message: String = String::from_utf8_lossy(&bytes).chars().take(200).collect();
            return Err(TrackerError::Status { status, message });
        }
        if bytes.is_empty() {
            return Ok(serde_json::Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| TrackerError::Answer(e.to_string()))
    }

    fn tell(&self, status: u16) {
        if let Some(observer) = self
            .observer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            observer(status);
        }
    }
}

/// How long calls must wait after an answer, if its headers say so.
fn rate_limit_wait(status: u16, headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(seconds) = text("retry-after").and_then(|v| v.trim().parse::<u64>().ok()) {
        return Some(Duration::from_secs(seconds.max(1)).min(MAX_WAIT));
    }
    let exhausted = text("x-ratelimit-remaining").is_some_and(|v| v.trim() == "0");
    if exhausted {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let reset = text("x-ratelimit-reset")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(now + 60);
        return Some(Duration::from_secs(reset.saturating_sub(now).max(1)).min(MAX_WAIT));
    }
    (status == 429).then_some(Duration::from_secs(60))
}

/// `text` as one URL path or query part: unreserved characters kept, every other byte of
/// its UTF-8 percent-encoded (`group/project` → `group%2Fproject`).
pub fn path_part(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        match byte {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(byte as char)
            }
            other => out.push_str(&format!("%{other:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    /// Catches: a `/` left in a project path, or a non-ASCII name encoded by code point.
    #[test]
    fn parts_are_percent_encoded_by_byte() {
        assert_eq!(
            super::path_part("group/sub project"),
            "group%2Fsub%20project"
        );
        assert_eq!(super::path_part("é[bot]"), "%C3%A9%5Bbot%5D");
    }
}
