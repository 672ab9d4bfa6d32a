//! The wire: every type that crosses a process boundary in forgepool.
//!
//! A run request enters the dispatcher (HTTP, CLI file, AMQP), becomes a frozen [`Job`] that
//! travels to a worker, and the worker answers with [`Event`]s that the dispatcher stores and
//! streams. Only the types in this crate are serialized; each message carries
//! [`SCHEMA_VERSION`] so that a reader can refuse what it does not understand.
//!
//! What is here: [`RunRequest`] (what a submitter sends), [`Job`] (the frozen job, secret *names*
//! only), [`Event`] and its kinds, [`Checkpoint`] and `ReviewReceipt` (`checkpoint`), `Control`,
//! [`RunState`] with its CLI exit codes and its transition rule, `Publication`, the execution and
//! allotment questions with their signed answers (`execution`, `allotment`), workers' beacons and
//! the pool by host (`roster`), usage and pauses (`usage`), agent kinds and transcripts (`agent`),
//! and the name rules (`names`). Each type has a round-trip test; nothing here does I/O.

mod agent;
pub mod allotment;
#[cfg(feature = "amqp")]
pub mod amqp;
mod api;
mod checkpoint;
mod event;
mod execution;
mod job;
pub mod names;
mod request;
pub mod roster;
pub mod signing;
mod state;
mod usage;

pub use agent::{
    AgentKind, Transcript, TranscriptEntry, MAX_ENTRY_CHARS, MAX_TRANSCRIPT_BYTES,
    MAX_TRANSCRIPT_ENTRIES,
};
pub use api::{
    CancelAnswer, CancelProgress, Control, ControlAction, PoolView, PositionedEvent, Problem,
    Readiness, ResumeAnswer, RunList, RunSummary, RunTimeline, RunView, StageTranscript,
    StateChange, SubmitResponse, PROBLEM_CONTENT_TYPE, TIMELINE_EVENTS,
};
pub use checkpoint::{
    Checkpoint, FailureSignature, FinalReport, Finding, Limits, LoopState, MachineState, Phase,
    Progress, ReviewReceipt, RoundReason,
};
pub use event::{
    cut_change, latest_checkpoint, resumed_event, CheckResult, CycleOrigin, CycleRecord, Event,
    EventKind, LogStream, RoundRecord, RunResult, Stage, StageOutcome, AUTO_RESUMED_REASON,
    MAX_CHANGE_BYTES, MAX_CHECKPOINT_PATCH_BYTES, RESUMED_REASON,
};
pub use execution::{
    answer_signed_bytes, ExecutionAnswer, ExecutionQuery, Publication, MAX_LOST_EXECUTIONS,
};
pub use job::{
    check_egress_entry, AgentProfile, FollowUp, Job, Network, ReviewConfig, DEFAULT_DISK_BYTES,
    MAX_PAUSE_SECONDS,
};
pub use request::{AgentChoice, Assurance, RepositoryRef, RunRequest, VerifyCommand};
pub use signing::{JobKey, SIGNATURE_HEADER};
pub use state::RunState;
pub use usage::{
    parse_time, waiting_profile, waiting_reason, Budget, PauseRequest, ProfilePause, Usage,
    UsageTotals, MAX_PROFILE_PAUSE, WAITING_REASON,
};

/// The largest job message a worker reads: 4 MiB (a resumed job with its checkpoint must fit).
pub const MAX_JOB_BYTES: usize = 4 * 1024 * 1024;

/// The version of every message schema in this crate. Bumped on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// Decodes a message read from a queue: refuses one over `max_bytes`, malformed JSON, and a
/// missing or unknown `schema_version` before the shape is checked. The error is the reason a
/// dead letter carries.
pub fn decode_message<T: serde::de::DeserializeOwned>(
    data: &[u8],
    max_bytes: usize,
) -> Result<T, String> {
    if data.len() > max_bytes {
        return Err(format!(
            "oversized message: {} bytes, over the limit of {max_bytes}",
            data.len()
        ));
    }
    let value: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| format!("malformed JSON: {e}"))?;
    match value
        .get("schema_version")
        .and_then(serde_json::Value::as_u64)
    {
        Some(version) if version == u64::from(SCHEMA_VERSION) => {}
        Some(version) => {
            return Err(format!(
            "unknown schema_version {version}; this version of forgepool reads {SCHEMA_VERSION}"
        ))
        }
        None => {
            return Err(format!(
                "schema_version is missing; it must be {SCHEMA_VERSION}"
            ))
        }
    }
    serde_json::from_value(value).map_err(|e| format!("not a valid message: {e}"))
}

/// The current time as an RFC 3339 UTC timestamp with second precision (`2024-01-15T10:30:00Z`).
pub fn timestamp_now() -> String {
    format_timestamp(std::time::SystemTime::now())
}

/// Formats a time as an RFC 3339 UTC timestamp with second precision.
pub fn format_timestamp(time: std::time::SystemTime) -> String {
    let seconds = time
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = seconds / 86_400;
    let rem = seconds % 86_400;
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Converts days since 1970-01-01 to a (year, month, day) civil date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn timestamps_are_rfc3339_utc() {
        let t = UNIX_EPOCH + Duration::from_secs(1_705_314_600);
        assert_eq!(format_timestamp(t), "2024-01-15T10:30:00Z");
        assert_eq!(format_timestamp(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(format_timestamp(leap), "2000-02-29T00:00:00Z");
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn any_bytes_decode_or_give_a_reason(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            match decode_message::<Job>(&bytes, 1024) {
                Ok(job) => prop_assert!(bytes.len() <= 1024 && job.schema_version == SCHEMA_VERSION),
                Err(reason) => prop_assert!(!reason.is_empty()),
            }
        }

        #[test]
        fn json_with_any_version_is_refused_unless_current(version in any::<u32>(), run in "[a-z0-9-]{0,40}") {
            let text = format!(r#"{{"schema_version": {version}, "run_id": "{run}"}}"#);
            let decoded = decode_message::<Job>(text.as_bytes(), 4096);
            prop_assert!(decoded.is_err());
            if version != SCHEMA_VERSION {
                prop_assert!(decoded.unwrap_err().contains("schema_version"));
            }
        }
    }
}
