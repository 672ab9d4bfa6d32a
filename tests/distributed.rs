//! End-to-end tests of the distributed mode: a dispatcher and workers as real processes, a real
//! RabbitMQ, the real Docker engine, and real git repositories. Start the services with
//! `scripts/services.sh` and build the images with `scripts/build-images.sh`.

mod common;

use std::time::Duration;

use common::cluster::{container_count, Cluster, Options};
use common::postgres::TestDatabase;
use common::Fixture;

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

/// Runs a forgepool client command against the cluster's dispatcher, within the API's limit.
async fn client(cluster: &Cluster, args: &[&str]) -> std::process::Output {
    tokio::time::timeout(
        common::cluster::HTTP_LIMIT,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_forgepool"))
            .args(args)
            .env("FORGEPOOL_DISPATCHER_URL", cluster.url())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the forgepool client finished in time")
    .expect("the forgepool client starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_runs_on_three_workers_are_each_delivered_once() {
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 3, 2, None).await;
    let mut ids = Vec::new();
    for n in 1..=30 {
        ids.push(cluster.submit(&format!("LOAD-{n}")).await);
    }
    let views = cluster.wait_terminal(&ids, Duration::from_secs(200)).await;
    for (n, view) in views.iter().enumerate() {
        assert_eq!(
            view["state"],
            "delivered",
            "run {n}: {view}\n{}",
            cluster.logs()
        );
        assert_eq!(
            view["cycles"].as_array().unwrap().len(),
            1,
            "one stored record per cycle: {view}"
        );
        let branch = format!("forge/load-{}", n + 1);
        assert_eq!(
            cluster.pushes(&branch),
            1,
            "{branch} was pushed exactly once"
        );
        assert_eq!(view["result"]["commit"].as_str().unwrap().len(), 40);
    }
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_field_gets_a_4xx_that_names_it() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    let cases: Vec<(&str, serde_json::Value)> = vec![
        ("ticket", serde_json::json!({"ticket": "not-a-ticket"})),
        ("skill", serde_json::json!({"skill": "Bad_Skill"})),
        ("skill", serde_json::json!({"skill": "no-such-skill"})),
        ("step", serde_json::json!({"step": "Bad-Step"})),
        ("brief", serde_json::json!({"brief": ""})),
        (
            "brief",
            serde_json::json!({"brief": "x".repeat(300 * 1024)}),
        ),
        (
            "repository.url",
            serde_json::json!({"repository": {"url": "--upload-pack=x"}}),
        ),
        (
            "repository.ref",
            serde_json::json!({"repository": {"url": "file:///x", "ref": "a..b"}}),
        ),
        (
            "commands[0].argv",
            serde_json::json!({"commands": [{"argv": [], "timeout": 5}]}),
        ),
        (
            "commands[0].timeout",
            serde_json::json!({"commands": [{"argv": ["make"], "timeout": 0}]}),
        ),
        ("repair_attempts", serde_json::json!({"repair_attempts": 4})),
        (
            "agents.implementer",
            serde_json::json!({"agents": {"implementer": "ghost"}}),
        ),
        (
            "assurance.review_agent",
            serde_json::json!({"assurance": {"review_agent": "ghost"}}),
        ),
        ("ticket", serde_json::json!({"ticket": 5})),
    ];
    for (field, extra) in cases {
        let body = cluster.request_body("API-1", extra.clone());
        let response = cluster
            .request(reqwest::Method::POST, "/v1/runs")
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let error: serde_json::Value = response.json().await.unwrap();
        assert!(status.is_client_error(), "{field}: {status} {error}");
        assert_eq!(error["field"], field, "{extra}: {error}");
        assert!(
            error["detail"]
                .as_str()
                .unwrap()
                .contains(field.split('[').next().unwrap()),
            "{error}"
        );
    }
    // Unknown fields, and a body over 1 MiB.
    let mut body = cluster.request_body("API-1", serde_json::json!({}));
    body["colour"] = serde_json::json!("blue");
    let response = cluster
        .request(reqwest::Method::POST, "/v1/runs")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert!(response
        .text()
        .await
        .unwrap()
        .contains("unknown field `colour`"));
    let huge = vec![b' '; 1024 * 1024 + 10];
    let response = cluster
        .request(reqwest::Method::POST, "/v1/runs")
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 413);
    let error: serde_json::Value = response.json().await.unwrap();
    assert_eq!(error["code"], "too_large");
    // Unknown and malformed run ids.
    let response = cluster
        .request(reqwest::Method::GET, "/v1/runs/not-a-uuid")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let response = cluster
        .request(
            reqwest::Method::GET,
            &format!("/v1/runs/{}", uuid::Uuid::new_v4()),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let openapi: serde_json::Value = cluster
        .request(reqwest::Method::GET, "/v1/openapi.json")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(openapi["paths"]["/v1/runs"]["post"].is_object());
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_wrong_token_gets_401() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 0, 1, Some("a-long-enough-test-token")).await;
    let body = cluster.request_body("AUTH-1", serde_json::json!({}));
    let url = format!("{}/v1/runs", cluster.url());
    let response = cluster.http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 401);
    let error: serde_json::Value = response.json().await.unwrap();
    assert_eq!(error["code"], "unauthorized");
    let response = cluster
        .http
        .get(&url)
        .bearer_auth("wrong-token-wrong-token")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let response = cluster
        .request(reqwest::Method::POST, "/v1/runs")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 201);
    let health = cluster
        .http
        .get(format!("{}/healthz", cluster.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "health needs no token");
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_unknown_version_and_oversized_messages_are_dead_lettered() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    // Signed, as if by a dispatcher, so that the worker reads them: each is still refused.
    cluster.publish_signed(b"{not json", None).await;
    cluster
        .publish_signed(br#"{"schema_version": 99, "run_id": "x"}"#, None)
        .await;
    cluster
        .publish_raw("jobs", &vec![b'x'; 5 * 1024 * 1024], None)
        .await;
    let mut invalid = cluster.request_body("bad", serde_json::json!({}));
    invalid["schema_version"] = serde_json::json!(1);
    cluster
        .publish_raw("submissions", &serde_json::to_vec(&invalid).unwrap(), None)
        .await;
    let started = std::time::Instant::now();
    let mut dead = Vec::new();
    while dead.len() < 4 && started.elapsed() < Duration::from_secs(90) {
        dead.extend(cluster.dead_letters().await);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let reasons: Vec<&str> = dead.iter().map(|(_, r)| r.as_str()).collect();
    assert_eq!(dead.len(), 4, "{reasons:?}\n{}", cluster.logs());
    assert!(
        reasons.iter().any(|r| r.contains("malformed JSON")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("unknown schema_version 99")),
        "{reasons:?}"
    );
    assert!(
        reasons.iter().any(|r| r.contains("oversized message")),
        "{reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("refused: ticket: must match")),
        "{reasons:?}"
    );
    // The worker keeps serving.
    let id = cluster.submit("ALIVE-1").await;
    let views = cluster.wait_terminal(&[id], Duration::from_secs(60)).await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_submitted_on_the_submission_queue_is_delivered() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let mut body = cluster.request_body("QUEUE-7", serde_json::json!({}));
    body["schema_version"] = serde_json::json!(1);
    // Through the submit exchange, as a producer with the least permissions would.
    cluster
        .publish_to_exchange("submit", &serde_json::to_vec(&body).unwrap())
        .await;
    let run_id = cluster.run_of_ticket("QUEUE-7").await;
    let views = cluster
        .wait_terminal(&[run_id], Duration::from_secs(60))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    assert_eq!(cluster.pushes("forge/queue-7"), 1);
    cluster.delete_queues().await;
}

/// Catches: two runs of one repository starting together on one worker that corrupt each
/// other through the repository cache (one fetch into the mirror while the other links from
/// it), a cache that is not used (no mirror), or one mirror per run instead of per repository.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runs_of_one_repository_at_once_share_one_mirror() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 2, None).await;
    let (one, two) = tokio::join!(cluster.submit("TWIN-1"), cluster.submit("TWIN-2"));
    let views = cluster
        .wait_terminal(&[one, two], Duration::from_secs(120))
        .await;
    for (n, view) in views.iter().enumerate() {
        assert_eq!(
            view["state"],
            "delivered",
            "run {n}: {}\n{}",
            view["states"],
            cluster.logs()
        );
    }
    assert_eq!(cluster.pushes("forge/twin-1"), 1);
    assert_eq!(cluster.pushes("forge/twin-2"), 1);
    // Both branches hold their own change on the same base.
    let base = common::git(&cluster.fixture.bare, &["rev-parse", "main"]);
    for branch in ["forge/twin-1", "forge/twin-2"] {
        let parent = common::git(&cluster.fixture.bare, &["rev-parse", &format!("{branch}^")]);
        assert_eq!(parent, base, "{branch} is one commit on main");
    }
    let cache = cluster.fixture.dir.path().join("ws-w0").join(".cache");
    let mirrors: Vec<_> = std::fs::read_dir(&cache)
        .unwrap_or_else(|e| panic!("no repository cache at {}: {e}", cache.display()))
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "git"))
        .collect();
    assert_eq!(mirrors.len(), 1, "one mirror for the repository");
    cluster.delete_queues().await;
}

/// Catches: a retried submission (a client that timed out, a producer that published twice)
/// that creates a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_submission_with_the_same_key_makes_one_run() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    let post = |key: &'static str| {
        cluster
            .request(reqwest::Method::POST, "/v1/runs")
            .header("Idempotency-Key", key)
            .json(&cluster.request_body("ONCE-1", serde_json::json!({})))
            .send()
    };
    let first = post("order-17").await.unwrap();
    assert_eq!(first.status(), 201);
    let first: serde_json::Value = first.json().await.unwrap();
    let again = post("order-17").await.unwrap();
    assert_eq!(again.status(), 200, "a repeat creates nothing");
    let again: serde_json::Value = again.json().await.unwrap();
    assert_eq!(again["run_id"], first["run_id"]);
    let other = post("order-18").await.unwrap();
    assert_eq!(other.status(), 201);
    let other: serde_json::Value = other.json().await.unwrap();
    assert_ne!(
        other["run_id"], first["run_id"],
        "another key is another run"
    );
    let bad = post("with space").await.unwrap();
    assert_eq!(bad.status(), 400);
    let body: serde_json::Value = bad.json().await.unwrap();
    assert_eq!(body["field"], "Idempotency-Key", "{body}");
    // The key of a run, with another request: refused, and no run is made or shown. An
    // invalid request is refused as invalid, key or not (schemathesis's ST201 found a
    // schema-breaking request answered 200 with the key's first run).
    let send = |body: serde_json::Value| {
        cluster
            .request(reqwest::Method::POST, "/v1/runs")
            .header("Idempotency-Key", "order-17")
            .json(&body)
            .send()
    };
    let changed = send(cluster.request_body("ONCE-1", serde_json::json!({"brief": "another"})));
    let changed = changed.await.unwrap();
    assert_eq!(changed.status(), 422);
    let body: serde_json::Value = changed.json().await.unwrap();
    assert_eq!(body["field"], "Idempotency-Key", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("another request"),
        "{body}"
    );
    let invalid = send(cluster.request_body("ONCE-1", serde_json::json!({"brief": ""})));
    let invalid = invalid.await.unwrap();
    assert!(
        [400, 422].contains(&invalid.status().as_u16()),
        "{invalid:?}"
    );
    let body: serde_json::Value = invalid.json().await.unwrap();
    assert_eq!(body["field"], "brief", "{body}");
    assert_eq!(
        cluster.runs_of_ticket("ONCE-1").await.len(),
        2,
        "order-17's run and order-18's, nothing more"
    );

    // The same on the submission queue, by message_id.
    let mut request = cluster.request_body("ONCE-2", serde_json::json!({}));
    request["schema_version"] = serde_json::json!(1);
    let payload = serde_json::to_vec(&request).unwrap();
    cluster.submit_message(&payload, "msg-1").await;
    cluster.submit_message(&payload, "msg-1").await;
    // The consumer takes messages in order: once a later message's run exists, both copies
    // of msg-1 were handled.
    let mut later = cluster.request_body("ONCE-3", serde_json::json!({}));
    later["schema_version"] = serde_json::json!(1);
    cluster
        .submit_message(&serde_json::to_vec(&later).unwrap(), "msg-2")
        .await;
    cluster.run_of_ticket("ONCE-3").await;
    let runs = cluster.runs_of_ticket("ONCE-2").await;
    assert_eq!(runs.len(), 1, "msg-1 sent twice made one run: {runs:?}");
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_run_loses_nothing_and_leaves_no_container() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "6"], &["approve"]);
    let mut cluster = Cluster::start(fixture, 1, 1, None).await;
    let id = cluster.submit("KILL-1").await;
    // Wait until the implementer container runs, then kill the worker outright.
    let started = std::time::Instant::now();
    loop {
        let view = cluster.run(&id).await;
        if view["state"] == "running" && container_count(&id) > 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the run never started\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.workers[0].kill();
    cluster.start_worker("second", 1);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    assert_eq!(
        views[0]["cycles"].as_array().unwrap().len(),
        1,
        "no duplicate cycle record"
    );
    assert_eq!(cluster.pushes("forge/kill-1"), 1, "one delivery commit");
    // The killed worker's container is removed by the survivor within a bounded time.
    let started = std::time::Instant::now();
    while container_count(&id) > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(75),
            "a container of the killed worker remains"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_restart_keeps_runs_and_events_and_records_runs_in_flight() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "4"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    dispatcher_restart_keeps_runs(cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_on_postgres_keeps_runs_and_events_across_a_restart() {
    let database = TestDatabase::create().await;
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "4"], &["approve"]);
    let options = Options {
        database: Some(database.url.clone()),
        ..Options::default()
    };
    let cluster = Cluster::start_with(fixture, 1, 1, None, options).await;
    dispatcher_restart_keeps_runs(cluster).await;
    database.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_the_broker_gives_up_on_fails_its_run() {
    let fixture = Fixture::new(None, &["change"], &[]);
    // No worker: the test itself plays a worker that crashes on the job every time.
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    let run_id = cluster.submit("GIVEUP-1").await;
    let broker = cluster.broker().await;
    let channel = broker.create_channel().await.unwrap();
    let jobs = format!("{}.jobs", cluster.prefix);
    let mut deliveries = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let message = channel
            .basic_get(
                jobs.as_str().into(),
                lapin::options::BasicGetOptions::default(),
            )
            .await
            .unwrap();
        let Some(message) = message else {
            if deliveries > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        deliveries += 1;
        message
            .delivery
            .nack(lapin::options::BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert!(
        deliveries > 5,
        "the broker dead-letters after its delivery limit, not before ({deliveries} deliveries)"
    );
    let (view, reason) = cluster.wait_one(&run_id, Duration::from_secs(30)).await;
    assert_eq!(view["state"], "failed", "{}", cluster.logs());
    assert!(
        reason.contains("dead-lettered") && reason.contains("delivery_limit"),
        "the reason says what happened: {reason}"
    );
    let dead = cluster.dead_letters().await;
    assert!(
        dead.iter()
            .any(|(body, _)| String::from_utf8_lossy(body).contains(&run_id)),
        "the job itself is kept in the dead-letter queue"
    );
    cluster.delete_queues().await;
}

async fn dispatcher_restart_keeps_runs(mut cluster: Cluster) {
    let done = cluster.submit("KEEP-1").await;
    cluster
        .wait_terminal(std::slice::from_ref(&done), Duration::from_secs(60))
        .await;
    let before = cluster.run(&done).await;
    let in_flight = cluster.submit("KEEP-2").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let code = cluster
        .dispatcher
        .as_mut()
        .unwrap()
        .terminate(Duration::from_secs(15));
    assert_eq!(
        code,
        Some(0),
        "the dispatcher shuts down cleanly on SIGTERM\n{}",
        cluster.logs()
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.start_dispatcher();
    let after = cluster.run(&done).await;
    assert_eq!(before, after, "a stored run is intact after a restart");
    let views = cluster
        .wait_terminal(std::slice::from_ref(&in_flight), Duration::from_secs(60))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    let states = common::cluster::state_names(&views[0]);
    assert_eq!(
        states,
        ["queued", "running", "delivered"],
        "events sent while the dispatcher was down were recorded"
    );
    assert_eq!(cluster.pushes("forge/keep-2"), 1, "delivered once");
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_submit_wait_status_and_cancel() {
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let file = cluster.fixture.dir.path().join("request.json");
    std::fs::write(
        &file,
        serde_json::to_vec(&cluster.request_body("CLI-1", serde_json::json!({}))).unwrap(),
    )
    .unwrap();
    let output = client(&cluster, &["submit", file.to_str().unwrap(), "--wait"]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("Review cycle 1/2: APPROVED"), "{stdout}");
    let run_id = stdout
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .to_string();
    let status = client(&cluster, &["status", &run_id]).await;
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains(": delivered") && text.contains("delivered forge/cli-1"),
        "{text}"
    );
    assert!(
        text.contains("repair budget 2, implementation rounds")
            && text.contains("round 1 (initial): tree "),
        "the budget, the rounds and their history are shown: {text}"
    );
    let cancel = client(&cluster, &["cancel", &run_id]).await;
    assert_eq!(
        cancel.status.code(),
        Some(2),
        "a finished run cannot be cancelled"
    );
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_running_run_stops_its_container() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "60"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let id = cluster.submit("STOP-1").await;
    cluster.wait_running(&id).await;
    assert_eq!(cluster.cancel(&id).await.0, 202);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(30))
        .await;
    assert_eq!(views[0]["state"], "cancelled", "{}", cluster.logs());
    assert_eq!(
        container_count(&id),
        0,
        "the container was stopped and removed"
    );
    cluster.delete_queues().await;
}

/// Catches: a cancel that is lost when no worker hears it (the run is queued, or between
/// workers): the worker that takes the job later learns it from the store and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_no_worker_heard_still_stops_the_worker_that_takes_the_run() {
    let fixture = Fixture::new(Some(REVIEW), &["sleep", "30"], &["approve"]);
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let id = cluster.submit("LATE-1").await;
    let (status, body) = cluster.cancel(&id).await;
    assert_eq!(status, 202);
    assert_eq!(body["cancel"], "done", "a queued run is cancelled at once");
    assert_eq!(cluster.run(&id).await["state"], "cancelled");
    // The job is still on the queue; the worker that takes it asks the store, which says the
    // run is cancelled, and drops the job unrun (its stage would be 30 s long).
    cluster.start_worker("late", 1);
    let started = std::time::Instant::now();
    while !cluster
        .logs()
        .contains("the run is cancelled in the dispatcher's store")
    {
        assert!(
            started.elapsed() < Duration::from_secs(25),
            "the worker did not drop the run\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stream = cluster.event_stream(&id).await;
    assert!(
        !stream.contains("stage_started"),
        "no stage started: {stream}"
    );
    assert_eq!(
        container_count(&id),
        0,
        "no container is left\n{}",
        cluster.logs()
    );
    assert_eq!(common::cluster::jobs_on_broker(&cluster.prefix), 0);
    let view = cluster.run(&id).await;
    assert_eq!(view["state"], "cancelled", "{view}");
    assert_eq!(
        cluster.pushes("forge/late-1"),
        0,
        "a cancelled run never delivers"
    );
    cluster.delete_queues().await;
}

/// Catches: cancelling a paused run that answers 202 and changes nothing, or a cancelled run
/// that can still be resumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_paused_run_ends_it_at_once() {
    let fixture = Fixture::new(Some(REVIEW), &["pause-at", "1"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let id = cluster.submit("HALT-1").await;
    wait_state(&cluster, &id, "paused").await;
    let (status, body) = cluster.cancel(&id).await;
    assert_eq!(status, 202);
    assert_eq!(body["cancel"], "done");
    let view = cluster.run(&id).await;
    assert_eq!(view["state"], "cancelled", "{view}");
    let resume = cluster
        .request(reqwest::Method::POST, &format!("/v1/runs/{id}/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(resume.status(), 409, "a cancelled run is not resumed");
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_run_frees_its_slot_and_resumes_on_another_worker_with_its_budget() {
    // Round 1 is implemented and rejected; the provider pauses round 2 until PROVIDER_READY.
    let fixture = Fixture::new(Some(REVIEW), &["pause-at", "2"], &["rules"]);
    let agents = std::fs::read_to_string(&fixture.agents).unwrap().replacen(
        "env = [\"AGENT_SECRET\"]",
        "env = [\"AGENT_SECRET\", \"PROVIDER_READY\"]",
        1,
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    // The dispatcher freezes a repair budget of 1 at submission.
    let options = Options {
        env: vec![("FORGE_REPAIR_ATTEMPTS".into(), "1".into())],
        ..Options::default()
    };
    let mut cluster = Cluster::start_with(fixture, 1, 1, None, options).await;
    let first = cluster.submit("PAUSE-1").await;
    let views = wait_state(&cluster, &first, "paused").await;
    assert!(views["states"].to_string().contains("429 rate limited"));

    // The one slot is free again: another run is taken while the first stays paused.
    let second = cluster.submit("PAUSE-2").await;
    wait_state(&cluster, &second, "paused").await;
    let watch = common::output_within(
        std::process::Command::new(env!("CARGO_BIN_EXE_forgepool"))
            .args(["watch", &first])
            .env("FORGEPOOL_DISPATCHER_URL", cluster.url()),
        common::cluster::HTTP_LIMIT,
    );
    assert_eq!(
        watch.status.code(),
        Some(75),
        "watching a paused run ends with 75"
    );
    assert!(String::from_utf8_lossy(&watch.stdout).contains("forgepool resume"));

    // A new worker, with the provider back and a higher budget in its environment, takes
    // the resumed run.
    cluster.workers[0].terminate(Duration::from_secs(15));
    cluster.start_worker_with(
        "w1",
        1,
        &[("PROVIDER_READY", "yes"), ("FORGE_REPAIR_ATTEMPTS", "3")],
    );
    let resume = client(&cluster, &["resume", &first, "--wait"]).await;
    let printed = String::from_utf8_lossy(&resume.stdout).to_string();
    assert_eq!(
        resume.status.code(),
        Some(0),
        "{printed}\n{}",
        cluster.logs()
    );
    assert!(
        printed.contains("resumed from checkpoint 1")
            && printed.contains("Review cycle 2/2: APPROVED"),
        "{printed}"
    );
    let view = cluster.run(&first).await;
    assert_eq!(view["state"], "delivered");
    assert_eq!(
        view["repair_budget"], 1,
        "neither the environment nor the resume raised it"
    );
    assert_eq!(
        view["implementation_rounds"], 2,
        "the paused round was not spent"
    );
    assert_eq!(view["cycles"].as_array().unwrap().len(), 2);
    let states = common::cluster::state_names(&view);
    assert_eq!(
        states,
        [
            "queued",
            "running",
            "paused",
            "queued",
            "running",
            "delivered"
        ]
    );
    assert_eq!(cluster.pushes("forge/pause-1"), 1);

    // Only a paused run can be resumed.
    let again = cluster
        .request(reqwest::Method::POST, &format!("/v1/runs/{first}/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
    let body: serde_json::Value = again.json().await.unwrap();
    assert_eq!(body["code"], "not_paused");
    cluster.delete_queues().await;
}

async fn wait_state(cluster: &Cluster, run_id: &str, state: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let view = cluster.run(run_id).await;
        if view["state"] == state {
            return view;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "run {run_id} never became {state}: {view}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_the_final_review_leaves_an_unknown_outcome_not_a_second_review() {
    let fixture = Fixture::new(None, &["change"], &["approve"]).with_final_reviewer("hang");
    let mut cluster = Cluster::start(fixture, 2, 1, None).await;
    let run_id = cluster
        .submit_with(
            "LOST-1",
            serde_json::json!({"assurance": {"review_agent": "final"}}),
        )
        .await;
    // Find the worker whose final reviewer is running, and kill it.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let worker = loop {
        let output = common::output_within(
            std::process::Command::new("docker").args([
                "ps",
                "--filter",
                &format!("label=forgepool.run_id={run_id}"),
                "--filter",
                "label=forgepool.stage=final_review",
                "--format",
                "{{.Label \"forgepool.worker\"}}",
            ]),
            common::COMMAND_LIMIT,
        );
        let found = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if !found.is_empty() {
            break found;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the final review never started\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let index = if worker.ends_with("-w0") { 0 } else { 1 };
    cluster.workers[index].kill();

    let (view, reason) = cluster.wait_one(&run_id, Duration::from_secs(90)).await;
    assert_eq!(view["state"], "blocked", "{}", cluster.logs());
    assert!(
        reason.contains("unknown outcome") && reason.contains("submit a new run"),
        "the state says what happened and what to do: {reason}"
    );
    assert_eq!(view["result"]["review"], "unknown");
    let events = cluster.event_stream(&run_id).await;
    let reviews = events
        .lines()
        .filter(|l| l.contains("\"type\":\"stage_started\"") && l.contains("\"final_review\""))
        .count();
    assert_eq!(reviews, 1, "the final review was not repeated");
    assert!(cluster.pushes("forge/lost-1") == 0, "nothing was delivered");
    // The dead worker's reviewer container is removed by the survivor.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while container_count(&run_id) > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the dead worker's containers were not removed"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_review_ledger_on_the_broker_keeps_intents_and_receipts() {
    use worker::amqp::AmqpLedger;
    use worker::ports::ledger::{Receipt, ReviewLedger};
    use worker::review::final_report::FinalReport;

    common::cluster::require_rabbitmq();
    let url = common::cluster::AMQP_URL;
    let topology = proto::amqp::Topology::new(format!(
        "ledger{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    let publisher = std::sync::Arc::new(proto::amqp::Publisher::new(url, "ledger-test").unwrap());
    let key = proto::JobKey::new("ledger-test-key-0123456789abcdef").unwrap();
    let ledger = AmqpLedger::new(
        url,
        topology.clone(),
        std::sync::Arc::clone(&publisher),
        key.clone(),
    );
    let run = uuid::Uuid::new_v4().to_string();
    assert_eq!(ledger.lookup(&run).await.unwrap().unknown_outcome(), None);
    ledger.intent(&run, "tree-a").await.unwrap();
    // Another worker, with connections of its own, sees it.
    let other = AmqpLedger::new(
        url,
        topology.clone(),
        std::sync::Arc::clone(&publisher),
        key.clone(),
    );
    assert_eq!(
        other.lookup(&run).await.unwrap().unknown_outcome(),
        Some("tree-a")
    );
    assert_eq!(
        other.lookup(&run).await.unwrap().unknown_outcome(),
        Some("tree-a"),
        "reading leaves the intent in place"
    );
    let receipt = Receipt {
        schema_version: proto::SCHEMA_VERSION,
        tree: "tree-a".into(),
        report: FinalReport {
            approved: true,
            summary: "fine".into(),
            findings: Vec::new(),
        },
    };
    ledger.receipt(&run, &receipt).await.unwrap();
    let entry = other.lookup(&run).await.unwrap();
    assert_eq!(entry.unknown_outcome(), None);
    assert_eq!(entry.receipt_for("tree-a"), Some(&receipt));
    ledger.intent(&run, "tree-b").await.unwrap();
    ledger.clear(&run).await.unwrap();
    let entry = other.lookup(&run).await.unwrap();
    assert_eq!(
        entry.unknown_outcome(),
        None,
        "a known outcome clears the intent"
    );
    assert_eq!(
        entry.receipt_for("tree-a"),
        Some(&receipt),
        "the receipt stays"
    );
    // Catches: a ledger that trusts what anyone with broker access writes. An intent written
    // unsigned, or signed with another key, is not read back (it would block the run), and
    // neither is a receipt moved from another run's queue.
    let forger = AmqpLedger::new(
        url,
        topology.clone(),
        std::sync::Arc::clone(&publisher),
        proto::JobKey::new("not-the-cluster-key-0123456789ab").unwrap(),
    );
    let forged = uuid::Uuid::new_v4().to_string();
    forger.intent(&forged, "tree-x").await.unwrap();
    assert_eq!(ledger.lookup(&forged).await.unwrap().intent, None);
    publisher
        .publish("", &topology.review_intent(&forged), b"tree-y", None)
        .await
        .unwrap();
    assert_eq!(ledger.lookup(&forged).await.unwrap().intent, None);
    let moved = uuid::Uuid::new_v4().to_string();
    ledger.receipt(&moved, &receipt).await.unwrap();
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            topology.review_receipt(&forged).into(),
            lapin::options::QueueDeclareOptions::default(),
            Default::default(),
        )
        .await
        .unwrap();
    // `moved`'s genuine receipt message, signature and all, copied into `forged`'s queue.
    let genuine = channel
        .basic_get(
            topology.review_receipt(&moved).into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the receipt is kept");
    let signature = proto::amqp::header_text(&genuine.delivery.properties, proto::SIGNATURE_HEADER)
        .expect("ledger messages are signed");
    for queue in [
        topology.review_receipt(&forged),
        topology.review_receipt(&moved),
    ] {
        publisher
            .publish(
                "",
                &queue,
                &genuine.delivery.data,
                Some(proto::amqp::signature_headers(signature.clone())),
            )
            .await
            .unwrap();
    }
    assert_eq!(ledger.lookup(&forged).await.unwrap().receipt, None);
    assert_eq!(
        ledger.lookup(&moved).await.unwrap().receipt,
        Some(receipt.clone()),
        "the genuine receipt is read"
    );
    // Clean up the test's queues.
    for run in [&run, &forged, &moved] {
        for queue in [topology.review_intent(run), topology.review_receipt(run)] {
            let _ = channel.queue_delete(queue.into(), Default::default()).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_submitted_before_rabbitmq_is_reachable_is_delivered_once_it_is() {
    common::cluster::require_rabbitmq();
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let free_port = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    // The dispatcher's broker is a port where nothing listens yet.
    let (http_port, broker_port) = (free_port(), free_port());
    let prefix = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let started = tokio::time::Instant::now();
    let (mut dispatcher, log) = bare_dispatcher(
        &fixture,
        &format!("127.0.0.1:{http_port}"),
        &format!("amqp://guest:guest@127.0.0.1:{broker_port}/%2f"),
        &prefix,
    );
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let base = format!("http://127.0.0.1:{http_port}");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let ready = loop {
        match http.get(format!("{base}/readyz")).send().await {
            Ok(response) => break response,
            Err(error) if std::time::Instant::now() < deadline && error.is_connect() => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(error) => panic!("/readyz did not answer: {error}\n{}", logged()),
        }
    };
    // The API answers while the dispatcher cannot set up its queues.
    assert_eq!(ready.status(), 503, "not ready without its queues");
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(body["broker"], false, "{body}");
    assert_eq!(body["store"], true, "{body}");
    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200, "alive while it retries");
    // A submission is accepted at once (the client gives up after 5 s) and stored.
    let request = serde_json::json!({
        "ticket": "EARLY-1", "skill": "implement-task", "brief": "Add the feature",
        "repository": {"url": format!("file://{}", fixture.bare.display()), "ref": "main"}
    });
    let created = http
        .post(format!("{base}/v1/runs"))
        .json(&request)
        .send()
        .await
        .unwrap_or_else(|e| panic!("the submission did not answer in time: {e}\n{}", logged()));
    assert_eq!(created.status(), 201, "{}", logged());
    let run_id = created.json::<serde_json::Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_string();
    let run = |http: reqwest::Client| {
        let url = format!("{base}/v1/runs/{run_id}");
        async move {
            http.get(url)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()
        }
    };
    assert_eq!(run(http.clone()).await["state"], "queued");
    // The first failed attempt is logged once it has failed (a loaded machine takes a moment).
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !logged().contains("cannot set up RabbitMQ yet; retrying")
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        logged().contains("cannot set up RabbitMQ yet; retrying"),
        "the retries are logged: {}",
        logged()
    );

    // It never gives up on the broker: past the 30 one-second attempts after which it once
    // exited (and crash-looped in a pod), it is still there, alive and not ready.
    tokio::time::sleep_until(started + Duration::from_secs(40)).await;
    assert!(
        matches!(dispatcher.child.try_wait(), Ok(None)),
        "the dispatcher waits for RabbitMQ instead of exiting: {}",
        logged()
    );
    let still = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(still.status(), 503, "not ready while RabbitMQ is away");

    // RabbitMQ becomes reachable on that port, and a worker joins.
    let forwarder = tokio::net::TcpListener::bind(("127.0.0.1", broker_port))
        .await
        .unwrap();
    let forwarding = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = forwarder.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect("127.0.0.1:5672").await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    let worker_log = fixture.dir.path().join("worker.log");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_forgepool"));
    command
        .arg("worker")
        .args(["--metrics-addr", "127.0.0.1:0", "--drain-seconds", "5"])
        .args(["--worker-id", &format!("{prefix}-w0")])
        .arg("--workspace")
        .arg(fixture.dir.path().join("ws"))
        .arg("--agents")
        .arg(&fixture.agents)
        .env("FORGEPOOL_JOB_KEY", common::cluster::JOB_KEY)
        .env("FORGEPOOL_AMQP_URL", common::cluster::AMQP_URL)
        .env("FORGEPOOL_AMQP_PREFIX", &prefix)
        .env("FORGEPOOL_ALLOWED_URL_SCHEMES", "https,ssh,file")
        .env("AGENT_SECRET", "sk-test-0123456789abcdef")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&worker_log).unwrap());
    let mut worker = common::cluster::spawn(command, worker_log.clone(), "listening on ");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let view = loop {
        let view = run(http.clone()).await;
        let state = view["state"].as_str().unwrap_or_default().to_string();
        if state == "delivered" || std::time::Instant::now() > deadline {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(
        view["state"],
        "delivered",
        "the stored run was published once the queues existed: {}\n{}\n{}",
        view["states"],
        logged(),
        std::fs::read_to_string(&worker_log).unwrap_or_default()
    );
    let ready = http.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200, "ready once it consumes events");
    let worker_ready = http
        .get(format!("http://{}/readyz", worker.address))
        .send()
        .await
        .unwrap();
    assert_eq!(worker_ready.status(), 200, "a connected worker is ready");

    // SIGTERM stops the dispatcher at once, even while a client follows a run that is not
    // finished (no worker is left to take it): the event stream ends.
    worker.terminate(Duration::from_secs(15));
    let second = http
        .post(format!("{base}/v1/runs"))
        .json(&serde_json::json!({
            "ticket": "EARLY-2", "skill": "implement-task", "brief": "Add the feature",
            "repository": {"url": format!("file://{}", fixture.bare.display()), "ref": "main"}
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 201);
    let second = second.json::<serde_json::Value>().await.unwrap()["run_id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut stream = http
        .get(format!("{base}/v1/runs/{second}/events"))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert!(
        stream.chunk().await.unwrap().is_some(),
        "the stream is open"
    );
    // Less than the 15 s the server would give a request that did not end by itself.
    let code = dispatcher.terminate(Duration::from_secs(10));
    while let Ok(Some(_)) = stream.chunk().await {}
    assert_eq!(code, Some(0), "stopped within 10 s:\n{}", logged());
    forwarding.abort();
    common::cluster::delete_prefix_queues(&prefix).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_dispatcher_that_cannot_set_up_rabbitmq() {
    // Nothing listens on port 1: the dispatcher keeps trying to set up its queues.
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let (mut dispatcher, log) = bare_dispatcher(
        &fixture,
        "127.0.0.1:0",
        "amqp://guest:guest@127.0.0.1:1/%2f",
        "forgepool",
    );
    let logged = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !logged().contains("cannot set up RabbitMQ yet; retrying") {
        assert!(
            std::time::Instant::now() < deadline,
            "no retry was logged:\n{}",
            logged()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let code = dispatcher.terminate(Duration::from_secs(10));
    assert_eq!(
        code,
        Some(0),
        "stopped cleanly during the setup:\n{}",
        logged()
    );
}

/// A dispatcher process on `listen` with the fixture's skills, agents and store, using the
/// broker at `amqp_url` under `prefix`. It is not waited on: its ready line needs the broker.
fn bare_dispatcher(
    fixture: &Fixture,
    listen: &str,
    amqp_url: &str,
    prefix: &str,
) -> (common::cluster::Service, std::path::PathBuf) {
    let log = fixture.dir.path().join("dispatcher.log");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_forgepool"))
        .args(["dispatcher", "--listen", listen])
        .arg("--skills")
        .arg(&fixture.skills)
        .arg("--agents")
        .arg(&fixture.agents)
        .arg("--database")
        .arg(fixture.dir.path().join("runs.db"))
        .env("FORGEPOOL_AMQP_URL", amqp_url)
        .env("FORGEPOOL_AMQP_PREFIX", prefix)
        .env("FORGEPOOL_JOB_KEY", common::cluster::JOB_KEY)
        .env("FORGEPOOL_ALLOWED_URL_SCHEMES", "https,ssh,file")
        .env("FORGEPOOL_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let service = common::cluster::Service {
        child,
        address: listen.to_string(),
        log: log.clone(),
    };
    (service, log)
}

/// Jobs that did not come from the dispatcher, or that ask for what the worker's own agents
/// file does not give, are dead-lettered with their reason; none runs, and a forged job that
/// names a real run does not end that run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_unsigned_and_overreaching_jobs_are_dead_lettered_and_run_nothing() {
    use dispatcher::store::RunStore;
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    // No worker yet: the real run waits in the queue with the forgeries.
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let real = cluster.submit("REAL-1").await;
    let store = dispatcher::store::SqliteStore::open(&cluster.database).unwrap();
    let record = store
        .get_run(uuid::Uuid::parse_str(&real).unwrap())
        .await
        .unwrap()
        .unwrap();
    let forged = |change: &dyn Fn(&mut proto::Job)| {
        let mut job = record.job.clone();
        job.run_id = uuid::Uuid::new_v4();
        job.ticket = "FORGED-1".into();
        job.project = "forged".into();
        change(&mut job);
        serde_json::to_vec(&job).unwrap()
    };
    // Unsigned, and naming the real run: it must not fail it.
    let mut same_run = record.job.clone();
    same_run.implementer.user = Some("0:0".into());
    cluster
        .publish_raw("jobs", &serde_json::to_vec(&same_run).unwrap(), None)
        .await;
    cluster
        .publish_signed(&forged(&|_| {}), Some("a-key-the-dispatcher-never-had"))
        .await;
    cluster
        .publish_signed(&forged(&|j| j.implementer.user = Some("0:0".into())), None)
        .await;
    cluster
        .publish_signed(
            &forged(&|j| j.implementer.env = vec!["FORGEPOOL_JOB_KEY".into()]),
            None,
        )
        .await;
    cluster
        .publish_signed(
            &forged(&|j| j.implementer.image = "evil/agent:1".into()),
            None,
        )
        .await;
    cluster
        .publish_signed(&forged(&|j| j.ticket = "../../etc-1".into()), None)
        .await;
    cluster
        .publish_signed(
            &forged(&|j| j.repository.url = "ext::sh -c id".into()),
            None,
        )
        .await;
    cluster.start_worker("w0", 1);
    let started = std::time::Instant::now();
    let mut dead = Vec::new();
    while dead.len() < 7 && started.elapsed() < Duration::from_secs(90) {
        dead.extend(cluster.dead_letters().await);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let reasons: Vec<&str> = dead.iter().map(|(_, r)| r.as_str()).collect();
    assert_eq!(dead.len(), 7, "{reasons:?}\n{}", cluster.logs());
    for expected in [
        "the job is not signed",
        "signature does not match",
        "is root; stages never run as root",
        "env \"FORGEPOOL_JOB_KEY\" is not allowed",
        "differs from this worker's agents file in: image",
        "ticket \"../../etc-1\" must match",
        "scheme `ext`",
    ] {
        assert!(
            reasons.iter().any(|r| r.contains(expected)),
            "no dead letter says {expected:?}: {reasons:?}"
        );
    }
    // The real run went through, and nothing of the forgeries was pushed.
    let views = cluster
        .wait_terminal(std::slice::from_ref(&real), Duration::from_secs(60))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    assert!(cluster.fixture.branch_files("forge/forged-1").is_none());
    cluster.delete_queues().await;
}

/// Catches: lost executions the store never counts (a job that kills every worker it reaches
/// circulates until a worker's own backstop), a limit the dispatcher does not apply, and a run
/// failed by the count that still executes (a container, a push). The copy below says what a
/// job's tenth loss makes it say; the dispatcher's store, not the broker, fails the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_execution_was_lost_ten_times_is_failed_by_the_store() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    // No worker yet: the job is taken off the queue and put back as a copy lost ten times.
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let run = cluster.submit("LOST-10").await;
    let (job, signature) = cluster.take_job().await;
    cluster
        .publish_lost_copy(&job, &signature, proto::MAX_LOST_EXECUTIONS)
        .await;
    cluster.start_worker("w0", 1);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&run), Duration::from_secs(90))
        .await;
    assert_eq!(views[0]["state"], "failed", "{}", cluster.logs());
    let reason = views[0]["states"].to_string();
    assert!(
        reason.contains("the run's execution was lost 10 times"),
        "{reason}"
    );
    assert_eq!(cluster.pushes("forge/lost-10"), 0, "nothing delivered");
    assert_eq!(container_count(&run), 0, "no stage ran");
    assert!(
        cluster.dead_letters().await.is_empty(),
        "failed by the store, not dead-lettered"
    );
    assert_eq!(common::cluster::jobs_on_broker(&cluster.prefix), 0);
    cluster.delete_queues().await;
}

/// A copy of a finished run's signed job, replayed once its done marker is gone, runs nothing:
/// the store says the run is delivered, so the worker drops the copy unrun. No push, no event,
/// no change of state. The same copy past its expiry (re-signed here, as only the dispatcher
/// could) is dead-lettered with the reason, and the run is still delivered.
/// Catches: a worker whose only guard against a replay is the done marker on the broker (an
/// hour's TTL, and any broker user may delete it): the copy ran the implementer and the
/// reviewer again, pushed again and added a second result to the delivered run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_runs_job_replayed_after_its_marker_is_gone_runs_nothing() {
    use dispatcher::store::RunStore;
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    // No worker yet: the job is copied off the queue first, then put back.
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let run = cluster.submit("REPLAY-1").await;
    let (job, signature) = cluster.take_job().await;
    cluster.publish_copy(&job, &signature).await;
    cluster.start_worker("w0", 1);
    let views = cluster
        .wait_terminal(std::slice::from_ref(&run), Duration::from_secs(90))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    let branch = "forge/replay-1";
    assert_eq!(cluster.pushes(branch), 1);
    let store = dispatcher::store::SqliteStore::open(&cluster.database).unwrap();
    let run_id = uuid::Uuid::parse_str(&run).unwrap();
    let events = store.events(run_id, 0).await.unwrap().len();

    // The replay, once the marker is gone.
    cluster.delete_queue(&format!("done.{run}")).await;
    cluster.publish_copy(&job, &signature).await;
    let started = std::time::Instant::now();
    // Until the worker dropped it, or it ran (events, a push).
    while !cluster
        .logs()
        .contains("not live in the dispatcher's store")
        && cluster.pushes(branch) == 1
        && store.events(run_id, 0).await.unwrap().len() == events
    {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the worker never took the replay: {}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(cluster.pushes(branch), 1, "the replay pushed again");
    assert_eq!(
        store.events(run_id, 0).await.unwrap().len(),
        events,
        "the replay ran: {}",
        cluster.logs()
    );
    assert!(
        cluster
            .logs()
            .contains("the run is delivered in the dispatcher's store"),
        "{}",
        cluster.logs()
    );
    assert_eq!(common::cluster::jobs_on_broker(&cluster.prefix), 0);

    // The same copy, expired.
    let mut expired: proto::Job = serde_json::from_slice(&job).unwrap();
    let publication = expired
        .publication
        .as_mut()
        .expect("a published job has one");
    publication.expires_at = "2020-01-01T00:00:00Z".into();
    let expired = serde_json::to_vec(&expired).unwrap();
    cluster.publish_signed(&expired, None).await;
    let mut dead = Vec::new();
    let started = std::time::Instant::now();
    while dead.is_empty() && started.elapsed() < Duration::from_secs(60) {
        dead.extend(cluster.dead_letters().await);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(dead.len(), 1, "{}", cluster.logs());
    assert!(dead[0].1.contains("expired at 2020-01-01"), "{}", dead[0].1);

    // Host-side evidence: nothing ran again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(cluster.pushes(branch), 1, "the replay pushed again");
    assert_eq!(
        store.events(run_id, 0).await.unwrap().len(),
        events,
        "the replay added events to the finished run"
    );
    let view = cluster.run(&run).await;
    assert_eq!(view["state"], "delivered");
    assert_eq!(container_count(&run), 0);
    cluster.delete_queues().await;
}

/// A producer with exactly the permissions the chart gives its producer user (write to the
/// submit exchange, its own reply queues) submits runs, and cannot publish to the jobs queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_with_the_charts_permissions_submits_runs_and_nothing_else() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let user = format!("{}-producer", cluster.prefix);
    let password = "producer-password-0123456789";
    let rabbitmqctl = |args: &[&str]| {
        let output = common::output_within(
            std::process::Command::new("rabbitmqctl").args(args),
            common::COMMAND_LIMIT,
        );
        assert!(
            output.status.success(),
            "rabbitmqctl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    rabbitmqctl(&["-q", "add_user", &user, password]);
    let write = format!("^{}\\.submit$", cluster.prefix);
    rabbitmqctl(&[
        "-q",
        "set_permissions",
        "-p",
        "/",
        &user,
        "^amq\\.gen-.*",
        &write,
        "^amq\\.gen-.*",
    ]);
    let url = format!("amqp://{user}:{password}@127.0.0.1:5672/%2f");
    let properties = lapin::ConnectionProperties::default();
    let connection = lapin::Connection::connect(&url, properties).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(lapin::options::ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut body = cluster.request_body("PRODUCER-1", serde_json::json!({}));
    body["schema_version"] = serde_json::json!(1);
    channel
        .basic_publish(
            format!("{}.submit", cluster.prefix).into(),
            "".into(),
            lapin::options::BasicPublishOptions::default(),
            &serde_json::to_vec(&body).unwrap(),
            lapin::BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    // The jobs queue, by name through the default exchange: refused by the broker.
    let forged = channel
        .basic_publish(
            "".into(),
            format!("{}.jobs", cluster.prefix).into(),
            lapin::options::BasicPublishOptions::default(),
            br#"{"schema_version": 1}"#,
            lapin::BasicProperties::default(),
        )
        .await;
    let refused = match forged {
        Err(_) => true,
        Ok(confirm) => confirm.await.is_err(),
    };
    assert!(refused, "the producer published to the jobs queue");
    let _ = connection.close(200, "bye".into()).await;
    let run_id = cluster.run_of_ticket("PRODUCER-1").await;
    let views = cluster
        .wait_terminal(&[run_id], Duration::from_secs(60))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    rabbitmqctl(&["-q", "delete_user", &user]);
    cluster.delete_queues().await;
}

/// Catches: a SIGTERMed worker (scale-in, a rollout) that stops the stage it runs, or hands
/// back a run whose last stage ends within the drain time, so another worker runs it again.
/// No other worker exists: a delivered run was finished by the drained one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_waits_for_the_running_stage_and_hands_nothing_back_when_it_ends_in_time() {
    // One stage of about 3 s, no review: after it only the delivery is left.
    let fixture = Fixture::new(None, &["sleep", "3"], &["approve"]);
    let mut cluster = Cluster::start(fixture, 1, 1, None).await;
    let id = cluster.submit("TERM-1").await;
    cluster.wait_running(&id).await;
    // Once its stage has started (the stream of a running run is read for half a second).
    let mut polls = 0;
    while !cluster
        .event_stream_until(&id, Duration::from_millis(500))
        .await
        .contains("\"type\":\"stage_started\"")
    {
        polls += 1;
        assert!(polls < 60, "the stage never started\n{}", cluster.logs());
    }
    // The drain time is 5 s, longer than what is left of the stage.
    let code = cluster.workers[0].terminate(Duration::from_secs(60));
    assert_eq!(
        code,
        Some(0),
        "the worker exits cleanly\n{}",
        cluster.logs()
    );
    let view = cluster.run(&id).await;
    assert_eq!(
        view["state"],
        "delivered",
        "{}\n{}",
        view["states"],
        cluster.logs()
    );
    assert_eq!(cluster.pushes("forge/term-1"), 1);
    let stream = cluster.event_stream(&id).await;
    assert_eq!(
        stream.matches("\"type\":\"stage_started\"").count(),
        1,
        "one stage, run once: {stream}"
    );
    assert!(
        !stream.contains("\"outcome\":\"cancelled\""),
        "the stage was not stopped: {stream}"
    );
    assert_eq!(container_count(&id), 0);
    cluster.delete_queues().await;
}
