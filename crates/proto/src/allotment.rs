//! A profile's daily budget across the pool (SPEC 16): the dispatcher's store holds how much
//! of each profile's budget it has allotted today (UTC); each worker's gateway spends only
//! what it was allotted.
//!
//! A gateway that needs more asks the dispatcher ([`AllotmentQuery`] on
//! `{prefix}.allotments`); the dispatcher grants while its total is under the limit
//! ([`grant`]) and answers signed with the job key ([`AllotmentAnswer`]), as it answers
//! questions about executions. A grant is at least the request's worst case and at most a
//! sixteenth of the limit (or what remains), so the pool's total allotted (and so spent)
//! passes the limit by at most one request's reservation, however many workers race. A
//! gateway hands back what it did not spend when its last stage of the profile ends; an
//! allotment lost with a crashed worker is counted as spent (a crash can only make the day
//! stricter).

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{Budget, JobKey};

/// An amount of a budget: tokens of every kind, and US dollars.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spend {
    /// Tokens of every kind together.
    pub tokens: u64,
    /// US dollars.
    pub cost_usd: f64,
}

impl Spend {
    /// Whether it is nothing.
    pub fn is_zero(&self) -> bool {
        self.tokens == 0 && self.cost_usd <= 0.0
    }
}

/// A gateway's request to the dispatcher: allot `want` more of `profile`'s daily budget, and
/// take back `returned` (what it was allotted today and did not spend).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllotmentQuery {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The profile.
    pub profile: String,
    /// The day the gateway's allotment is for (UTC, `YYYY-MM-DD`); a hand-back for another
    /// day than the dispatcher's is ignored.
    pub day: String,
    /// How much more it needs: one request's worst case (nothing for a plain hand-back).
    pub want: Spend,
    /// What it hands back.
    pub returned: Spend,
    /// Drawn for this question; the answer repeats it.
    pub nonce: Uuid,
}

impl AllotmentQuery {
    /// Why the question cannot be answered: an amount of money that is negative or not a
    /// number (a negative hand-back would take spend away from nobody, a negative want would
    /// give budget back). `None` when it reads.
    pub fn refusal(&self) -> Option<String> {
        [("want", self.want), ("returned", self.returned)]
            .into_iter()
            .find(|(_, spend)| !(spend.cost_usd.is_finite() && spend.cost_usd >= 0.0))
            .map(|(field, spend)| {
                format!(
                    "the allotment question's {field}.cost_usd {} is not a non-negative amount",
                    spend.cost_usd
                )
            })
    }
}

/// The dispatcher's answer, signed with the job key over [`answer_signed_bytes`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllotmentAnswer {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The question's nonce.
    pub nonce: Uuid,
    /// The day the grant counts against (the dispatcher's UTC day).
    pub day: String,
    /// What was allotted (nothing when refused).
    pub granted: Spend,
    /// Why nothing was allotted: the day's budget is spent, or the profile has none.
    pub refused: Option<String>,
}

impl AllotmentAnswer {
    /// The answer's signature header value.
    pub fn sign(body: &[u8], key: &JobKey) -> String {
        key.sign(&answer_signed_bytes(body))
    }

    /// Reads an answer to `query`, checking its signature and its nonce.
    pub fn read(
        body: &[u8],
        signature: Option<&str>,
        key: &JobKey,
        query: &AllotmentQuery,
    ) -> Result<AllotmentAnswer, String> {
        key.verify(&answer_signed_bytes(body), signature)
            .map_err(|reason| {
                format!("an allotment answer not signed by the dispatcher: {reason}")
            })?;
        let answer: AllotmentAnswer = crate::decode_message(body, 16 * 1024)?;
        if answer.nonce != query.nonce {
            return Err("an allotment answer to another question".into());
        }
        Ok(answer)
    }
}

/// What an answer's signature covers: a domain tag, then the body (no signed job or
/// execution answer passes for one).
pub fn answer_signed_bytes(body: &[u8]) -> Vec<u8> {
    let mut bytes = b"forgepool-allotment-answer\n".to_vec();
    bytes.extend_from_slice(body);
    bytes
}

/// How many grants a day's budget is cut into, at least: a worker holds at most this share of
/// the day unspent.
pub const SHARES: u64 = 16;

/// What to allot `profile` when `total` is already allotted today against `limits`, for a
/// request of `want`: at least `want` and at most a [`SHARES`]th of the limit or what remains
/// (whichever is larger); refused when `want` does not fit in what remains of a limit (so
/// the pool never passes the day's budget). The error says which.
pub fn grant(profile: &str, limits: &Budget, total: Spend, want: Spend) -> Result<Spend, String> {
    if let Some(max) = limits.max_tokens {
        if total.tokens.saturating_add(want.tokens) > max {
            return Err(format!(
                "daily budget exhausted: the profile {profile} has been allotted {} of its {max} tokens today (agents.{profile}.daily_budget.max_tokens), and a request needs {} more",
                total.tokens, want.tokens
            ));
        }
    }
    if let Some(max) = limits.max_cost_usd {
        if total.cost_usd + want.cost_usd > max + 1e-12 {
            return Err(format!(
                "daily budget exhausted: the profile {profile} has been allotted ${:.4} of its ${max:.2} today (agents.{profile}.daily_budget.max_cost_usd), and a request needs ${:.4} more",
                total.cost_usd, want.cost_usd
            ));
        }
    }
    let tokens = match limits.max_tokens {
        Some(max) => want.tokens.max((max / SHARES).min(max - total.tokens)),
        None => want.tokens,
    };
    let cost_usd = match limits.max_cost_usd {
        Some(max) => want
            .cost_usd
            .max((max / SHARES as f64).min(max - total.cost_usd)),
        None => want.cost_usd,
    };
    Ok(Spend { tokens, cost_usd })
}

/// Takes `returned` back from a profile's `total` allotted today, then grants `want` (see
/// [`grant`]; nothing is asked for a plain hand-back). Returns the new total and the grant.
pub fn allot(
    profile: &str,
    limits: &Budget,
    total: Spend,
    want: Spend,
    returned: Spend,
) -> (Spend, Result<Spend, String>) {
    let mut total = Spend {
        tokens: total.tokens.saturating_sub(returned.tokens),
        cost_usd: (total.cost_usd - returned.cost_usd).max(0.0),
    };
    if want.is_zero() {
        return (total, Ok(Spend::default()));
    }
    let granted = grant(profile, limits, total, want);
    if let Ok(granted) = &granted {
        total.tokens += granted.tokens;
        total.cost_usd += granted.cost_usd;
    }
    (total, granted)
}

/// The UTC day of `time`, `YYYY-MM-DD`.
pub fn day_of(time: SystemTime) -> String {
    crate::format_timestamp(time)
        .get(..10)
        .unwrap_or_default()
        .to_string()
}

/// The first instant of the UTC day after `time`'s: when a spent daily budget is new again.
pub fn next_day(time: SystemTime) -> SystemTime {
    const DAY: u64 = 24 * 60 * 60;
    let seconds = time
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    SystemTime::UNIX_EPOCH + Duration::from_secs((seconds / DAY + 1) * DAY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a question whose negative hand-back would lower the day's total below what
    /// the pool spent, or whose negative want would give budget back.
    #[test]
    fn negative_amounts_are_refused() {
        let spend = |cost_usd: f64| Spend {
            tokens: 0,
            cost_usd,
        };
        let query = |want: f64, returned: f64| AllotmentQuery {
            schema_version: crate::SCHEMA_VERSION,
            profile: "claude".into(),
            day: "2026-12-06".into(),
            want: spend(want),
            returned: spend(returned),
            nonce: Uuid::new_v4(),
        };
        assert_eq!(query(0.5, 0.25).refusal(), None);
        assert!(query(-1.0, 0.0)
            .refusal()
            .unwrap()
            .contains("want.cost_usd"));
        assert!(query(0.0, -5.0)
            .refusal()
            .unwrap()
            .contains("returned.cost_usd"));
    }

    fn tokens(n: u64) -> Spend {
        Spend {
            tokens: n,
            cost_usd: 0.0,
        }
    }

    /// Catches: grants that let many workers together pass the day's limit (a grant of the
    /// whole remainder, a grant larger than what remains, or grants after the limit).
    #[test]
    fn grants_stop_at_the_limit_within_one_request() {
        let limits = Budget {
            max_cost_usd: None,
            max_tokens: Some(1600),
        };
        let mut total = Spend::default();
        let mut grants = 0;
        while let Ok(granted) = grant("p", &limits, total, tokens(30)) {
            assert!(granted.tokens >= 30, "a grant covers the request");
            total.tokens += granted.tokens;
            grants += 1;
            assert!(grants < 100, "grants never end");
        }
        assert_eq!(grants, 16, "a sixteenth at a time");
        assert_eq!(total.tokens, 1600);
        // Near the end, a request that fits in what remains gets it; a larger one nothing.
        let near = grant("p", &limits, tokens(1300), tokens(300)).unwrap();
        assert_eq!(near.tokens, 300);
        assert!(grant("p", &limits, tokens(1590), tokens(11)).is_err());
        let refused = grant("p", &limits, tokens(1600), tokens(1)).unwrap_err();
        assert!(
            refused.contains("agents.p.daily_budget.max_tokens"),
            "{refused}"
        );
    }

    #[test]
    fn days_are_utc_dates_and_the_next_starts_at_midnight() {
        let time = SystemTime::UNIX_EPOCH + Duration::from_secs(86_400 * 3 + 5_000);
        assert_eq!(day_of(time), "1970-01-04");
        assert_eq!(
            next_day(time),
            SystemTime::UNIX_EPOCH + Duration::from_secs(86_400 * 4)
        );
    }

    #[test]
    fn an_answer_reads_only_when_signed_for_this_question() {
        let key = JobKey::new("0123456789abcdef0123").unwrap();
        let query = AllotmentQuery {
            schema_version: crate::SCHEMA_VERSION,
            profile: "p".into(),
            day: "2026-12-06".into(),
            want: tokens(10),
            returned: Spend::default(),
            nonce: Uuid::new_v4(),
        };
        let answer = AllotmentAnswer {
            schema_version: crate::SCHEMA_VERSION,
            nonce: query.nonce,
            day: query.day.clone(),
            granted: tokens(100),
            refused: None,
        };
        let body = serde_json::to_vec(&answer).unwrap();
        let signature = AllotmentAnswer::sign(&body, &key);
        assert_eq!(
            AllotmentAnswer::read(&body, Some(&signature), &key, &query).unwrap(),
            answer
        );
        let execution = crate::ExecutionAnswer::sign(&body, &key);
        assert!(AllotmentAnswer::read(&body, Some(&execution), &key, &query).is_err());
        let other = AllotmentQuery {
            nonce: Uuid::new_v4(),
            ..query
        };
        assert!(AllotmentAnswer::read(&body, Some(&signature), &key, &other).is_err());
    }
}
