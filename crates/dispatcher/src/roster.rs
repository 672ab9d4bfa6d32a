//! The pool's roster: the worker processes that announced themselves (`proto::roster`, on a
//! queue of this dispatcher's own bound to the control exchange) within [`ALIVE_FOR`], grouped by host for `GET /v1/pool`. Bounded: at most
//! [`MAX_ROSTER`] processes are kept, and one that stops announcing itself is forgotten.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

use proto::amqp::{self, Delivery};
use proto::roster::{PoolHost, PoolWorker, WorkerBeacon, ALIVE_FOR, MAX_ROSTER};
use tracing::{debug, warn};

/// The live worker processes, by instance id.
#[derive(Debug, Default)]
pub struct Roster {
    seen: Mutex<HashMap<String, (WorkerBeacon, Instant)>>,
}

impl Roster {
    /// Records `beacon`, heard at `now` and sent `age` before (its signed `sent_at`): it is
    /// dated when it was sent, so a replayed beacon keeps a stopped worker listed no longer
    /// than its original would, and an older beacon never dates a process later than a newer
    /// one did. A new process is left out once [`MAX_ROSTER`] are alive; returns whether it
    /// was recorded.
    pub fn record(&self, beacon: WorkerBeacon, now: Instant, age: std::time::Duration) -> bool {
        let sent = now.checked_sub(age).unwrap_or(now);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen
            .get(&beacon.instance)
            .is_some_and(|(_, known)| *known >= sent)
        {
            return true;
        }
        if !seen.contains_key(&beacon.instance) && seen.len() >= MAX_ROSTER {
            seen.retain(|_, (_, at)| now.saturating_duration_since(*at) < ALIVE_FOR);
            if seen.len() >= MAX_ROSTER {
                return false;
            }
        }
        seen.insert(beacon.instance.clone(), (beacon, sent));
        true
    }

    /// The hosts of the processes heard within [`ALIVE_FOR`] of `now`, by host name, each
    /// with its workers by name; the others are forgotten.
    pub fn hosts(&self, now: Instant) -> Vec<PoolHost> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.retain(|_, (_, at)| now.saturating_duration_since(*at) < ALIVE_FOR);
        let mut hosts: BTreeMap<&str, Vec<PoolWorker>> = BTreeMap::new();
        for (beacon, at) in seen.values() {
            hosts.entry(&beacon.host).or_default().push(PoolWorker {
                worker: beacon.worker.clone(),
                instance: beacon.instance.clone(),
                slots: beacon.slots,
                busy: beacon.busy,
                version: beacon.version.clone(),
                seen_seconds_ago: now.saturating_duration_since(*at).as_secs(),
            });
        }
        hosts
            .into_iter()
            .map(|(host, mut workers)| {
                workers.sort_by(|a, b| (&a.worker, &a.instance).cmp(&(&b.worker, &b.instance)));
                PoolHost {
                    host: host.to_string(),
                    workers,
                }
            })
            .collect()
    }
}

/// Takes a worker's beacon into the roster; an unsigned or malformed one is dropped with a
/// warning (a beacon is never retried: the next one comes within seconds).
pub(crate) fn take_beacon(roster: &Roster, key: &proto::JobKey, delivery: &Delivery) {
    let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
    let now = proto::roster::unix_now();
    match WorkerBeacon::read(&delivery.data, signature.as_deref(), key, now) {
        Ok(beacon) => {
            let (worker, host) = (beacon.worker.clone(), beacon.host.clone());
            let age = std::time::Duration::from_secs(now.saturating_sub(beacon.sent_at));
            if !roster.record(beacon, Instant::now(), age) {
                debug!(%worker, %host, "the roster is full; a worker is left out");
            }
        }
        Err(reason) => warn!(%reason, "ignoring a worker beacon"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn beacon(worker: &str, instance: &str, host: &str) -> WorkerBeacon {
        WorkerBeacon {
            schema_version: proto::SCHEMA_VERSION,
            worker: worker.into(),
            instance: instance.into(),
            host: host.into(),
            slots: 2,
            busy: 1,
            version: "0.1.0".into(),
            sent_at: 0,
        }
    }

    /// Catches: workers shown under the wrong host, a restarted worker's old instance shown as
    /// alive beside the new one after it stopped announcing itself, and a worker heard again
    /// counted twice.
    #[test]
    fn hosts_list_the_processes_heard_lately_by_host() {
        let roster = Roster::default();
        let start = Instant::now();
        assert!(roster.record(beacon("a", "1", "h2"), start, Duration::ZERO));
        assert!(roster.record(beacon("b", "2", "h1"), start, Duration::ZERO));
        assert!(roster.record(beacon("c", "3", "h1"), start, Duration::ZERO));
        let later = start + Duration::from_secs(20);
        assert!(roster.record(beacon("a", "1", "h2"), later, Duration::ZERO));
        let hosts = roster.hosts(later);
        let names: Vec<(&str, Vec<&str>)> = hosts
            .iter()
            .map(|h| {
                (
                    h.host.as_str(),
                    h.workers.iter().map(|w| w.worker.as_str()).collect(),
                )
            })
            .collect();
        assert_eq!(names, [("h1", vec!["b", "c"]), ("h2", vec!["a"])]);
        assert_eq!(hosts[0].workers[0].seen_seconds_ago, 20);
        // b and c fall silent; a goes on.
        let gone = start + ALIVE_FOR + Duration::from_secs(1);
        let hosts = roster.hosts(gone);
        assert_eq!(hosts.len(), 1, "{hosts:?}");
        assert_eq!(hosts[0].host, "h2");
        assert_eq!(hosts[0].workers[0].seen_seconds_ago, 16);
    }

    /// Catches: a beacon dated when it arrived, not when it was signed (a replay kept a
    /// stopped worker listed 67 s after it stopped), or an old beacon that dates a process
    /// later than its newest did.
    #[test]
    fn a_beacon_is_dated_when_it_was_sent() {
        let roster = Roster::default();
        let start = Instant::now() + Duration::from_secs(100);
        assert!(roster.record(beacon("a", "1", "h"), start, Duration::ZERO));
        // The worker stops; its last beacon is replayed 30 s later.
        let replay = start + Duration::from_secs(30);
        assert!(roster.record(beacon("a", "1", "h"), replay, Duration::from_secs(30)));
        let gone = start + ALIVE_FOR + Duration::from_secs(1);
        assert!(roster.hosts(gone).is_empty(), "the replay kept it alive");
        // A beacon older than the newest one heard changes nothing.
        assert!(roster.record(beacon("b", "2", "h"), start, Duration::ZERO));
        assert!(roster.record(beacon("b", "2", "h"), start, Duration::from_secs(20)));
        assert_eq!(roster.hosts(start)[0].workers[0].seen_seconds_ago, 0);
    }

    /// Catches: a roster that grows with every beacon an attacker with the key could send
    /// (memory bounded), and one that, once full, cannot take a worker in after others left.
    #[test]
    fn the_roster_is_bounded_and_makes_room_when_workers_leave() {
        let roster = Roster::default();
        let start = Instant::now();
        for n in 0..MAX_ROSTER {
            assert!(roster.record(beacon("w", &n.to_string(), "h"), start, Duration::ZERO));
        }
        assert!(!roster.record(
            beacon("w", "new", "h"),
            start + Duration::from_secs(1),
            Duration::ZERO
        ));
        // A known one is still heard.
        assert!(roster.record(
            beacon("w", "0", "h"),
            start + Duration::from_secs(10),
            Duration::ZERO
        ));
        assert!(roster.record(
            beacon("w", "new", "h"),
            start + ALIVE_FOR + Duration::from_secs(1),
            Duration::ZERO
        ));
        let alive: usize = roster
            .hosts(start + ALIVE_FOR + Duration::from_secs(1))
            .iter()
            .map(|h| h.workers.len())
            .sum();
        assert_eq!(alive, 2);
    }
}
