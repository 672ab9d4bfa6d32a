//! Retention: what the store keeps of runs that ended. Two horizons, counted from a run's
//! last change: its heartbeat and log events (`FORGEPOOL_RETAIN_LOGS`, 7 days by default),
//! and the run itself with everything stored of it (`FORGEPOOL_RETAIN_RUNS`, kept for ever by
//! default). The dispatcher prunes once an hour; `forgepool prune` does it once, by hand.
//! Runs that have not ended are never touched.
//!
//! `keep_pruning` calls `RunStore::prune` once an hour.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::dispatcher::Dispatcher;
use crate::store::{Prune, Pruned, RunStore};

/// How often the dispatcher prunes.
pub const PRUNE_INTERVAL: Duration = Duration::from_secs(3600);
/// How long after start the dispatcher prunes first.
const FIRST_PRUNE: Duration = Duration::from_secs(60);
/// The shortest horizon for logs: webhooks read the events of runs that ended in the last hour.
pub const MIN_HORIZON: Duration = Duration::from_secs(3600);
/// The shortest horizon for runs: a submission key (`Idempotency-Key`, `message_id`) names its
/// run for 24 hours, and is deleted with it.
pub const MIN_RUN_HORIZON: Duration = Duration::from_secs(24 * 3600);

/// The dispatcher's retention policy; `None` keeps for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// How long heartbeat and log events of a run that ended are kept.
    pub logs: Option<Duration>,
    /// How long a run that ended is kept.
    pub runs: Option<Duration>,
}

impl Default for Retention {
    fn default() -> Retention {
        Retention {
            logs: Some(Duration::from_secs(7 * 24 * 3600)),
            runs: None,
        }
    }
}

impl Retention {
    /// The deletion this policy asks for at `now`.
    pub fn prune_at(&self, now: SystemTime) -> Prune {
        let before = |keep: Duration| {
            let cutoff = now.checked_sub(keep).unwrap_or(SystemTime::UNIX_EPOCH);
            proto::format_timestamp(cutoff)
        };
        Prune {
            chatter_before: self.logs.map(before),
            runs_before: self.runs.map(before),
        }
    }

    /// Whether the policy deletes nothing.
    pub fn keeps_everything(&self) -> bool {
        self.logs.is_none() && self.runs.is_none()
    }
}

/// Parses a horizon for the setting `name`: a duration such as `7d`, `36h` or `90days`, at
/// least an hour, or `never` (keep for ever).
pub fn parse_horizon(name: &str, value: &str) -> Result<Option<Duration>, String> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("never") {
        return Ok(None);
    }
    let horizon = humantime::parse_duration(value).map_err(|error| {
        format!("{name}: {value:?} is not a duration like 7d, 36h or 90days, nor `never`: {error}")
    })?;
    if horizon < MIN_HORIZON {
        return Err(format!(
            "{name}: {value:?} is under an hour; runs that ended are kept at least an hour (their webhooks are told within it)"
        ));
    }
    Ok(Some(horizon))
}

/// Parses how long runs are kept, as [`parse_horizon`], at least a day: a repeated submission
/// must find its first run for 24 hours.
pub fn parse_run_horizon(name: &str, value: &str) -> Result<Option<Duration>, String> {
    let horizon = parse_horizon(name, value)?;
    if horizon.is_some_and(|h| h < MIN_RUN_HORIZON) {
        return Err(format!(
            "{name}: {value:?} is under a day; a run is kept at least 24 hours, while a repeated submission (Idempotency-Key, message_id) must find it"
        ));
    }
    Ok(horizon)
}

/// Prunes the store once an hour (first a minute after start) until `shutdown`.
pub async fn keep_pruning(
    dispatcher: Arc<Dispatcher>,
    retention: Retention,
    shutdown: CancellationToken,
) {
    if retention.keeps_everything() {
        return;
    }
    let mut wait = FIRST_PRUNE;
    loop {
        tokio::select! {
            () = tokio::time::sleep(wait) => {},
            () = shutdown.cancelled() => return,
        }
        wait = PRUNE_INTERVAL;
        match dispatcher
            .store
            .prune(retention.prune_at(SystemTime::now()))
            .await
        {
            Ok(Pruned { chatter, runs }) if chatter + runs > 0 => {
                info!(events = chatter, runs, "retention: pruned the store");
            }
            Ok(_) => {}
            Err(error) => warn!(%error, "retention: pruning failed; trying again in an hour"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a horizon that accepts nonsense, keeps less than an hour (a run less than a day),
    /// or misreads `never`.
    #[test]
    fn horizons_are_durations_of_an_hour_or_more_or_never() {
        assert_eq!(
            parse_horizon("X", "7d").unwrap(),
            Some(Duration::from_secs(7 * 86_400))
        );
        assert_eq!(parse_horizon("X", "never").unwrap(), None);
        for bad in ["", "soon", "-3d", "10m"] {
            let error = parse_horizon("FORGEPOOL_RETAIN_LOGS", bad).unwrap_err();
            assert!(error.starts_with("FORGEPOOL_RETAIN_LOGS: "), "{error}");
        }
        // Runs outlive their submission keys' 24 hours.
        assert!(parse_horizon("X", "2h").is_ok());
        let error = parse_run_horizon("FORGEPOOL_RETAIN_RUNS", "2h").unwrap_err();
        assert!(error.contains("24 hours"), "{error}");
        assert_eq!(parse_run_horizon("X", "never").unwrap(), None);
    }

    /// Catches: cut-off times in another format than the store's (lexical comparison).
    #[test]
    fn cutoffs_are_rfc3339_in_utc() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(10 * 86_400);
        let prune = Retention {
            logs: Some(Duration::from_secs(86_400)),
            runs: Some(Duration::from_secs(2 * 86_400)),
        }
        .prune_at(now);
        assert_eq!(
            prune.chatter_before.as_deref(),
            Some("1970-01-10T00:00:00Z")
        );
        assert_eq!(prune.runs_before.as_deref(), Some("1970-01-09T00:00:00Z"));
        assert_eq!(Retention::default().prune_at(now).runs_before, None);
    }
}
