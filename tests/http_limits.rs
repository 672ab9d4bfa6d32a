//! The dispatcher bounds every client (SPEC 15): idle and half-open connections are closed,
//! a body must arrive in time and within its size, and a run's event streams are capped.
//! Needs RabbitMQ and Docker: `scripts/services.sh && scripts/build-images.sh`.

mod common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::Fixture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection or `limit` passes; returns what was read and
/// whether the server closed it.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut bytes = Vec::new();
    let deadline = Instant::now() + limit;
    let mut buffer = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&bytes).into(), true),
            Ok(Ok(n)) => bytes.extend_from_slice(&buffer[..n]),
            Err(_) => return (String::from_utf8_lossy(&bytes).into(), false),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_half_open_connections_are_closed_and_the_api_keeps_answering() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    let address = cluster.url().trim_start_matches("http://").to_string();
    // Connections that never send a request, and ones that stop halfway through the headers.
    let mut idle = Vec::new();
    for n in 0..200 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        if n % 2 == 1 {
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .await
                .unwrap();
        }
        idle.push(stream);
    }
    // A kept-alive connection that goes quiet after its first request.
    let mut kept = TcpStream::connect(&address).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    // Meanwhile the API answers.
    let health = cluster
        .http
        .get(format!("{}/healthz", cluster.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    // The server closes every one of them after its header timeout (10 s), well before 30 s.
    for stream in &mut idle {
        let (_, closed) = read_until_closed(stream, Duration::from_secs(30)).await;
        assert!(closed, "an idle connection was kept open for 30 s");
    }
    let (answer, closed) = read_until_closed(&mut kept, Duration::from_secs(30)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        closed,
        "a quiet kept-alive connection was kept open for 30 s"
    );
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_must_be_small_and_arrive_in_time_and_errors_are_json() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    // 2 MiB and 64 GiB announced, far over the 1 MiB limit and over any buffer: a JSON 413 as
    // soon as the size is known, whatever it is. (Raw TCP: a client still sending when the
    // server answers would see a reset instead of the answer.)
    let address = cluster.url().trim_start_matches("http://").to_string();
    for size in [2u64 << 20, 64u64 << 30] {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream
            .write_all(
                format!(
                    "POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        let _ = stream.write_all(&[b' '; 4096]).await;
        let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(20)).await;
        assert!(answer.starts_with("HTTP/1.1 413"), "{size} bytes: {answer}");
        assert!(answer.contains("\"too_large\""), "{size} bytes: {answer}");
        assert!(
            answer
                .to_ascii_lowercase()
                .contains("content-type: application/problem+json"),
            "{size} bytes: {answer}"
        );
    }
    // A body that never comes: a JSON 408 after the body timeout, and the connection ends.
    let mut slow = TcpStream::connect(&address).await.unwrap();
    slow.write_all(
        b"POST /v1/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"ticket\":",
    )
    .await
    .unwrap();
    let (answer, _) = read_until_closed(&mut slow, Duration::from_secs(40)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("\"body_timeout\""), "{answer}");
    cluster.delete_queues().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_has_at_most_sixteen_event_streams() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    // No worker: the run stays queued, so its streams stay open.
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    let run_id = cluster.submit("STREAMS-1").await;
    let path = format!("/v1/runs/{run_id}/events");
    let mut open = Vec::new();
    for _ in 0..16 {
        let response = cluster
            .request(reqwest::Method::GET, &path)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        open.push(response);
    }
    let refused = cluster
        .request(reqwest::Method::GET, &path)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["code"], "too_many_streams", "{body}");
    // Closing one frees its place.
    drop(open.pop());
    let started = Instant::now();
    let status = loop {
        let response = cluster
            .request(reqwest::Method::GET, &path)
            .send()
            .await
            .unwrap();
        if response.status() == 200 || started.elapsed() > Duration::from_secs(20) {
            break response.status();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status, 200, "a closed stream's place was not freed");
    // Another run is not affected by this one's streams.
    let other = cluster.submit("STREAMS-2").await;
    let response = cluster
        .request(reqwest::Method::GET, &format!("/v1/runs/{other}/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    drop(open);
    cluster.delete_queues().await;
}

/// Peak resident memory of a process in KiB (`VmHWM`).
fn peak_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_of_a_long_history_keep_the_dispatcher_small() {
    let fixture = Fixture::new(None, &["chatty", "9000"], &["approve"]);
    let cluster = Cluster::start(fixture, 1, 1, None).await;
    let run_id = cluster.submit("CHATTY-1").await;
    let views = cluster
        .wait_terminal(std::slice::from_ref(&run_id), Duration::from_secs(120))
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", cluster.logs());
    let pid = cluster.dispatcher.as_ref().unwrap().child.id();
    // One client reads the whole history: thousands of events.
    let history = cluster
        .request(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events = history.matches("\nid: ").count();
    assert!(events > 8000, "{events} events in the history");
    let before = peak_kib(pid);
    // Eight clients that ask for it and never read: the dispatcher holds one page per stream.
    let address = cluster.url().trim_start_matches("http://").to_string();
    let mut stalled = Vec::new();
    for _ in 0..8 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        stream
            .write_all(
                format!("GET /v1/runs/{run_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .unwrap();
        stalled.push(stream);
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let after = peak_kib(pid);
    eprintln!(
        "dispatcher peak: {before} KiB before, {after} KiB with eight stalled streams of {events} events"
    );
    assert!(
        after.saturating_sub(before) < 16 * 1024,
        "the dispatcher grew by {} KiB for eight stalled streams of {events} events",
        after.saturating_sub(before)
    );
    drop(stalled);
    cluster.delete_queues().await;
}

/// Sends one raw request and returns the answer's status and body.
async fn raw(address: &str, request: String) -> (u16, String) {
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(20)).await;
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

/// What a web page can make a browser send to a dispatcher that runs without a token, sent
/// as Chromium sends it: a cross-site `text/plain` POST (no preflight needed) creating a run,
/// a cross-site JSON one, a request through a rebound name (`Host: attacker.example`) reading
/// runs or cancelling one. Each is refused, and the store shows it: no run made, the queued
/// run still queued. The dispatcher's own page (same origin) and the CLI still work.
/// Catches: a browser driving a tokenless dispatcher (SPEC 15), as a page did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_drive_a_dispatcher_without_a_token() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    // No worker: a run stays queued, so a cancel that got through would show.
    let cluster = Cluster::start(fixture, 0, 1, None).await;
    let queued = cluster.submit("PAGE-1").await;
    let address = cluster.url().trim_start_matches("http://").to_string();
    let body = cluster
        .request_body("PAGE-2", serde_json::json!({}))
        .to_string();
    let post = |host: &str, extra: &str, content_type: &str| {
        format!(
            "POST /v1/runs HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let attacker = "Origin: http://attacker.example\r\nSec-Fetch-Site: cross-site\r\n";
    let cases = [
        (post(&address, attacker, "text/plain;charset=UTF-8"), 415),
        (post(&address, attacker, "application/json"), 403),
        (post("attacker.example:80", "", "application/json"), 403),
        (
            "GET /v1/runs HTTP/1.1\r\nHost: attacker.example\r\nConnection: close\r\n\r\n".to_string(),
            403,
        ),
        (
            format!("POST /v1/runs/{queued}/cancel HTTP/1.1\r\nHost: attacker.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
            403,
        ),
        (
            format!("POST /v1/runs/{queued}/cancel HTTP/1.1\r\nHost: {address}\r\nOrigin: http://attacker.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
            403,
        ),
    ];
    for (request, expected) in cases {
        let (status, answer) = raw(&address, request.clone()).await;
        assert_eq!(status, expected, "{request}\n{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
    }
    assert!(
        cluster.runs_of_ticket("PAGE-2").await.is_empty(),
        "a page made a run"
    );
    assert_eq!(cluster.run(&queued).await["state"], "queued");
    // The dispatcher's own page: same origin, JSON.
    let same = format!("Origin: http://{address}\r\nSec-Fetch-Site: same-origin\r\n");
    let (status, answer) = raw(&address, post(&address, &same, "application/json")).await;
    assert_eq!(status, 201, "{answer}");
    cluster.delete_queues().await;
}
