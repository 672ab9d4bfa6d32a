//! A worker cut off from the broker while its stage runs (SPEC 11), through a TCP proxy that
//! drops every byte both ways and closes nothing, as a dropped route does; then healed.
//!
//! The cut worker must stop the run's containers once it cannot hold its claim (30 s), before
//! the broker gives up on its connection (a missed heartbeat, 60 s) and another worker takes
//! the job; the run is delivered once, and at no time do two executions' containers run.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::cluster::{container_count, Cluster};
use common::proxy::Proxy;
use common::Fixture;

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

/// The run's containers running now, as the engine lists them.
fn running_containers(run_id: &str) -> usize {
    let output = common::output_within(
        std::process::Command::new("docker").args([
            "ps",
            "-q",
            "--filter",
            &format!("label=forgepool.run_id={run_id}"),
            "--filter",
            "status=running",
        ]),
        common::COMMAND_LIMIT,
    );
    String::from_utf8_lossy(&output.stdout).lines().count()
}

/// Catches: a worker cut off from the broker that keeps running its stage (two executions at
/// once, and two pushes with the nonce agent), one that publishes the run's end after the
/// heal, a run lost to the partition, or a worker that does not come back when healed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_from_the_broker_stops_before_another_takes_its_run() {
    // Round 1's implementer sleeps 100 s unless SLEEP_DONE is set (the second worker's is).
    let fixture = Fixture::new(Some(REVIEW), &["sleep-from", "1", "100"], &["approve"]);
    let agents = std::fs::read_to_string(&fixture.agents).unwrap().replacen(
        "env = [\"AGENT_SECRET\"]",
        "env = [\"AGENT_SECRET\", \"SLEEP_DONE\"]",
        1,
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    let proxy = Proxy::start("127.0.0.1:5672").await;
    let through = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port);
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let cut = cluster.start_worker_with("cut", 1, &[("FORGEPOOL_AMQP_URL", &through)]);
    let id = cluster.submit("PART-1").await;
    cluster.wait_running(&id).await;

    // Watch the engine: the most containers of the run running at once.
    let most = Arc::new(AtomicUsize::new(0));
    let watching = {
        let (most, id) = (Arc::clone(&most), id.clone());
        tokio::task::spawn_blocking(move || {
            while Arc::strong_count(&most) > 1 {
                most.fetch_max(running_containers(&id), Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };

    proxy.sever();
    cluster.start_worker_with("other", 1, &[("SLEEP_DONE", "yes")]);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(240))
        .await;
    proxy.heal();
    // The healed worker reconnects, and publishes nothing for the run it gave up.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let most = {
        let seen = most.load(Ordering::SeqCst);
        drop(most);
        seen
    };
    watching.await.unwrap();

    let logs = cluster.logs();
    let cut_log = std::fs::read_to_string(&cluster.workers[cut].log).unwrap_or_default();
    std::fs::write(
        std::env::temp_dir().join("partition-cut-worker.log"),
        &cut_log,
    )
    .unwrap();
    assert_eq!(
        views[0]["state"], "delivered",
        "{}\n{logs}",
        views[0]["states"]
    );
    assert_eq!(cluster.pushes("forge/part-1"), 1, "delivered once");
    assert_eq!(most, 1, "two executions' containers ran at once\n{logs}");
    assert!(
        cut_log.contains("the claim on the run is lost"),
        "the cut worker never gave the run up\n{logs}"
    );
    let after = cluster.run(&id).await;
    assert_eq!(after["state"], "delivered", "the run's end stayed final");
    assert_eq!(
        after["result"], views[0]["result"],
        "the result stayed final"
    );
    assert!(
        cluster.workers[cut].child.try_wait().unwrap().is_none(),
        "the cut worker is still alive after the heal\n{logs}"
    );
    assert_eq!(container_count(&id), 0, "containers left\n{logs}");
    cluster.delete_queues().await;
}
