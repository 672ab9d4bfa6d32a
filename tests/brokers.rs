//! A pool on a RabbitMQ cluster: the dispatcher and a worker given the three nodes of the
//! cluster `scripts/rabbit-cluster.sh` starts (`FORGEPOOL_AMQP_URL` as a list), and the node
//! they use stopped under them. Start it with `scripts/services.sh && scripts/rabbit-cluster.sh up`.
//! The one test here stops and starts the cluster's nodes: no other test uses that cluster.

mod common;

use std::process::Command;
use std::time::Duration;

use common::cluster::{Cluster, Options};
use common::Fixture;

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

/// The script that starts and stops the cluster's nodes.
fn cluster_script(args: &[&str]) -> String {
    let output = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/rabbit-cluster.sh"
    ))
    .args(args)
    .output()
    .expect("scripts/rabbit-cluster.sh runs");
    assert!(
        output.status.success(),
        "scripts/rabbit-cluster.sh {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_string()
}

/// Fails (never skips) when the cluster's nodes are not all up.
fn require_cluster() {
    for port in [5681, 5682, 5683] {
        if std::net::TcpStream::connect_timeout(
            &format!("127.0.0.1:{port}").parse().unwrap(),
            Duration::from_secs(2),
        )
        .is_err()
        {
            panic!(
                "the RabbitMQ cluster's node on 127.0.0.1:{port} is not reachable: start it with \
                 `scripts/services.sh && scripts/rabbit-cluster.sh up` and run the tests again"
            );
        }
    }
}

/// The names of the clients connected to node `n` of the cluster (their `connection_name`)
/// that start with `prefix`: what the broker itself says, not what forgepool logs.
fn connections_on(n: u8, prefix: &str) -> Vec<String> {
    let host =
        String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
    let output = Command::new("rabbitmqctl")
        .args(["-q", "-n", &format!("fp{n}@{}", host.trim())])
        .args([
            "list_connections",
            "client_properties",
            "--no-table-headers",
        ])
        .output()
        .expect("rabbitmqctl runs");
    let marker = "{\"connection_name\",\"";
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            let rest = &line[line.find(marker)? + marker.len()..];
            Some(rest[..rest.find('"')?].to_string())
        })
        .filter(|name| name.starts_with(prefix))
        .collect()
}

/// Catches: a broker list taken for one URL (nothing connects), a dispatcher or a worker that
/// stays with a node that went away (the second run never delivered), a publish lost in the
/// failover, a consumer not declared again on the node it moved to, and a run executed twice
/// across it (its branch pushed twice, counted by the forge's own hook).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_on_three_broker_nodes_carries_on_when_its_node_stops() {
    require_cluster();
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["approve"]);
    let options = Options {
        env: vec![("FORGEPOOL_AMQP_URL".into(), cluster_script(&["url"]))],
        ..Options::default()
    };
    let cluster = Cluster::start_with(fixture, 1, 1, None, options).await;
    let first = cluster.submit("NODES-1").await;
    let (view, _) = cluster.wait_one(&first, Duration::from_secs(120)).await;
    assert_eq!(view["state"], "delivered", "{view}");
    // Both services are on the first node of the list: its loss is theirs.
    let before = connections_on(1, "forgepool-");
    assert!(
        before.iter().any(|c| c.starts_with("forgepool-dispatcher"))
            && before.iter().any(|c| c.starts_with("forgepool-worker")),
        "the services use the first node: {before:?}"
    );
    cluster_script(&["stop", "1"]);
    let stopped = async {
        let second = cluster.submit("NODES-2").await;
        cluster.wait_one(&second, Duration::from_secs(180)).await
    };
    let outcome = tokio::time::timeout(Duration::from_secs(240), stopped).await;
    // The node comes back whatever happened, for the next run of this test.
    cluster_script(&["start", "1"]);
    let (view, events) = outcome.expect("the second run ended in time");
    assert_eq!(
        view["state"],
        "delivered",
        "{view}\n{events}\n{}",
        cluster.logs()
    );
    let moved: Vec<String> = [2, 3]
        .into_iter()
        .flat_map(|n| connections_on(n, "forgepool-"))
        .collect();
    assert!(
        moved.iter().any(|c| c.starts_with("forgepool-dispatcher"))
            && moved.iter().any(|c| c.starts_with("forgepool-worker")),
        "the services moved to the nodes that were up: {moved:?}"
    );
    assert_eq!(cluster.pushes("forge/nodes-1"), 1, "delivered once");
    assert_eq!(cluster.pushes("forge/nodes-2"), 1, "delivered once");
    delete_queues_on_cluster(cluster).await;
}

/// Stops the services and deletes their queues from the cluster (the harness's own deletion
/// goes to the single node).
async fn delete_queues_on_cluster(mut cluster: Cluster) {
    cluster.stop_services(Duration::from_secs(15));
    let host =
        String::from_utf8(Command::new("hostname").arg("-s").output().unwrap().stdout).unwrap();
    let listed = Command::new("rabbitmqctl")
        .args(["-q", "-n", &format!("fp2@{}", host.trim())])
        .args(["list_queues", "name", "--no-table-headers"])
        .output()
        .expect("rabbitmqctl runs");
    for queue in String::from_utf8_lossy(&listed.stdout)
        .lines()
        .map(str::trim)
        .filter(|q| q.starts_with(&format!("{}.", cluster.prefix)))
    {
        let _ = Command::new("rabbitmqctl")
            .args(["-q", "-n", &format!("fp2@{}", host.trim())])
            .args(["delete_queue", queue])
            .output();
    }
}
