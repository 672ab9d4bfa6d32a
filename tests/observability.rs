//! What an operator sees: Prometheus metrics on the dispatcher and on a worker during and after
//! real runs, and secrets kept out of every output. Real RabbitMQ, Docker and git; start the
//! services with `scripts/services.sh` and build the images with `scripts/build-images.sh`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, Options};
use common::Fixture;

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\nThe change must add tests.\n";
const SECRET: &str = "sk-test-0123456789abcdef";

async fn scrape(address: &str) -> String {
    let response = reqwest::get(format!("http://{address}/metrics"))
        .await
        .expect("/metrics answers");
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    response.text().await.unwrap()
}

/// The value of the sample `series` (name and labels exactly as exposed), if present.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn value(text: &str, series: &str) -> f64 {
    sample(text, series).unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}

/// Scrapes until `series` has `expected`, or fails after `limit`.
async fn eventually(address: &str, series: &str, expected: f64, limit: Duration) -> String {
    let started = Instant::now();
    loop {
        let text = scrape(address).await;
        if sample(&text, series) == Some(expected) {
            return text;
        }
        if started.elapsed() > limit {
            panic!("{series} never became {expected} within {limit:?}:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_on_the_dispatcher_and_a_worker_follow_real_runs() {
    // Each run: cycle 1 rejected (no tests yet), cycle 2 approved, delivered.
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["rules"]);
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let dispatcher = cluster.dispatcher.as_ref().unwrap().address.clone();
    let jobs_queue = format!(
        "forge_queue_depth{{queue_name=\"{}.jobs\"}}",
        cluster.prefix
    );

    // No worker yet: the jobs wait in the real queue, and the gauge says so.
    let mut runs = Vec::new();
    for n in 1..=3 {
        runs.push(cluster.submit(&format!("METRICS-{n}")).await);
    }
    let text = eventually(&dispatcher, &jobs_queue, 3.0, Duration::from_secs(15)).await;
    assert_eq!(
        value(&text, "forgepool_runs_by_state{state=\"queued\"}"),
        3.0
    );

    // During: the worker's one slot is busy and its queue gauge sees the rest waiting.
    cluster.start_worker("w0", 1);
    let worker = cluster.workers[0].address.clone();
    let during = eventually(
        &worker,
        "forgepool_runs_in_progress",
        1.0,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(value(&during, "forgepool_run_slots"), 1.0);

    let views = cluster.wait_terminal(&runs, Duration::from_secs(120)).await;
    for view in &views {
        assert_eq!(view["state"], "delivered", "{}", cluster.logs());
    }

    // After: both services count the same six cycles, three of each verdict.
    let labels = r#"skill="implement-task",step="implement_task""#;
    for address in [&dispatcher, &worker] {
        let text = eventually(
            address,
            &format!("forge_review_cycles_total{{{labels}}}"),
            6.0,
            Duration::from_secs(10),
        )
        .await;
        for verdict in ["approved", "rejected"] {
            assert_eq!(
                value(
                    &text,
                    &format!("forge_review_verdicts_total{{{labels},verdict=\"{verdict}\"}}")
                ),
                3.0,
                "{verdict} verdicts"
            );
        }
        assert_eq!(
            value(
                &text,
                &format!("forge_review_duration_seconds_count{{{labels}}}")
            ),
            6.0,
            "one observation per reviewer container"
        );
        let sum = value(
            &text,
            &format!("forge_review_duration_seconds_sum{{{labels}}}"),
        );
        assert!(sum > 0.0 && sum < 600.0, "review time {sum}");
        assert_eq!(
            value(
                &text,
                &format!("forge_review_duration_seconds_bucket{{{labels},le=\"600\"}}")
            ),
            6.0
        );
        let buckets: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("forge_review_duration_seconds_bucket{"))
            .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(
            buckets,
            ["1", "5", "10", "30", "60", "120", "300", "600", "+Inf"]
        );
        assert_eq!(
            value(&text, "forgepool_runs_total{outcome=\"delivered\"}"),
            3.0
        );
        assert_eq!(value(&text, "forgepool_deliveries_total"), 3.0);
        assert!(
            !text.contains("run_id") && !text.contains(&runs[0]),
            "no run ids in labels"
        );
    }
    // The queue drained, on both services' view of the broker.
    eventually(&dispatcher, &jobs_queue, 0.0, Duration::from_secs(15)).await;
    eventually(&worker, &jobs_queue, 0.0, Duration::from_secs(15)).await;
    // A run's end is published before its workspace is removed and its slot freed: the
    // gauges follow within moments.
    let limit = Duration::from_secs(15);
    eventually(&worker, "forgepool_containers_running", 0.0, limit).await;
    eventually(&worker, "forgepool_runs_in_progress", 0.0, limit).await;
    let text = eventually(
        &dispatcher,
        "forgepool_runs_by_state{state=\"delivered\"}",
        3.0,
        Duration::from_secs(15),
    )
    .await;
    assert_eq!(
        value(&text, "forgepool_runs_by_state{state=\"queued\"}"),
        0.0
    );
    assert!(
        text.contains(&format!(
            "forge_queue_depth{{queue_name=\"{}.submissions\"}}",
            cluster.prefix
        )),
        "every shared queue is reported"
    );
    // The SLO figures: each run's wait in the queue and its whole time, once per run.
    assert_eq!(
        value(
            &text,
            "forgepool_queue_wait_seconds_count{skill=\"implement-task\"}"
        ),
        3.0
    );
    assert_eq!(
        value(
            &text,
            "forgepool_run_duration_seconds_count{outcome=\"delivered\",skill=\"implement-task\"}"
        ),
        3.0
    );
    // The API's requests, by route template (never a run id).
    assert!(
        sample(
            &text,
            "forgepool_http_requests_total{method=\"POST\",route=\"/v1/runs\",status=\"201\"}"
        )
        .is_some_and(|n| n >= 3.0),
        "{text}"
    );
    assert!(text.contains("route=\"/v1/runs/{id}\""), "{text}");
    assert_eq!(
        value(
            &text,
            &format!(
                "forgepool_build_info{{role=\"dispatcher\",version=\"{}\"}}",
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    assert!(value(&text, "process_resident_memory_bytes") > 0.0);
    for only_on_workers in ["forgepool_containers_running", "forgepool_run_slots"] {
        assert!(
            !text.contains(only_on_workers),
            "the dispatcher exports no {only_on_workers}"
        );
    }
    // Both services' exposition passes promtool's lint.
    let worker_text = scrape(&worker).await;
    assert_eq!(value(&worker_text, "forgepool_run_slots"), 1.0);
    for (service, text) in [("dispatcher", &text), ("worker", &worker_text)] {
        let mut promtool = std::process::Command::new(common::promtool());
        promtool
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        let mut child = promtool.spawn().unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "promtool check metrics on the {service}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_in_a_profile_reaches_no_output() {
    // The implementer prints the secret; the reviewer puts it in its verdicts and on stderr.
    let fixture = Fixture::new(Some(REVIEW), &["secret"], &["leak"]);
    let agents = std::fs::read_to_string(&fixture.agents).unwrap();
    let agents = agents.replace(
        "command = [\"/bin/sh\", \"/agents/reviewer.sh\"",
        "env = [\"AGENT_SECRET\"]\ncommand = [\"/bin/sh\", \"/agents/reviewer.sh\"",
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    let options = Options {
        env: vec![
            (
                "FORGEPOOL_LOG".into(),
                "debug,lapin=off,h2=off,hyper=off".into(),
            ),
            ("FORGEPOOL_LOG_FORMAT".into(), "json".into()),
        ],
        ..Options::default()
    };
    let cluster = Cluster::start_with(fixture, 1, 1, None, options).await;
    let run_id = cluster.submit("SECRET-1").await;
    let views = cluster
        .wait_terminal(std::slice::from_ref(&run_id), Duration::from_secs(90))
        .await;
    let view = serde_json::to_string(&views[0]).unwrap();
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());

    let events = cluster.event_stream(&run_id).await;
    let watch = common::output_within(
        std::process::Command::new(env!("CARGO_BIN_EXE_forgepool"))
            .args(["watch", &run_id])
            .env("FORGEPOOL_DISPATCHER_URL", cluster.url()),
        common::cluster::HTTP_LIMIT,
    );
    let metrics = format!(
        "{}{}",
        scrape(&cluster.dispatcher.as_ref().unwrap().address).await,
        scrape(&cluster.workers[0].address).await
    );
    let git_log = std::process::Command::new("git")
        .args([
            "--git-dir",
            cluster.fixture.bare.to_str().unwrap(),
            "log",
            "-p",
            "--all",
        ])
        .output()
        .unwrap();
    let logs = cluster.logs();

    // The secret really went through: the agents saw it, and forgepool redacted it.
    assert!(
        view.contains("the key [REDACTED] is hard-coded"),
        "the reviewer's feedback is in the cycle files, redacted: {view}"
    );
    assert!(events.contains("my key is [REDACTED]"), "{events}");
    assert!(
        logs.contains("\"run_id\""),
        "the logs are JSON with run ids"
    );
    for (name, text) in [
        ("the run view (cycles, report, result)", view.as_str()),
        ("the event stream", events.as_str()),
        ("`forgepool watch`", &String::from_utf8_lossy(&watch.stdout)),
        (
            "`forgepool watch` errors",
            &String::from_utf8_lossy(&watch.stderr),
        ),
        ("the metrics", metrics.as_str()),
        (
            "the delivered repository",
            &String::from_utf8_lossy(&git_log.stdout),
        ),
        ("the service logs", logs.as_str()),
    ] {
        let leak = text.lines().find(|line| line.contains(SECRET));
        assert!(leak.is_none(), "the secret leaked into {name}: {leak:?}");
    }
    // Nothing was dead-lettered on the way.
    let dead = cluster.dead_letters().await;
    assert!(dead.is_empty(), "{dead:?}");
    cluster.delete_queues().await;
}
