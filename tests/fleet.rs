//! Fleets against providers' limits, end to end (a real RabbitMQ, Docker engine and git):
//! per-profile caps across the pool (`max_concurrent`), quota pauses (`pause.json`) that stop a
//! profile on every worker and end by themselves, and usage accounting (`usage.json`) with a
//! per-run budget. Start the services with `scripts/services.sh` and build the images with
//! `scripts/build-images.sh`.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cluster::Cluster;
use common::Fixture;

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

/// Adds `line` to the table `[agents.NAME]` of the fixture's agents file, and appends `extra`.
fn edit_agents(fixture: &Fixture, name: &str, line: &str, extra: &str) {
    let text = std::fs::read_to_string(&fixture.agents).unwrap();
    let header = format!("[agents.{name}]\n");
    assert!(text.contains(&header), "no {header} in {text}");
    let text = text.replace(&header, &format!("{header}{line}\n")) + extra;
    std::fs::write(&fixture.agents, text).unwrap();
}

/// A metric's value in Prometheus text, by its name and labels as printed.
async fn metric(address: &str, series: &str) -> Option<f64> {
    let text = reqwest::get(format!("http://{address}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

/// Each run's `stage_started` events of `stage`, as the event stream shows them.
async fn stages_started(cluster: &Cluster, run_id: &str, stage: &str) -> usize {
    cluster
        .event_stream(run_id)
        .await
        .lines()
        .filter(|line| {
            line.starts_with("data:")
                && line.contains("\"stage_started\"")
                && line.contains(&format!("\"stage\":\"{stage}\""))
        })
        .count()
}

/// The running implement containers of `runs`, as the Docker engine lists them.
fn running_implementers(runs: &[String]) -> usize {
    let output = common::output_within(
        std::process::Command::new("docker").args([
            "ps",
            "--filter",
            "label=forgepool.stage=implement",
            "--format",
            "{{.Label \"forgepool.run_id\"}}",
        ]),
        common::COMMAND_LIMIT,
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|run| runs.iter().any(|r| r == run.trim()))
        .count()
}

/// Catches: a cap enforced per worker instead of across the pool (two workers would each run
/// one), a waiting run that holds up a run of another profile or holds a run slot, a cap slot
/// never given back (the third run would never start), and a wait invisible in the API and
/// the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_profile_runs_one_stage_at_a_time_across_the_pool_while_another_goes_through() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "4"], &["approve"]);
    edit_agents(
        &fixture,
        "impl",
        "max_concurrent = 1",
        &format!("\n[agents.other]\nimage = \"{}\"\ncommand = [\"/bin/sh\", \"/agents/implementer.sh\", \"change\"]\nmemory = \"128m\"\ntimeout_seconds = 60\n", common::TEST_IMAGE),
    );
    // Two workers with two slots each: four slots for four runs, one profile capped at one.
    let cluster = Cluster::start(fixture, 2, 2, None).await;
    let mut capped = Vec::new();
    for n in 1..=3 {
        capped.push(cluster.submit(&format!("CAP-{n}")).await);
    }
    let other = cluster
        .submit_with(
            "FREE-1",
            serde_json::json!({"agents": {"implementer": "other"}}),
        )
        .await;

    let started = Instant::now();
    let (mut most, mut waiting_seen, mut gauge_seen) = (0, false, false);
    let mut other_done_while_capped_waited = false;
    let dispatcher = cluster.dispatcher.as_ref().unwrap().address.clone();
    loop {
        most = most.max(running_implementers(&capped));
        let mut states = HashMap::new();
        for id in &capped {
            let view = cluster.run(id).await;
            if view["waiting_for_profile"] == "impl" {
                waiting_seen = true;
            }
            states.insert(id.clone(), view["state"].as_str().unwrap_or("").to_string());
        }
        let other_state = cluster.run(&other).await["state"].clone();
        if other_state == "delivered" && states.values().any(|s| s == "queued") {
            other_done_while_capped_waited = true;
        }
        let gauge = r#"forgepool_runs_waiting_for_profile{profile="impl"}"#;
        if metric(&dispatcher, gauge).await.unwrap_or(0.0) >= 1.0 {
            gauge_seen = true;
        }
        if states.values().all(|s| s == "delivered") && other_state == "delivered" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the runs did not end: {states:?}, other {other_state}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert_eq!(
        most, 1,
        "at most one stage of the capped profile ran at once"
    );
    assert!(waiting_seen, "the API showed a run waiting for its profile");
    assert!(
        gauge_seen,
        "the dispatcher's gauge counted the waiting runs"
    );
    assert!(
        other_done_while_capped_waited,
        "the run of the other profile was delivered while capped runs still waited"
    );
    for id in &capped {
        assert_eq!(stages_started(&cluster, id, "implement").await, 1, "{id}");
    }
    for n in 1..=3 {
        assert_eq!(cluster.pushes(&format!("forge/cap-{n}")), 1);
    }
    cluster.delete_queues().await;
}

/// Catches: a pause.json that stops only its own run (another worker would start the profile
/// into the spent quota), a pause a worker that starts later does not know, paused runs that
/// need a manual resume, and a pause the metrics do not show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_pause_stops_the_profile_on_every_worker_and_its_runs_resume_by_themselves() {
    // The provider's quota is spent until this time; the implementer says so in pause.json.
    let window = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 14;
    let fixture = Fixture::new(
        Some(REVIEW),
        &["quota-until", &window.to_string()],
        &["approve"],
    );
    let mut cluster = Cluster::start(fixture, 1, 2, None).await;
    let first = cluster.submit("QUOTA-1").await;
    let started = Instant::now();
    while cluster.run(&first).await["state"] != "paused" {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the first run never paused\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let paused = cluster.run(&first).await;
    let reason = paused["states"].as_array().unwrap().last().unwrap()["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(reason.contains("asked to wait until"), "{reason}");
    assert!(
        reason.contains("a pool resumes it then by itself"),
        "{reason}"
    );

    // The worker that saw the pause goes away; a new one must know of the pause all the same.
    cluster.workers[0].terminate(Duration::from_secs(20));
    let fresh = cluster.start_worker("w-late", 2);
    let address = cluster.workers[fresh].address.clone();
    let gauge = r#"forgepool_profile_paused{profile="impl"}"#;
    let mut known = false;
    for _ in 0..50 {
        if metric(&address, gauge).await == Some(1.0) {
            known = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(known, "the new worker read the pause from the broker");
    let second = cluster.submit("QUOTA-2").await;
    let started = Instant::now();
    while cluster.run(&second).await["state"] != "paused" {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the second run never paused\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stages_started(&cluster, &second, "implement").await,
        0,
        "no stage of the paused profile started"
    );
    let views = cluster
        .wait_terminal(&[first.clone(), second.clone()], Duration::from_secs(90))
        .await;
    for view in &views {
        assert_eq!(view["state"], "delivered", "{view}");
        let resumed = view["states"].as_array().unwrap().iter().any(|s| {
            s["reason"]
                .as_str()
                .unwrap_or("")
                .starts_with("resumed by itself")
        });
        assert!(resumed, "the run resumed by itself: {view}");
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(now >= window, "the runs waited for the quota window");
    assert_eq!(stages_started(&cluster, &first, "implement").await, 2);
    assert_eq!(stages_started(&cluster, &second, "implement").await, 1);
    assert_eq!(metric(&address, gauge).await, Some(0.0), "the pause ended");
    cluster.delete_queues().await;
}

/// Catches: usage.json not summed into the run (API, report, `forgepool status`), not counted
/// in the worker's metrics, and a budget that does not stop a run before its next stage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_summed_per_run_and_a_budget_stops_a_run_cleanly() {
    let fixture = Fixture::new(Some(REVIEW), &["usage", "0.75"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 2, None).await;
    let spent = cluster.submit("USAGE-1").await;
    let capped = cluster
        .submit_with(
            "USAGE-2",
            serde_json::json!({"budget": {"max_cost_usd": 0.5}}),
        )
        .await;
    let views = cluster
        .wait_terminal(&[spent.clone(), capped.clone()], Duration::from_secs(90))
        .await;
    let (view, over) = (&views[0], &views[1]);
    assert_eq!(view["state"], "delivered", "{view}");
    assert_eq!(view["usage"]["input_tokens"], 1000);
    assert_eq!(view["usage"]["output_tokens"], 200);
    assert_eq!(view["usage"]["cache_read_tokens"], 30);
    assert_eq!(view["usage"]["cost_usd"], 0.75);
    assert_eq!(view["usage"]["models"], serde_json::json!(["test-model"]));
    assert_eq!(view["result"]["usage"], view["usage"]);
    let report = view["report"].as_str().unwrap();
    assert!(report.contains("## Usage"), "{report}");
    assert!(
        report.contains("| 1000 | 200 | 30 | 0 | 0.7500 | 1 |"),
        "{report}"
    );

    assert_eq!(over["state"], "failed", "{over}");
    let reason = over["states"].as_array().unwrap().last().unwrap()["reason"]
        .as_str()
        .unwrap();
    assert!(reason.contains("budget exceeded"), "{reason}");
    assert_eq!(stages_started(&cluster, &capped, "review").await, 0);
    assert_eq!(cluster.pushes("forge/usage-1"), 1);
    assert_eq!(cluster.pushes("forge/usage-2"), 0, "nothing was delivered");
    assert_eq!(over["budget"]["max_cost_usd"], 0.5);

    let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_forgepool"))
        .args(["status", &spent])
        .env("FORGEPOOL_DISPATCHER_URL", cluster.url())
        .output()
        .await
        .unwrap();
    let printed = String::from_utf8_lossy(&status.stdout);
    assert!(
        printed.contains("usage: 1000 input, 200 output tokens"),
        "{printed}"
    );
    let worker = &cluster.workers[0].address;
    let tokens = r#"forgepool_agent_tokens_total{kind="input",profile="impl"}"#;
    assert_eq!(metric(worker, tokens).await, Some(2000.0));
    let cost = r#"forgepool_agent_cost_usd_total{profile="impl"}"#;
    assert_eq!(metric(worker, cost).await, Some(1.5));
    cluster.delete_queues().await;
}
