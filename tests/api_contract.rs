//! The HTTP API's contract (SPEC 12): every error is RFC 9457 problem details, the framework's
//! own answers included; `201` carries `Location`; a run has an entity tag; a bad cursor is
//! refused; and schemathesis, run with all its checks against a live dispatcher and the
//! document it serves, finds no failure.
//! Needs RabbitMQ and Docker (`scripts/services.sh && scripts/build-images.sh`), and
//! schemathesis for the last test (`scripts/test.sh` installs it; see `schemathesis()`).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use common::cluster::Cluster;
use common::Fixture;
use reqwest::{Method, StatusCode};

const TOKEN: &str = "contract-token-0123456789";

/// Checks that `response` is problem details with `status` and `code`; returns the document.
async fn problem(response: reqwest::Response, status: u16, code: &str) -> serde_json::Value {
    assert_eq!(response.status().as_u16(), status, "{response:?}");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = response.text().await.unwrap();
    assert_eq!(
        content_type, "application/problem+json",
        "{status} {code}: {text}"
    );
    let body: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["status"], status, "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert_eq!(
        body["type"],
        format!("urn:forgepool:problem:{code}"),
        "{body}"
    );
    assert!(
        body["title"].as_str().is_some_and(|t| !t.is_empty()),
        "{body}"
    );
    assert!(
        body["detail"].as_str().is_some_and(|d| !d.is_empty()),
        "{body}"
    );
    body
}

/// Catches: an answer of the router or of an extractor (unknown route, wrong method, a body
/// too large, a malformed query) in plain text or empty; a 401 without `WWW-Authenticate`; a
/// cursor that silently means page 1; a 201 without `Location`; a run without an entity tag,
/// or one that does not give 304 while the run is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_is_problem_details_and_runs_carry_location_and_entity_tags() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 0, 1, Some(TOKEN)).await;
    let url = cluster.url();

    let unknown = cluster
        .http
        .get(format!("{url}/nowhere"))
        .send()
        .await
        .unwrap();
    problem(unknown, 404, "not_found").await;
    let wrong = cluster
        .request(Method::DELETE, "/v1/runs")
        .send()
        .await
        .unwrap();
    let allow = wrong.headers().get("allow").cloned();
    problem(wrong, 405, "method_not_allowed").await;
    let allow = allow.expect("a 405 names the methods allowed");
    assert!(allow.to_str().unwrap().contains("POST"), "{allow:?}");
    // (Bodies announced over 8 MiB are answered before they are read: tests/http_limits.rs
    // reads that answer on a raw socket, since a client still writing sees a broken pipe.)
    let huge = vec![b'x'; 2 * 1024 * 1024];
    let too_large = cluster
        .request(Method::POST, "/v1/runs")
        .header("content-type", "application/json")
        .body(huge)
        .send()
        .await
        .unwrap();
    problem(too_large, 413, "too_large").await;
    let anonymous = cluster
        .http
        .get(format!("{url}/v1/runs"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        anonymous
            .headers()
            .get("www-authenticate")
            .map(|v| v.to_str().unwrap()),
        Some("Bearer")
    );
    problem(anonymous, 401, "unauthorized").await;
    let bad_cursor = cluster
        .request(Method::GET, "/v1/runs?cursor=page-two")
        .send()
        .await
        .unwrap();
    let body = problem(bad_cursor, 400, "invalid_field").await;
    assert_eq!(body["field"], "cursor");
    let bad_limit = cluster
        .request(Method::GET, "/v1/runs?limit=%ZZ")
        .send()
        .await
        .unwrap();
    assert_eq!(
        bad_limit.headers()["content-type"],
        "application/problem+json"
    );
    let missing = cluster
        .request(Method::GET, &format!("/v1/runs/{}", uuid::Uuid::new_v4()))
        .send()
        .await
        .unwrap();
    problem(missing, 404, "not_found").await;
    let unknown_skill = cluster
        .request(Method::POST, "/v1/runs")
        .json(
            &serde_json::json!({"ticket": "API-1", "skill": "no-such-skill", "brief": "b",
                                  "repository": {"url": "file:///nowhere"}}),
        )
        .send()
        .await
        .unwrap();
    let body = problem(unknown_skill, 422, "unknown_skill").await;
    assert_eq!(body["field"], "skill");

    // A run: Location on 201, an entity tag, 304 while unchanged, a new tag once it changes.
    let created = cluster
        .request(Method::POST, "/v1/runs")
        .json(&cluster.request_body("API-2", serde_json::json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), StatusCode::CREATED);
    let location = created.headers()["location"].to_str().unwrap().to_string();
    let answer: serde_json::Value = created.json().await.unwrap();
    assert_eq!(
        location,
        format!("/v1/runs/{}", answer["run_id"].as_str().unwrap())
    );
    let first = cluster
        .request(Method::GET, &location)
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let tag = first.headers()["etag"].to_str().unwrap().to_string();
    assert!(tag.starts_with('"') && tag.ends_with('"'), "{tag}");
    let again = cluster
        .request(Method::GET, &location)
        .header("if-none-match", &tag)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(again.headers()["etag"].to_str().unwrap(), tag);
    let cancelled = cluster
        .request(Method::POST, &format!("{location}/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(cancelled.status(), StatusCode::ACCEPTED);
    let changed = cluster
        .request(Method::GET, &location)
        .header("if-none-match", &tag)
        .send()
        .await
        .unwrap();
    assert_eq!(
        changed.status(),
        StatusCode::OK,
        "a changed run is sent again"
    );
    assert_ne!(changed.headers()["etag"].to_str().unwrap(), tag);
    let ended = cluster
        .request(Method::POST, &format!("{location}/cancel"))
        .send()
        .await
        .unwrap();
    problem(ended, 409, "not_cancellable").await;
}

/// Catches: `/metrics` still on the API's port (an ingress or a network policy for the API
/// opening it) when the operator gave it a port of its own, or missing from that port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_answer_on_their_own_port_when_given_one() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let options = common::cluster::Options {
        env: vec![(
            "FORGEPOOL_DISPATCHER_METRICS_ADDR".into(),
            format!("127.0.0.1:{port}"),
        )],
        ..Default::default()
    };
    let cluster = Cluster::start_with(fixture, 0, 1, Some(TOKEN), options).await;
    let on_api = cluster
        .http
        .get(format!("{}/metrics", cluster.url()))
        .send()
        .await
        .unwrap();
    problem(on_api, 404, "not_found").await;
    let apart = format!("http://127.0.0.1:{port}");
    let metrics = cluster
        .http
        .get(format!("{apart}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), StatusCode::OK);
    let text = metrics.text().await.unwrap();
    assert!(text.contains("forgepool_broker_connected"), "{text}");
    // Readiness answers there too, and turns ready once the events consumer is connected.
    let mut polls = 0;
    loop {
        let ready = cluster
            .http
            .get(format!("{apart}/readyz"))
            .send()
            .await
            .unwrap();
        if ready.status() == StatusCode::OK {
            let body: serde_json::Value = ready.json().await.unwrap();
            assert_eq!(body["broker"], true, "{body}");
            break;
        }
        assert_eq!(ready.status(), StatusCode::SERVICE_UNAVAILABLE);
        polls += 1;
        assert!(polls < 100, "the dispatcher never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let api = cluster
        .http
        .get(format!("{apart}/v1/runs"))
        .send()
        .await
        .unwrap();
    problem(api, 404, "not_found").await;
}

/// Where schemathesis's `st` is: `FORGEPOOL_ST`, else the virtual environment
/// `scripts/test.sh` makes, else `st` on the PATH. Fails (never skips) without it.
fn schemathesis() -> PathBuf {
    let candidates = [
        std::env::var_os("FORGEPOOL_ST").map(PathBuf::from),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/schemathesis/bin/st")),
    ];
    for candidate in candidates.into_iter().flatten() {
        if candidate.is_file() {
            return candidate;
        }
    }
    match Command::new("st").arg("--version").output() {
        Ok(output) if output.status.success() => PathBuf::from("st"),
        _ => panic!(
            "schemathesis is not installed: run `scripts/api-tools.sh` (or `pip install schemathesis==4.32.5` and set FORGEPOOL_ST to its `st`)"
        ),
    }
}

/// Catches: the served document and the API disagreeing anywhere schemathesis looks (an
/// undocumented status or content type, a body that breaks its schema, a schema-valid
/// request refused as malformed, a schema-breaking one accepted, a method answered that is
/// not allowed, a 5xx, the token not enforced), and each event of a finished run's stream
/// against the stream's schema (an event stream described as `{"type": "string"}`: ST108).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_with_all_checks_finds_no_failure() {
    let st = schemathesis();
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let mut cluster = Cluster::start(fixture, 1, 1, Some(TOKEN)).await;
    // A run that finished, for its event stream; then no worker runs what schemathesis sends.
    let finished = cluster.submit("STREAM-1").await;
    let views = cluster
        .wait_terminal(std::slice::from_ref(&finished), Duration::from_secs(90))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    for worker in &mut cluster.workers {
        assert_eq!(worker.terminate(Duration::from_secs(30)), Some(0));
    }
    let url = cluster.url();
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis.toml");
    // Several seeds: one seed found no failure where others did (a path number over its
    // limit, a repeated Idempotency-Key with a schema-breaking request).
    for seed in ["1", "2", "3"] {
        let mut command = Command::new(&st);
        command
            .arg("--config-file")
            .arg(&config)
            .arg("--no-color")
            .args(["run", &format!("{url}/v1/openapi.json"), "--url", &url])
            .args(["--header", &format!("Authorization: Bearer {TOKEN}")])
            .args(["--checks", "all", "--max-examples", "100", "--seed", seed])
            .args(["--request-timeout", "20"])
            .env("FORGEPOOL_FINISHED_RUN", &finished)
            .current_dir(cluster.fixture.dir.path());
        let output = common::output_within(&mut command, Duration::from_secs(900));
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(
            output.status.success(),
            "schemathesis found failures with seed {seed}:\n{text}"
        );
        assert!(
            text.contains("No issues found") || text.contains("passed"),
            "{text}"
        );
    }
}
