//! Benchmark: how many run events the control plane stores per second, and how long an event
//! takes from a worker's publish to a watcher's stream (issue 35, the first curve).
//!
//! A real dispatcher (one or two replicas) on a fresh PostgreSQL database and the shared
//! RabbitMQ; `RUNS` runs submitted through the API (no worker takes them); then, for each
//! offered rate, `EVENTS` events per run published to the events exchange as workers publish
//! them (the real message, routing key and mix: the run's start under a new execution, stage
//! starts and ends, output chunks, a cycle file, usage), interleaved across runs and paced.
//! Measured: the stored events per second (from the first publish until the store holds
//! them all) against the offered rate, and, on `WATCHERS` runs followed over Server-Sent
//! Events on the first replica, the time from each output chunk's publish to its arrival.
//!
//! Run: `scripts/services.sh && cargo bench --bench events_ingest`
//! (`RUNS=200 EVENTS=40 OFFERED=1000,2000,4000,8000 REPLICAS=1,2 WATCHERS=20`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cluster::{Cluster, Options, AMQP_URL};
use common::postgres::TestDatabase;
use common::Fixture;
use futures_util::StreamExt;
use proto::amqp::{Publisher, Topology};
use proto::{Event, EventKind, LogStream, RunState, Stage, StageOutcome};
use uuid::Uuid;

fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn list(name: &str, default: &str) -> Vec<u64> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

fn now_micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros()
}

/// The `k`-th of `events` events of a run in one pass (`pass` keeps event ids new).
fn event(run_id: Uuid, execution: Uuid, k: u64, events: u64) -> Event {
    let kind = match k {
        0 => EventKind::State {
            state: RunState::Running,
            reason: "bench".into(),
        },
        1 => EventKind::StageStarted {
            stage: Stage::Implement,
            round: 1,
            cycle: None,
        },
        k if k == events - 2 => EventKind::Cycle {
            cycle: serde_json::from_value(serde_json::json!({
                "step": "implement_task", "file": format!("review_cycle_{k}.json"), "cycle": 1,
                "max_cycles": 3, "verdict": "approved", "feedback": "fine", "content": {}
            }))
            .expect("a cycle record"),
        },
        k if k == events - 1 => EventKind::StageFinished {
            stage: Stage::Implement,
            round: 1,
            cycle: None,
            exit_code: Some(0),
            duration_seconds: 1.0,
            outcome: StageOutcome::Completed,
            usage: None,
        },
        _ => EventKind::Log {
            stage: Stage::Implement,
            stream: LogStream::Stdout,
            text: format!(
                "t={} some output of the agent, as a chunk of a line\n",
                now_micros()
            ),
        },
    };
    let mut event = Event::new(run_id, kind);
    event.execution = Some(execution);
    event
}

async fn stored(client: &tokio_postgres::Client) -> u64 {
    let row = client
        .query_one("SELECT count(*) FROM events", &[])
        .await
        .expect("count the events");
    row.get::<_, i64>(0) as u64
}

/// Follows `run_id`'s events; each output chunk's latency (µs) goes to `latencies`.
fn watch(url: String, run_id: String, latencies: Arc<Mutex<Vec<u128>>>) {
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        let Ok(response) = client
            .get(format!("{url}/v1/runs/{run_id}/events"))
            .send()
            .await
        else {
            return;
        };
        let mut body = response.bytes_stream();
        let mut buffer = String::new();
        while let Some(Ok(chunk)) = body.next().await {
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buffer.find('\n') {
                let line: String = buffer.drain(..=end).collect();
                if let Some(at) = line.find("t=") {
                    let digits: String = line[at + 2..]
                        .chars()
                        .take_while(char::is_ascii_digit)
                        .collect();
                    if let Ok(sent) = digits.parse::<u128>() {
                        latencies
                            .lock()
                            .unwrap()
                            .push(now_micros().saturating_sub(sent));
                    }
                }
            }
        }
    });
}

/// CPU seconds (user and system) the processes whose command name is `name` have used.
fn cpu_of(name: &str) -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let mut total = 0.0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if &stat[open + 1..close] != name {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        let used: f64 = fields
            .get(11..13)
            .into_iter()
            .flatten()
            .filter_map(|f| f.parse::<f64>().ok())
            .sum();
        total += used / ticks;
    }
    total
}

/// CPU seconds used so far by the dispatchers, PostgreSQL and RabbitMQ.
fn cpu_now() -> [f64; 3] {
    [cpu_of("forgepool"), cpu_of("postgres"), cpu_of("beam.smp")]
}

fn percentile(sorted: &[u128], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at] as f64 / 1000.0
}

#[tokio::main]
async fn main() {
    let runs: u64 = setting("RUNS", 200);
    let events: u64 = setting("EVENTS", 40).max(5);
    let watchers: usize = setting("WATCHERS", 20);
    let offered = list("OFFERED", "1000,2000,4000,8000");
    let replicas = list("REPLICAS", "1,2");
    println!("runs {runs}, {events} events per run and pass, {watchers} watched");
    println!("| replicas | offered events/s | sent events/s | stored events/s | watcher p50 ms | watcher p99 ms | CPU ms per 1,000 events: dispatchers / PostgreSQL / RabbitMQ |");
    println!("|---|---|---|---|---|---|---|");
    for &count in &replicas {
        let database = TestDatabase::create().await;
        let fixture = Fixture::new(None, &["change"], &["approve"]);
        let options = Options {
            database: Some(database.url.clone()),
            ..Options::default()
        };
        let cluster = Cluster::start_with(fixture, 0, 1, None, options).await;
        let mut others: Vec<_> = (1..count)
            .map(|i| cluster.spawn_dispatcher(&format!("dispatcher-{i}.log")))
            .collect();
        let mut ids = Vec::new();
        for i in 0..runs {
            ids.push(
                Uuid::parse_str(&cluster.submit(&format!("ING-{i}")).await).expect("a run id"),
            );
        }
        let (client, connection) = tokio_postgres::connect(&database.url, tokio_postgres::NoTls)
            .await
            .expect("PostgreSQL");
        tokio::spawn(connection);
        let latencies = Arc::new(Mutex::new(Vec::new()));
        for id in ids.iter().take(watchers) {
            watch(cluster.url(), id.to_string(), Arc::clone(&latencies));
        }
        let publisher = Publisher::new(AMQP_URL, "bench-events").expect("a publisher");
        let topology = Topology::new(&cluster.prefix);
        let exchange = topology.events();
        for &rate in &offered {
            latencies.lock().unwrap().clear();
            let base = stored(&client).await;
            let cpu_before = cpu_now();
            let total = runs * events;
            let began = Instant::now();
            let executions: Vec<Uuid> = ids.iter().map(|_| Uuid::new_v4()).collect();
            // Paced in 10 ms ticks; each tick sends its share, interleaved across runs.
            let per_tick = (rate / 100).max(1);
            let mut sent = 0u64;
            let mut tick = 0u64;
            while sent < total {
                tokio::time::sleep_until((began + Duration::from_millis(10 * tick)).into()).await;
                let mut batch = Vec::new();
                for n in sent..(sent + per_tick).min(total) {
                    let (run, k) = ((n % runs) as usize, n / runs);
                    let event = event(ids[run], executions[run], k, events);
                    let payload = serde_json::to_vec(&event).unwrap();
                    batch.push((event.routing_key(), payload));
                }
                let sends = batch
                    .iter()
                    .map(|(key, payload)| publisher.publish(&exchange, key, payload, None));
                for result in futures_util::future::join_all(sends).await {
                    result.expect("published");
                }
                sent += batch.len() as u64;
                tick += 1;
            }
            let sending = began.elapsed();
            let deadline = Instant::now() + Duration::from_secs(600);
            while stored(&client).await < base + total {
                assert!(
                    Instant::now() < deadline,
                    "the events were never all stored"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let storing = began.elapsed();
            let cpu_after = cpu_now();
            let per_thousand: Vec<String> = cpu_after
                .iter()
                .zip(cpu_before)
                .map(|(after, before)| format!("{:.0}", (after - before) * 1e6 / total as f64))
                .collect();
            tokio::time::sleep(Duration::from_millis(500)).await;
            let mut seen = latencies.lock().unwrap().clone();
            seen.sort_unstable();
            println!(
                "| {count} | {rate} | {:.0} | {:.0} | {:.1} | {:.1} | {} |",
                total as f64 / sending.as_secs_f64(),
                total as f64 / storing.as_secs_f64(),
                percentile(&seen, 0.5),
                percentile(&seen, 0.99),
                per_thousand.join(" / "),
            );
        }
        publisher.close().await;
        for other in &mut others {
            let _ = other.terminate(Duration::from_secs(15));
        }
        drop(cluster);
        database.drop_database().await;
    }
}
