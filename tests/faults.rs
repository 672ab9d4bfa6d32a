//! Fault tests that disturb the shared broker: a RabbitMQ restart, a consumer-acknowledgement
//! timeout shorter than a run, and a worker drained by SIGTERM. `scripts/test.sh` runs this
//! binary on its own, after the rest of the suite, one test at a time.

mod common;

use std::process::Command;
use std::time::Duration;

use common::cluster::{container_count, Cluster};
use common::Fixture;

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

fn rabbitmqctl(args: &[&str]) {
    let output = common::output_within(
        Command::new("rabbitmqctl").args(args),
        common::COMMAND_LIMIT,
    );
    assert!(
        output.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_loses_no_accepted_run() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "3"], &["approve"]);
    let cluster = Cluster::start(fixture, 2, 2, None).await;
    let mut ids = Vec::new();
    for n in 1..=6 {
        ids.push(cluster.submit(&format!("BOUNCE-{n}")).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    rabbitmqctl(&["stop_app"]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup"]);
    let views = cluster.wait_terminal(&ids, Duration::from_secs(240)).await;
    for (n, view) in views.iter().enumerate() {
        assert_eq!(
            view["state"],
            "delivered",
            "run {n}: {}\n{}",
            view["states"],
            cluster.logs()
        );
        assert_eq!(cluster.pushes(&format!("forge/bounce-{}", n + 1)), 1);
    }
    // Both services reconnected by themselves: a new run goes through.
    let id = cluster.submit("BOUNCE-99").await;
    let views = cluster.wait_terminal(&[id], Duration::from_secs(60)).await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_longer_than_the_consumer_timeout_completes_exactly_once() {
    // Channels opened from now on get a 5 s acknowledgement timeout.
    rabbitmqctl(&[
        "eval",
        "application:set_env(rabbit, consumer_timeout, 5000).",
    ]);
    let restore = scopeguard(|| {
        let _ = Command::new("rabbitmqctl")
            .args([
                "eval",
                "application:set_env(rabbit, consumer_timeout, 1800000).",
            ])
            .output();
    });
    // RabbitMQ checks the timeout about once a minute, so the run must outlast that.
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "75"], &["approve"]);
    let cluster = Cluster::start(fixture, 2, 1, None).await;
    let id = cluster.submit("LONG-1").await;
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(180))
        .await;
    drop(restore);
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    let states = common::cluster::state_names(&views[0]);
    assert_eq!(
        states,
        ["queued", "running", "delivered"],
        "the run started once and ended once\n{}",
        cluster.logs()
    );
    assert_eq!(views[0]["result"]["implementation_rounds"], 1);
    assert_eq!(cluster.pushes("forge/long-1"), 1);
    let logs = cluster.logs();
    assert!(
        logs.contains("consumer failed")
            || logs.contains("consumer closed")
            || logs.contains("cannot acknowledge"),
        "the broker's consumer timeout did not fire, so the test proves nothing:\n{logs}"
    );
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_worker_and_hands_its_run_back() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "30"], &["approve"]);
    let mut cluster = Cluster::start(fixture, 1, 1, None).await;
    let id = cluster.submit("DRAIN-1").await;
    let started = std::time::Instant::now();
    while cluster.run(&id).await["state"] != "running" {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The drain time is 5 s: the run cannot finish, so it is stopped and handed back.
    let code = cluster.workers[0].terminate(Duration::from_secs(60));
    assert_eq!(
        code,
        Some(0),
        "the worker exits cleanly after draining\n{}",
        cluster.logs()
    );
    assert_eq!(
        container_count(&id),
        0,
        "the drained worker left its container"
    );
    cluster.start_worker("after", 1);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    assert_eq!(cluster.pushes("forge/drain-1"), 1);
    cluster.delete_queues().await;
}

/// Catches: hand-overs that count toward the poison limit (the broker would dead-letter the job
/// after five and fail the run), or that repeat completed stages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_survives_ten_hand_overs_and_is_delivered_once() {
    // Round 1 is implemented and reviewed (rejected) quickly; round 2 sleeps, and each worker
    // is drained while it sleeps.
    let fixture = Fixture::new(Some(REVIEW), &["sleep-from", "2", "30"], &["rules"]);
    let agents = std::fs::read_to_string(&fixture.agents).unwrap().replacen(
        "env = [\"AGENT_SECRET\"]",
        "env = [\"AGENT_SECRET\", \"SLEEP_DONE\"]",
        1,
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let id = cluster.submit("HAND-1").await;
    for n in 0..10 {
        let worker = cluster.start_worker(&format!("w{n}"), 1);
        let started = std::time::Instant::now();
        // Wait for round 2's implementer of this execution.
        loop {
            let stream = cluster
                .event_stream_until(&id, Duration::from_millis(500))
                .await;
            let sleeping = stream.matches("\"type\":\"stage_started\"").count();
            if sleeping > n + 2 {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "execution {n} did not start round 2\n{}",
                cluster.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let code = cluster.workers[worker].terminate(Duration::from_secs(60));
        assert_eq!(code, Some(0), "drain {n}\n{}", cluster.logs());
    }
    // The last worker lets round 2 finish.
    cluster.start_worker_with("last", 1, &[("SLEEP_DONE", "yes")]);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    assert_eq!(cluster.pushes("forge/hand-1"), 1, "delivered once");
    assert_eq!(views[0]["implementation_rounds"], 2, "no round repeated");
    let stream = cluster.event_stream(&id).await;
    let completed_round_one = stream
        .lines()
        .filter(|l| l.contains("\"type\":\"stage_finished\"") && l.contains("\"round\":1,"))
        .count();
    assert_eq!(
        completed_round_one, 2,
        "round 1's implementer and review ran once each"
    );
    cluster.delete_queues().await;
}

/// Catches: a store outage at the end of a run that turns its final events into "unknown run"
/// dead letters, leaving the run `running` for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_during_the_final_events_loses_nothing() {
    let database = common::postgres::TestDatabase::create().await;
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "4"], &["approve"]);
    let options = common::cluster::Options {
        database: Some(database.url.clone()),
        ..Default::default()
    };
    let cluster = Cluster::start_with(fixture, 1, 1, None, options).await;
    let id = cluster.submit("OUTAGE-1").await;
    cluster.wait_running(&id).await;
    // PostgreSQL goes away while the implementer sleeps, and comes back 10 s later: the run's
    // last stage and its final events arrive meanwhile.
    let _restart = scopeguard(|| postgres("start"));
    postgres("stop");
    tokio::time::sleep(Duration::from_secs(10)).await;
    postgres("start");
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    assert_eq!(cluster.pushes("forge/outage-1"), 1);
    let dead = cluster.logs();
    assert!(
        !dead.contains("event for unknown run"),
        "an event was dead-lettered\n{dead}"
    );
    cluster.delete_queues().await;
    database.drop_database().await;
}

/// Catches: a cancel lost because the broker (and so the worker's control consumer) was away
/// when it was sent: it is stored first, and told again when the worker next reports the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_sent_while_the_broker_is_away_still_stops_the_run() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "90"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let id = cluster.submit("AWAY-1").await;
    cluster.wait_running(&id).await;
    let _restart = scopeguard(|| rabbitmqctl(&["start_app"]));
    rabbitmqctl(&["stop_app"]);
    let (status, body) = cluster.cancel(&id).await;
    assert_eq!(status, 202, "stored even with the broker away");
    assert_eq!(body["cancel"], "requested");
    tokio::time::sleep(Duration::from_secs(3)).await;
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup"]);
    // The stage sleeps 90 s: the run ends well before only if the worker heard the cancel.
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(60))
        .await;
    assert_eq!(views[0]["state"], "cancelled", "{}", cluster.logs());
    assert_eq!(container_count(&id), 0, "the stage was stopped");
    assert_eq!(cluster.pushes("forge/away-1"), 0);
    cluster.delete_queues().await;
}

/// Stops or starts the machine's PostgreSQL cluster.
fn postgres(action: &str) {
    let output = common::output_within(
        Command::new("pg_ctlcluster").args(["15", "main", action]),
        Duration::from_secs(60),
    );
    assert!(
        output.status.success() || action == "start",
        "pg_ctlcluster {action}: {output:?}"
    );
}

/// Runs `f` when dropped, so a failed assertion still restores the broker's setting.
fn scopeguard<F: FnOnce()>(f: F) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}
