//! When a provider's rate limit ends, read from its answer's headers: `retry-after` (seconds
//! or an RFC 3339 time), Anthropic's `anthropic-ratelimit-*-reset` (RFC 3339 times), OpenAI's
//! `x-ratelimit-reset-*` (Go durations such as `6m0s` or `20ms`).

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// The wait when an answer names none.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(300);
/// The longest wait taken from a header: a day.
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// Whether an answer's status is a rate limit or an overload that pauses the profile: 429,
/// and Anthropic's 529. A slow answer, or a 500, is not.
pub fn pauses(status: u16) -> bool {
    status == 429 || status == 529
}

/// The time the provider said its limit ends, from `now`; `retry-after` wins, else the
/// latest reset named; the default wait when none is. Bounded to a second and a day.
pub fn reset_time(headers: &HeaderMap, now: SystemTime) -> (SystemTime, bool) {
    let text = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let at = |wait: Duration| now + wait.clamp(Duration::from_secs(1), MAX_WAIT);
    if let Some(value) = text("retry-after") {
        if let Some(wait) = seconds(value) {
            return (at(wait), true);
        }
        if let Ok(time) = humantime::parse_rfc3339_weak(value) {
            return (at(time.duration_since(now).unwrap_or_default()), true);
        }
    }
    let mut latest: Option<Duration> = None;
    for (name, value) in headers {
        let name = name.as_str();
        let Ok(value) = value.to_str() else { continue };
        let wait = if name.starts_with("anthropic-ratelimit-") && name.ends_with("-reset") {
            humantime::parse_rfc3339_weak(value.trim())
                .ok()
                .map(|t| t.duration_since(now).unwrap_or_default())
        } else if name.starts_with("x-ratelimit-reset-") {
            go_duration(value.trim())
        } else {
            None
        };
        if let Some(wait) = wait {
            latest = Some(latest.map_or(wait, |l| l.max(wait)));
        }
    }
    match latest {
        Some(wait) => (at(wait), true),
        None => (now + DEFAULT_WAIT, false),
    }
}

fn seconds(value: &str) -> Option<Duration> {
    let number: f64 = value.parse().ok()?;
    (number.is_finite() && number >= 0.0).then(|| Duration::from_secs_f64(number.min(1e7)))
}

/// `1h2m3.5s`, `6m0s`, `20ms`, `1.5s`.
fn go_duration(text: &str) -> Option<Duration> {
    if text.is_empty() || text.len() > 40 {
        return None;
    }
    let mut total = 0.0;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let factor = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += number * factor;
        rest = &rest[unit_end..];
    }
    (total.is_finite()).then(|| Duration::from_secs_f64(total.min(1e7)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    /// Catches: a reset header ignored (the profile would pause for the default five minutes,
    /// or retry at once into more 429s), or an absurd one taken as it is.
    #[test]
    fn each_providers_reset_is_read() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let wait = |pairs: &[(&str, &str)]| {
            let (until, named) = reset_time(&headers(pairs), now);
            (until.duration_since(now).unwrap().as_secs_f64(), named)
        };
        assert_eq!(wait(&[("retry-after", "5")]), (5.0, true));
        assert_eq!(wait(&[("retry-after", "0")]), (1.0, true));
        assert_eq!(wait(&[("retry-after", "99999999")]), (86400.0, true));
        assert_eq!(
            wait(&[("anthropic-ratelimit-tokens-reset", "2027-01-15T08:00:30Z")]),
            (30.0, true)
        );
        assert_eq!(
            wait(&[
                ("x-ratelimit-reset-requests", "1m30s"),
                ("x-ratelimit-reset-tokens", "20ms")
            ]),
            (90.0, true)
        );
        assert_eq!(wait(&[]), (300.0, false));
        assert!(pauses(429) && pauses(529) && !pauses(500) && !pauses(503));
    }
}
