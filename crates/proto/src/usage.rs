//! What agents spend and when their providers let them work again: a stage's `usage.json`
//! and its run's sums, the run's budget, a stage's `pause.json`, the pause of a profile that
//! workers share, and the reason a run waiting for its profile's cap carries (SPEC 5 and 6).

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// The most a `usage.json` may say one stage cost: a larger figure is a mistake, not a bill.
pub const MAX_STAGE_COST_USD: f64 = 1_000_000.0;
/// The longest pause a `pause.json` may ask for: a day. An agent is untrusted, and a longer
/// pause would stop its profile across the pool for as long as it likes.
pub const MAX_PROFILE_PAUSE: Duration = Duration::from_secs(24 * 3600);
/// The longest model name kept from a `usage.json`.
const MAX_MODEL_CHARS: usize = 100;
/// The most distinct model names a run's usage keeps.
const MAX_MODELS: usize = 8;
/// The longest pause reason kept from a `pause.json`.
const MAX_REASON_CHARS: usize = 200;

/// What one stage says it spent (`/forge/output/usage.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    #[serde(default)]
    pub input_tokens: u64,
    /// Completion tokens.
    #[serde(default)]
    pub output_tokens: u64,
    /// Tokens read from the provider's prompt cache.
    #[serde(default)]
    pub cache_read_tokens: u64,
    /// Tokens written to the provider's prompt cache.
    #[serde(default)]
    pub cache_write_tokens: u64,
    /// What the stage cost, in US dollars.
    #[serde(default)]
    pub cost_usd: f64,
    /// The model that did the work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl Usage {
    /// Reads a `usage.json` an agent wrote: every field optional, counts whole and not
    /// negative, the cost a finite amount from 0 to [`MAX_STAGE_COST_USD`], the model name
    /// printable and cut to 100 characters. The error says which field is wrong.
    pub fn parse(bytes: &[u8]) -> Result<Usage, String> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| format!("usage.json: {e}"))?;
        if !value.is_object() {
            return Err("usage.json: must be a JSON object".to_string());
        }
        let mut usage: Usage = serde_json::from_value(value).map_err(|e| {
            format!(
                "usage.json: {e} (expected {{\"input_tokens\": 0, \"output_tokens\": 0, \"cache_read_tokens\": 0, \"cache_write_tokens\": 0, \"cost_usd\": 0.0, \"model\": \"...\"}})"
            )
        })?;
        if !(usage.cost_usd.is_finite() && (0.0..=MAX_STAGE_COST_USD).contains(&usage.cost_usd)) {
            return Err(format!(
                "usage.json: cost_usd must be an amount from 0 to {MAX_STAGE_COST_USD}, got {}",
                usage.cost_usd
            ));
        }
        usage.model = usage
            .model
            .map(|model| printable(&model, MAX_MODEL_CHARS))
            .filter(|model| !model.is_empty());
        Ok(usage)
    }

    /// The token counts by kind, as the metrics label them.
    pub fn tokens(&self) -> [(&'static str, u64); 4] {
        [
            ("input", self.input_tokens),
            ("output", self.output_tokens),
            ("cache_read", self.cache_read_tokens),
            ("cache_write", self.cache_write_tokens),
        ]
    }
}

/// A run's usage: the sum over every stage that reported one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsageTotals {
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Tokens read from the providers' prompt caches.
    pub cache_read_tokens: u64,
    /// Tokens written to the providers' prompt caches.
    pub cache_write_tokens: u64,
    /// What the run cost, in US dollars.
    pub cost_usd: f64,
    /// How many stages reported their usage.
    pub stages: u32,
    /// The models named, each once (at most 8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

impl UsageTotals {
    /// Adds one stage's usage (counts saturate rather than wrap).
    pub fn add(&mut self, usage: &Usage) {
        self.input_tokens = self.input_tokens.saturating_add(usage.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(usage.output_tokens);
        self.cache_read_tokens = self
            .cache_read_tokens
            .saturating_add(usage.cache_read_tokens);
        self.cache_write_tokens = self
            .cache_write_tokens
            .saturating_add(usage.cache_write_tokens);
        self.cost_usd += usage.cost_usd;
        self.stages = self.stages.saturating_add(1);
        if let Some(model) = &usage.model {
            if !self.models.contains(model) && self.models.len() < MAX_MODELS {
                self.models.push(model.clone());
            }
        }
    }

    /// One line for people: `1200 input, 300 output tokens (0 cache read, 0 cache write), $0.42`.
    pub fn summary(&self) -> String {
        format!(
            "{} input, {} output tokens ({} cache read, {} cache write), ${:.4} over {} stage{}",
            self.input_tokens,
            self.output_tokens,
            self.cache_read_tokens,
            self.cache_write_tokens,
            self.cost_usd,
            self.stages,
            if self.stages == 1 { "" } else { "s" }
        )
    }
}

/// A run's spending limits, from the request; a limit not set limits nothing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// The most US dollars the run may spend. A profile with a `provider` is held to it by
    /// the worker's model gateway before each call (SPEC 16); for other profiles, once the
    /// cost their stages report exceeds it, no further stage starts and the run ends `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(exclusive_minimum = 0.0))]
    pub max_cost_usd: Option<f64>,
    /// The most tokens (input, output and cache together) the run's calls through the model
    /// gateway may use; a stage whose call would go past it ends with "budget exhausted".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "crate::request::integral::option")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub max_tokens: Option<u64>,
}

impl std::fmt::Display for Budget {
    /// `$5.00`, `200000 tokens`, or both.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.max_cost_usd, self.max_tokens) {
            (Some(cost), Some(tokens)) => write!(f, "${cost:.2} and {tokens} tokens"),
            (Some(cost), None) => write!(f, "${cost:.2}"),
            (None, Some(tokens)) => write!(f, "{tokens} tokens"),
            (None, None) => write!(f, "no limit"),
        }
    }
}

impl Budget {
    /// A budget of `max_cost_usd` dollars.
    pub fn dollars(max_cost_usd: f64) -> Budget {
        Budget {
            max_cost_usd: Some(max_cost_usd),
            max_tokens: None,
        }
    }

    /// Refuses a limit that is not a positive, finite amount; the error names the field. A
    /// budget that sets neither limit limits nothing (as the API's schema allows `{}`).
    pub fn check(&self) -> Result<(), String> {
        if let Some(cost) = self.max_cost_usd {
            if !(cost.is_finite() && cost > 0.0) {
                return Err(format!(
                    "budget.max_cost_usd must be a positive amount in US dollars, got {cost}"
                ));
            }
        }
        match self.max_tokens {
            Some(0) => Err("budget.max_tokens must be a positive number of tokens, got 0".into()),
            _ => Ok(()),
        }
    }
}

/// What a paused stage's `pause.json` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PauseRequest {
    /// Why (`rate_limit`, `quota`, ...), printable and cut to 200 characters.
    pub reason: String,
    /// Until when the profile should rest, as RFC 3339 UTC; at most a day from `now`.
    pub until: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseFile {
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    retry_after_seconds: Option<f64>,
    #[serde(default)]
    resume_at: Option<String>,
}

impl PauseRequest {
    /// Reads a `pause.json` an agent wrote at `now`: `retry_after_seconds` (a number of
    /// seconds) or `resume_at` (an RFC 3339 time); a time in the past means now, one more than
    /// [`MAX_PROFILE_PAUSE`] ahead is cut to it. The error says which field is wrong.
    pub fn parse(bytes: &[u8], now: SystemTime) -> Result<PauseRequest, String> {
        let file: PauseFile = serde_json::from_slice(bytes).map_err(|e| {
            format!("pause.json: {e} (expected {{\"reason\": \"rate_limit\", \"retry_after_seconds\": 900}} or {{\"reason\": \"...\", \"resume_at\": \"2026-12-03T10:00:00Z\"}})")
        })?;
        let after = match (file.retry_after_seconds, file.resume_at) {
            (Some(seconds), None) => {
                if !(seconds.is_finite() && seconds >= 0.0) {
                    return Err(format!(
                        "pause.json: retry_after_seconds must be a number of seconds from 0, got {seconds}"
                    ));
                }
                Duration::from_secs_f64(seconds.min(MAX_PROFILE_PAUSE.as_secs_f64()))
            }
            (None, Some(at)) => {
                let at = humantime::parse_rfc3339_weak(&at).map_err(|e| {
                    format!("pause.json: resume_at must be an RFC 3339 time like 2026-12-03T10:00:00Z, got {at:?} ({e})")
                })?;
                at.duration_since(now).unwrap_or_default()
            }
            (Some(_), Some(_)) => {
                return Err(
                    "pause.json: give retry_after_seconds or resume_at, not both".to_string(),
                )
            }
            (None, None) => {
                return Err("pause.json: give retry_after_seconds or resume_at".to_string())
            }
        };
        Ok(PauseRequest::after(
            file.reason.as_deref().unwrap_or_default(),
            after,
            now,
        ))
    }

    /// A pause of `after` from `now` (at most [`MAX_PROFILE_PAUSE`]), for `reason`.
    pub fn after(reason: &str, after: Duration, now: SystemTime) -> PauseRequest {
        let after = after.min(MAX_PROFILE_PAUSE);
        // Rounded up to the second: the pause never ends before the time asked for.
        let until = now + after + Duration::from_millis(999);
        let reason = printable(reason, MAX_REASON_CHARS);
        PauseRequest {
            reason: if reason.is_empty() {
                "paused".to_string()
            } else {
                reason
            },
            until: crate::format_timestamp(until),
        }
    }
}

/// A profile's pause, as workers share it: no worker starts a stage of `profile` before
/// `until`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfilePause {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The agent profile's name.
    pub profile: String,
    /// The end of the pause, RFC 3339 UTC.
    pub until: String,
    /// Why, from the stage's `pause.json`.
    pub reason: String,
    /// The run whose stage paused.
    pub run_id: uuid::Uuid,
}

impl ProfilePause {
    /// When the pause ends; `None` for a time that does not parse.
    pub fn ends(&self) -> Option<SystemTime> {
        parse_time(&self.until)
    }

    /// Checks a pause read from the broker: a known profile name shape, a parsable time at
    /// most a day ahead of `now`, a short reason.
    pub fn check(&self, now: SystemTime) -> Result<(), String> {
        if !crate::names::is_profile_name(&self.profile) {
            return Err(format!("profile {:?} is not a profile name", self.profile));
        }
        let ends = self
            .ends()
            .ok_or_else(|| format!("until {:?} is not an RFC 3339 time", self.until))?;
        if ends > now + MAX_PROFILE_PAUSE + Duration::from_secs(60) {
            return Err(format!("until {} is more than a day ahead", self.until));
        }
        if self.reason.chars().count() > MAX_REASON_CHARS {
            return Err("reason is longer than 200 characters".to_string());
        }
        Ok(())
    }
}

/// Parses an RFC 3339 time.
pub fn parse_time(text: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(text).ok()
}

/// How the reason of a run's `queued` state begins while it waits for its profile's cap.
pub const WAITING_REASON: &str = "waiting for agent profile";

/// The reason a run waiting for `profile`'s cap of `max` carries.
pub fn waiting_reason(profile: &str, max: u32) -> String {
    format!(
        "{WAITING_REASON} `{profile}`: {max} of its stages already run across the pool (max_concurrent); the run holds no slot meanwhile"
    )
}

/// The profile a run waits for, read from its state's reason.
pub fn waiting_profile(reason: &str) -> Option<&str> {
    let rest = reason.strip_prefix(WAITING_REASON)?.strip_prefix(" `")?;
    rest.split_once('`').map(|(name, _)| name)
}

/// `text` with control characters dropped, cut to `limit` characters.
fn printable(text: &str, limit: usize) -> String {
    text.chars()
        .filter(|c| !c.is_control())
        .take(limit)
        .collect::<String>()
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::UNIX_EPOCH;

    /// Catches: usage.json fields summed wrongly, a negative or infinite cost taken, a model
    /// name with control characters kept.
    #[test]
    fn usage_is_checked_and_summed() {
        let one = Usage::parse(
            br#"{"input_tokens": 1000, "output_tokens": 200, "cache_read_tokens": 50, "cost_usd": 0.25, "model": "m-1\u001b[31m"}"#,
        )
        .unwrap();
        assert_eq!(one.model.as_deref(), Some("m-1[31m"));
        let two =
            Usage::parse(br#"{"output_tokens": 5, "cost_usd": 0.5, "model": "m-2"}"#).unwrap();
        let mut totals = UsageTotals::default();
        totals.add(&one);
        totals.add(&two);
        totals.add(&one);
        assert_eq!(totals.input_tokens, 2000);
        assert_eq!(totals.output_tokens, 405);
        assert_eq!(totals.cache_read_tokens, 100);
        assert_eq!(totals.stages, 3);
        assert!((totals.cost_usd - 1.0).abs() < 1e-9);
        assert_eq!(totals.models, ["m-1[31m", "m-2"]);
        for bad in [
            &br#"{"cost_usd": -1}"#[..],
            br#"{"input_tokens": -5}"#,
            br#"{"cost_usd": 1e300}"#,
            br#"[1]"#,
        ] {
            let error = Usage::parse(bad).unwrap_err();
            assert!(error.starts_with("usage.json"), "{error}");
        }
    }

    /// Catches: a pause that ends before the time asked, an untrusted pause of years, a
    /// resume_at in the past taken for a long pause.
    #[test]
    fn pause_files_give_a_bounded_end() {
        let now = UNIX_EPOCH + Duration::from_secs(1_780_000_000);
        let pause = PauseRequest::parse(
            br#"{"reason": "rate_limit", "retry_after_seconds": 5}"#,
            now,
        )
        .unwrap();
        let ends = parse_time(&pause.until).unwrap();
        assert!(ends >= now + Duration::from_secs(5) && ends <= now + Duration::from_secs(6));
        assert_eq!(pause.reason, "rate_limit");
        let years = PauseRequest::parse(br#"{"retry_after_seconds": 1e12}"#, now).unwrap();
        assert!(
            parse_time(&years.until).unwrap() <= now + MAX_PROFILE_PAUSE + Duration::from_secs(1)
        );
        let at = PauseRequest::parse(br#"{"resume_at": "2026-05-28T21:00:00Z"}"#, now).unwrap();
        assert_eq!(at.until, "2026-05-28T21:00:00Z");
        let past = PauseRequest::parse(br#"{"resume_at": "2000-01-01T00:00:00Z"}"#, now).unwrap();
        assert!(parse_time(&past.until).unwrap() <= now + Duration::from_secs(1));
        for bad in [
            &br#"{}"#[..],
            br#"{"retry_after_seconds": -1}"#,
            br#"{"resume_at": "tomorrow"}"#,
            br#"{"retry_after_seconds": 1, "resume_at": "2026-05-28T20:00:00Z"}"#,
            br#"{"retry_after": 5}"#,
        ] {
            let error = PauseRequest::parse(bad, now).unwrap_err();
            assert!(error.starts_with("pause.json"), "{error}");
        }
    }

    /// Catches: the API's `waiting_for_profile` not found in the reason the worker wrote.
    #[test]
    fn the_waiting_profile_is_read_back_from_the_reason() {
        let reason = waiting_reason("claude-fast", 2);
        assert_eq!(waiting_profile(&reason), Some("claude-fast"));
        assert_eq!(waiting_profile("accepted"), None);
    }
}
