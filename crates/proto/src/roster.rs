//! Which workers are alive, on which hosts: every worker process announces itself every
//! [`BEACON_INTERVAL`] on `{prefix}.roster` ([`WorkerBeacon`], signed with the job key), and
//! the dispatcher counts a worker alive while its last beacon is younger than [`ALIVE_FOR`].
//! `GET /v1/pool`, `forgepool status` and the run view show it ([`PoolHost`]).
//!
//! A beacon is signed because anyone with a broker account could otherwise fill the pool's
//! view with workers that do not exist, and dated inside the signature, so that a copy
//! replayed later does not keep a dead worker alive; it says nothing a job depends on.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::JobKey;

/// How often a worker announces itself.
pub const BEACON_INTERVAL: Duration = Duration::from_secs(10);

/// How long a worker counts as alive after its last beacon: three beacons missed.
pub const ALIVE_FOR: Duration = Duration::from_secs(35);

/// How far ahead of the dispatcher's clock a beacon's `sent_at` may be.
pub const CLOCK_SKEW: Duration = Duration::from_secs(60);

/// How long a beacon waits on the broker for the dispatcher (an older one says nothing).
pub const BEACON_TTL_MS: i64 = 30_000;

/// The most worker processes the dispatcher keeps in its roster; beacons of more are dropped.
pub const MAX_ROSTER: usize = 4096;

/// The largest beacon read.
pub const MAX_BEACON_BYTES: usize = 4096;

/// A worker process's announcement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerBeacon {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The worker's name (`--worker-id`).
    pub worker: String,
    /// This process's instance id (a restarted worker is a new instance).
    pub instance: String,
    /// The host name it runs on.
    pub host: String,
    /// Its run slots.
    pub slots: u32,
    /// Slots running a run now.
    pub busy: u32,
    /// Its forgepool version.
    pub version: String,
    /// When it was sent, in seconds since the Unix epoch.
    pub sent_at: u64,
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The longest worker name a beacon carries.
pub const MAX_WORKER_NAME: usize = 128;

/// Refuses a worker name (`--worker-id`, `FORGEPOOL_WORKER_ID`) that its beacons could not
/// carry: empty, longer than [`MAX_WORKER_NAME`], or with control characters.
pub fn check_worker_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_WORKER_NAME || name.chars().any(char::is_control) {
        return Err(format!(
            "FORGEPOOL_WORKER_ID (--worker-id): must be 1 to {MAX_WORKER_NAME} printable \
             characters, got {name:?}"
        ));
    }
    Ok(())
}

/// The domain every beacon signature covers, so that no other signed message passes for one.
const DOMAIN: &[u8] = b"forgepool-beacon\n";

fn signed_bytes(body: &[u8]) -> Vec<u8> {
    [DOMAIN, body].concat()
}

impl WorkerBeacon {
    /// The signature of a beacon's `body`.
    pub fn sign(body: &[u8], key: &JobKey) -> String {
        key.sign(&signed_bytes(body))
    }

    /// Reads a beacon received at `now` (Unix seconds): signed with the job key, well formed,
    /// every text short and printable, sent within [`ALIVE_FOR`] (and not more than
    /// [`CLOCK_SKEW`] ahead).
    pub fn read(
        body: &[u8],
        signature: Option<&str>,
        key: &JobKey,
        now: u64,
    ) -> Result<WorkerBeacon, String> {
        key.verify(&signed_bytes(body), signature)
            .map_err(|reason| format!("a worker beacon not signed with the job key: {reason}"))?;
        let beacon: WorkerBeacon = crate::decode_message(body, MAX_BEACON_BYTES)?;
        for (field, value, longest) in [
            ("worker", &beacon.worker, MAX_WORKER_NAME),
            ("instance", &beacon.instance, 64),
            ("host", &beacon.host, 253),
            ("version", &beacon.version, 64),
        ] {
            if value.is_empty() || value.len() > longest || value.chars().any(char::is_control) {
                return Err(format!(
                    "a worker beacon's {field} must be 1 to {longest} printable characters"
                ));
            }
        }
        if beacon.sent_at.saturating_add(ALIVE_FOR.as_secs()) < now
            || beacon.sent_at > now.saturating_add(CLOCK_SKEW.as_secs())
        {
            return Err(format!(
                "a worker beacon sent at {} is stale or from the future (now {now})",
                beacon.sent_at
            ));
        }
        if beacon.busy > beacon.slots {
            return Err(format!(
                "a worker beacon says {} of {} slots are busy",
                beacon.busy, beacon.slots
            ));
        }
        Ok(beacon)
    }
}

/// A host of the pool as the dispatcher last heard of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolHost {
    /// The host name its workers report.
    pub host: String,
    /// Its live worker processes, by name.
    pub workers: Vec<PoolWorker>,
}

/// A live worker process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolWorker {
    /// The worker's name.
    pub worker: String,
    /// The process's instance id.
    pub instance: String,
    /// Its run slots.
    pub slots: u32,
    /// Slots running a run.
    pub busy: u32,
    /// Its forgepool version.
    pub version: String,
    /// Seconds since its last beacon.
    pub seen_seconds_ago: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> JobKey {
        JobKey::new("0123456789abcdef0123456789abcdef").unwrap()
    }

    fn beacon() -> WorkerBeacon {
        WorkerBeacon {
            schema_version: crate::SCHEMA_VERSION,
            worker: "w1".into(),
            instance: "5f0c".into(),
            host: "fph1".into(),
            slots: 4,
            busy: 1,
            version: "0.1.0".into(),
            sent_at: NOW,
        }
    }

    const NOW: u64 = 1_800_000_000;

    /// Catches: a beacon taken without the job key's signature (anyone with a broker account
    /// could invent workers), or with a signature of another kind of signed message.
    #[test]
    fn only_a_beacon_signed_as_a_beacon_is_read() {
        let body = serde_json::to_vec(&beacon()).unwrap();
        let signature = WorkerBeacon::sign(&body, &key());
        assert_eq!(
            WorkerBeacon::read(&body, Some(&signature), &key(), NOW).unwrap(),
            beacon()
        );
        assert!(WorkerBeacon::read(&body, None, &key(), NOW).is_err());
        let other = JobKey::new("fedcba9876543210fedcba9876543210").unwrap();
        assert!(
            WorkerBeacon::read(&body, Some(&WorkerBeacon::sign(&body, &other)), &key(), NOW)
                .is_err()
        );
        assert!(WorkerBeacon::read(&body, Some(&key().sign(&body)), &key(), NOW).is_err());
    }

    /// Catches: a signed beacon whose texts could break a terminal or a page (control
    /// characters), grow the dispatcher's memory, or whose counts contradict each other.
    #[test]
    fn a_beacon_with_unusable_fields_is_refused_naming_the_field() {
        let read = |beacon: WorkerBeacon| {
            let body = serde_json::to_vec(&beacon).unwrap();
            WorkerBeacon::read(&body, Some(&WorkerBeacon::sign(&body, &key())), &key(), NOW)
        };
        let error = read(WorkerBeacon {
            host: "a\u{1b}[2Jb".into(),
            ..beacon()
        })
        .unwrap_err();
        assert!(error.contains("host"), "{error}");
        let error = read(WorkerBeacon {
            worker: "w".repeat(129),
            ..beacon()
        })
        .unwrap_err();
        assert!(error.contains("worker"), "{error}");
        let error = read(WorkerBeacon {
            busy: 5,
            ..beacon()
        })
        .unwrap_err();
        assert!(error.contains("5 of 4"), "{error}");
    }

    /// Catches: a worker started under a name its beacons cannot carry, which would never
    /// appear in the pool view (every beacon refused) instead of failing at start.
    #[test]
    fn a_worker_name_beacons_cannot_carry_is_refused_at_start() {
        assert!(check_worker_name("w-1").is_ok());
        for bad in ["", "a\nb", &"w".repeat(MAX_WORKER_NAME + 1)] {
            let error = check_worker_name(bad).unwrap_err();
            assert!(error.contains("FORGEPOOL_WORKER_ID"), "{error}");
        }
    }

    /// Catches: a signed beacon replayed after its worker died keeping it in the pool view
    /// for ever, and a clock a little ahead refused.
    #[test]
    fn a_stale_beacon_is_refused() {
        let body = serde_json::to_vec(&beacon()).unwrap();
        let signature = WorkerBeacon::sign(&body, &key());
        let read = |now| WorkerBeacon::read(&body, Some(&signature), &key(), now);
        assert!(read(NOW + ALIVE_FOR.as_secs()).is_ok());
        let error = read(NOW + ALIVE_FOR.as_secs() + 1).unwrap_err();
        assert!(error.contains("stale"), "{error}");
        assert!(read(NOW - 30).is_ok());
        assert!(read(NOW - CLOCK_SKEW.as_secs() - 1).is_err());
    }
}
