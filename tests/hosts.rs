//! Workers on hosts that share nothing with the dispatcher but the network: each worker runs on
//! a host of `scripts/hosts.sh` (its own network namespace and address on a private bridge,
//! its own `/tmp`, host name and Docker engine, no way to this machine's engine) and reaches
//! the broker over TCP on that bridge. Needs root, iproute2 and the services of
//! `scripts/services.sh`. The one test here starts and removes the hosts: no other test uses
//! them.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cluster::Cluster;
use common::{output_within, Fixture, COMMAND_LIMIT, TEST_IMAGE};

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

/// Runs `scripts/hosts.sh` with `args`; its standard output, trimmed.
fn hosts(args: &[&str]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/hosts.sh");
    // The hosts' /tmp is their own: the folder of the binary they run is bound into it, wherever
    // cargo put it (a clone under /tmp, a CARGO_TARGET_DIR).
    let binary = Path::new(env!("CARGO_BIN_EXE_forgepool"));
    let output = output_within(
        Command::new(script)
            .args(args)
            .env("FORGEPOOL_HOSTS_SHARE", binary.parent().unwrap()),
        Duration::from_secs(180),
    );
    assert!(
        output.status.success(),
        "scripts/hosts.sh {args:?} failed (it needs root, iproute2 and Docker: \
         scripts/services.sh installs them): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Takes the hosts down when the test ends, however it ends.
struct Hosts;

impl Drop for Hosts {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/hosts.sh");
        let _ = Command::new(script).arg("down").status();
    }
}

/// Removes a container of this machine's engine when the test ends, however it ends.
struct Removed(String);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = Command::new("docker").args(["rm", "-f", &self.0]).output();
    }
}

/// `docker` on this machine's engine (`host` 0) or on host `host`'s.
fn docker(host: u8, args: &[&str]) -> String {
    let output = if host == 0 {
        output_within(Command::new("docker").args(args), COMMAND_LIMIT)
    } else {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/hosts.sh");
        output_within(
            Command::new(script)
                .args(["exec", &host.to_string(), "docker"])
                .args(args),
            COMMAND_LIMIT,
        )
    };
    assert!(
        output.status.success(),
        "docker {args:?} on engine {host}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// A stopped container on engine `host` that carries the labels of a stage of a dead worker
/// of cluster `prefix`: what the dead-worker sweep removes from its own engine.
fn decoy(host: u8, prefix: &str) -> String {
    let gone = uuid::Uuid::new_v4().to_string();
    docker(
        host,
        &[
            "create",
            "--label",
            "forgepool.managed=true",
            "--label",
            &format!("forgepool.cluster={prefix}"),
            "--label",
            &format!("forgepool.instance={gone}"),
            "--label",
            &format!("forgepool.worker={prefix}-gone"),
            "--label",
            "forgepool.host=fph9",
            TEST_IMAGE,
            "true",
        ],
    )
}

/// The run ids of the stage containers engine `host` created since `since` (Unix seconds),
/// as the engine's own event log says.
fn created_on(host: u8, since: u64) -> Vec<String> {
    let until = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1;
    docker(
        host,
        &[
            "events",
            "--since",
            &since.to_string(),
            "--until",
            &until.to_string(),
            "--filter",
            "type=container",
            "--filter",
            "event=create",
            "--filter",
            "label=forgepool.managed=true",
            "--format",
            "{{index .Actor.Attributes \"forgepool.run_id\"}}",
        ],
    )
    .lines()
    .filter(|id| !id.is_empty())
    .map(String::from)
    .collect()
}

fn exists(host: u8, container: &str) -> bool {
    !docker(
        host,
        &[
            "ps",
            "-aq",
            "--no-trunc",
            "--filter",
            &format!("id={container}"),
        ],
    )
    .is_empty()
}

/// Catches: a worker that needs anything of the dispatcher's machine but the broker (a shared
/// `/tmp`, workspace, cache, engine or loopback: it fails to start or to deliver), a worker that
/// starts its stages on an engine other than its own (this machine's engine logs a create), a
/// run executed on two hosts (two pushes, counted by the repository's own hook), and a sweep
/// that lists or removes containers beyond its own engine: a dead worker's container on this
/// machine's engine stays, while the same one on a host's engine is removed by that host's
/// worker (the sweep works, and only where it should); and a pool view that does not show
/// each worker under its own host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_hosts_that_share_nothing_deliver_and_keep_to_their_own_engines() {
    let _down = Hosts;
    // Hosts an interrupted run left (their engines, their containers) go first.
    hosts(&["down"]);
    hosts(&["up", "2"]);
    for host in ["1", "2"] {
        hosts(&["load", host, TEST_IMAGE]);
    }
    let amqp_url = hosts(&["amqp-url"]);
    // The repository and the operator's files sit where the hosts can read them: a host's own
    // /tmp hides this machine's (the repository stands in for a forge; tests/forges.rs covers
    // git over the network).
    let dir = tempfile::Builder::new()
        .prefix("forgepool-hosts-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let fixture = Fixture::with_image_in(dir, Some(REVIEW), &["change"], &["approve"], TEST_IMAGE);
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let here = Removed(decoy(0, &cluster.prefix));
    let there = decoy(2, &cluster.prefix);
    cluster.start_worker_on_host("h1", 1, 1, &amqp_url);
    cluster.start_worker_on_host("h2", 1, 2, &amqp_url);

    let mut runs = Vec::new();
    for n in 0..4 {
        runs.push(cluster.submit(&format!("HOSTS-{n}")).await);
    }
    let views = cluster.wait_terminal(&runs, Duration::from_secs(240)).await;
    for (view, n) in views.iter().zip(0..) {
        assert_eq!(
            view["state"],
            "delivered",
            "HOSTS-{n}: {view}\n{}",
            cluster.logs()
        );
        let branch = format!("forge/hosts-{n}");
        assert_eq!(
            cluster.pushes(&branch),
            1,
            "HOSTS-{n}: {branch} pushed once"
        );
    }

    // The pool knows which workers are alive on which host, from their beacons.
    let pool: serde_json::Value = cluster
        .request(reqwest::Method::GET, "/v1/pool")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed: Vec<(String, String)> = pool["hosts"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|host| {
            host["workers"].as_array().unwrap().iter().map(move |w| {
                (
                    host["host"].as_str().unwrap().to_string(),
                    w["worker"].as_str().unwrap().to_string(),
                )
            })
        })
        .collect();
    let prefix = &cluster.prefix;
    assert_eq!(
        listed,
        [
            ("fph1".to_string(), format!("{prefix}-h1")),
            ("fph2".to_string(), format!("{prefix}-h2"))
        ],
        "{pool}"
    );

    let on_this_machine = created_on(0, since);
    let on_host1 = created_on(1, since);
    let on_host2 = created_on(2, since);
    for run in &runs {
        assert!(
            !on_this_machine.contains(run),
            "a stage of {run} ran on this machine's engine"
        );
        assert!(
            on_host1.contains(run) != on_host2.contains(run),
            "{run}'s stages ran on {} hosts",
            u8::from(on_host1.contains(run)) + u8::from(on_host2.contains(run))
        );
    }
    assert!(
        runs.iter().any(|r| on_host1.contains(r)) && runs.iter().any(|r| on_host2.contains(r)),
        "one host ran every run: host 1 {on_host1:?}, host 2 {on_host2:?}"
    );

    // The sweep removes a dead worker's containers after its grace (30 s missing, 30 s steady).
    let started = Instant::now();
    while exists(2, &there) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "host 2's worker never removed the dead worker's container on its own engine\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert!(
        exists(0, &here.0),
        "a worker on a host removed a container on this machine's engine"
    );
    for host in [1, 2] {
        let left = docker(
            host,
            &["ps", "-aq", "--filter", "label=forgepool.managed=true"],
        );
        assert!(left.is_empty(), "host {host} kept containers: {left}");
    }
    cluster.stop_services(Duration::from_secs(30));
    cluster.delete_queues().await;
}
