//! What the model gateway adds to a model call, side by side with calling the provider
//! directly: `cargo bench -p forgepool-gateway --bench latency` (results in
//! docs/BENCHMARKS.md). The provider is a fake on loopback (axum) answering a small JSON body
//! with usage, or a short event stream. The gateway path is the production one minus the
//! container network: client → relay (TCP) → the gateway's Unix socket → provider, with a
//! stage token, a budget reserved and settled per call, and every answer metered.
//!
//! Figures: p50/p99 per request of both paths at 1 and at 8 concurrent clients (closed loop,
//! so the rate is what this machine sustains), time to the first streamed byte, and the
//! resident memory growth while 200 streams are held open.
//!
//! With `LITELLM` naming a `litellm` executable (PyPI `litellm[proxy]`;
//! `scripts/bench-gateway.sh` installs it), the same load generator also drives one LiteLLM
//! proxy process in its plain mode (no database, no keys of its own) in front of the same fake,
//! so that the two are compared as a user would: what each adds to the same call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use forgepool_gateway as gateway;
use gateway::{Amount, Gateway, Limits, PassRequest, Providers, Settings};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

const WARMUP: usize = 300;
const REQUESTS: usize = 3000;

fn percentile(samples: &mut [f64], p: f64) -> f64 {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    samples[((samples.len() as f64 - 1.0) * p).round() as usize]
}

fn resident_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Closed-loop clients for `REQUESTS` calls: each call's latency, and the rate reached.
async fn drive(url: &str, token: &str, clients: usize, stream: bool) -> (Vec<f64>, f64) {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let body = format!(
        r#"{{"model":"fake-model","max_tokens":64,"stream":{stream},"messages":[{{"role":"user","content":"hello"}}]}}"#
    );
    let call = |client: reqwest::Client, body: String, url: String, token: String| async move {
        let began = Instant::now();
        let response = client
            .post(url)
            .header("x-api-key", token)
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let _ = response.bytes().await.unwrap();
        began.elapsed().as_secs_f64() * 1000.0
    };
    for _ in 0..WARMUP {
        call(
            client.clone(),
            body.clone(),
            url.to_string(),
            token.to_string(),
        )
        .await;
    }
    let began = Instant::now();
    let per_client = REQUESTS / clients;
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (client, body, url, token) = (
                client.clone(),
                body.clone(),
                url.to_string(),
                token.to_string(),
            );
            tokio::spawn(async move {
                let mut samples = Vec::with_capacity(per_client);
                for _ in 0..per_client {
                    samples
                        .push(call(client.clone(), body.clone(), url.clone(), token.clone()).await);
                }
                samples
            })
        })
        .collect();
    let mut samples = Vec::new();
    for task in tasks {
        samples.extend(task.await.unwrap());
    }
    let rate = samples.len() as f64 / began.elapsed().as_secs_f64();
    (samples, rate)
}

/// Time to the first byte of a streamed answer, `REQUESTS / 3` times.
async fn first_bytes(url: &str, token: &str) -> Vec<f64> {
    let client = reqwest::Client::builder()
        .tcp_nodelay(true)
        .build()
        .unwrap();
    let body = r#"{"model":"fake-model","max_tokens":64,"stream":true,"messages":[]}"#;
    let mut samples = Vec::new();
    for i in 0..(WARMUP + REQUESTS / 3) {
        let began = Instant::now();
        let mut response = client
            .post(url)
            .header("x-api-key", token)
            .body(body)
            .send()
            .await
            .unwrap();
        let _ = response.chunk().await.unwrap();
        if i >= WARMUP {
            samples.push(began.elapsed().as_secs_f64() * 1000.0);
        }
        while response.chunk().await.unwrap().is_some() {}
    }
    samples
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let held = Arc::new(Notify::new());
    let hold_streams = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let app = {
        let (held, hold_streams) = (Arc::clone(&held), Arc::clone(&hold_streams));
        axum::Router::new().route(
            "/v1/messages",
            axum::routing::post(move |body: String| {
                let (held, hold_streams) = (Arc::clone(&held), Arc::clone(&hold_streams));
                async move {
                    if !body.contains("\"stream\":true") {
                        return Response::builder()
                            .header("content-type", "application/json")
                            .body(Body::from(r#"{"type":"message","model":"fake-model","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":12,"output_tokens":3}}"#))
                            .unwrap();
                    }
                    let (sender, receiver) = tokio::sync::mpsc::channel::<Result<String, std::io::Error>>(4);
                    tokio::spawn(async move {
                        let _ = sender.send(Ok("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"fake-model\",\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n".into())).await;
                        if hold_streams.load(std::sync::atomic::Ordering::SeqCst) {
                            held.notified().await;
                        }
                        let _ = sender.send(Ok("event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":3}}\n\n".into())).await;
                    });
                    Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(receiver)))
                        .unwrap()
                }
            }),
        )
    };
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let provider_address = upstream.local_addr().unwrap();
    // No Nagle delay on the fake's small writes (a provider's stream is not held back either).
    let upstream = axum::serve::ListenerExt::tap_io(upstream, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(upstream, app).await.unwrap() });

    let providers = Providers::parse(&format!(
        "[[provider]]\nname = \"fake\"\napi = \"anthropic-messages\"\nbase_url = \"http://{provider_address}\"\nkey_env = \"FAKE_KEY\"\n[provider.prices.\"fake-model\"]\ninput_per_mtok = 3.0\noutput_per_mtok = 15.0\n"
    ))
    .unwrap();
    let gateway = Gateway::new(Settings {
        providers: Some(providers),
        keys: Some(HashMap::from([("FAKE_KEY".to_string(), "k".to_string())])),
        peers: None,
        metrics: Some(Arc::new(telemetry_metrics())),
        root: "http://gateway".into(),
        // The profile has a daily budget too: each call also holds its worst case against
        // the profile's allotment (asked for again each sixteenth of the day's budget).
        allotter: Some(Arc::new(gateway::daily::LocalAllotter::new(HashMap::from(
            [(
                "bench".to_string(),
                proto::Budget {
                    max_cost_usd: Some(1e9),
                    max_tokens: Some(u64::MAX / 4),
                },
            )],
        )))),
    })
    .unwrap();
    let folder = tempfile::tempdir().unwrap();
    let socket = folder.path().join("gateway.sock");
    let stop = CancellationToken::new();
    tokio::spawn(gateway::serve_unix(
        tokio::net::UnixListener::bind(&socket).unwrap(),
        Arc::clone(&gateway),
        stop.clone(),
    ));
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_address = relay.local_addr().unwrap();
    tokio::spawn(gateway::relay::relay(relay, socket, stop.clone()));
    let pass = gateway
        .pass(PassRequest {
            run_id: uuid::Uuid::new_v4(),
            profile: "bench".into(),
            provider: "fake".into(),
            container: "bench".into(),
            limits: Limits {
                max_tokens: Some(u64::MAX / 2),
                max_cost_usd: Some(1e9),
            },
            spent: Amount::default(),
            lifetime: Duration::from_secs(3600),
            daily_budget: true,
            server_tools: Vec::new(),
        })
        .unwrap();
    let direct = format!("http://{provider_address}/v1/messages");
    let through = format!("http://{relay_address}/fake/v1/messages");

    println!("| path | clients | rate (req/s) | p50 ms | p99 ms |");
    println!("|---|---|---|---|---|");
    let mut added = Vec::new();
    for clients in [1, 8] {
        let (mut d, d_rate) = drive(&direct, "k", clients, false).await;
        let (mut g, g_rate) = drive(&through, pass.token(), clients, false).await;
        let (d50, d99) = (percentile(&mut d, 0.5), percentile(&mut d, 0.99));
        let (g50, g99) = (percentile(&mut g, 0.5), percentile(&mut g, 0.99));
        println!("| direct | {clients} | {d_rate:.0} | {d50:.3} | {d99:.3} |");
        println!("| gateway | {clients} | {g_rate:.0} | {g50:.3} | {g99:.3} |");
        added.push((clients, g50 - d50, g99 - d99));
    }
    for (clients, p50, p99) in &added {
        println!("added by the gateway, {clients} client(s): p50 {p50:.3} ms, p99 {p99:.3} ms");
    }
    if let Ok(litellm) = std::env::var("LITELLM") {
        compare_litellm(&litellm, provider_address, &direct).await;
    }
    let mut d = first_bytes(&direct, "k").await;
    let mut g = first_bytes(&through, pass.token()).await;
    println!(
        "first streamed byte p50: direct {:.3} ms, gateway {:.3} ms (added {:.3} ms); p99 added {:.3} ms",
        percentile(&mut d, 0.5),
        percentile(&mut g, 0.5),
        percentile(&mut g, 0.5) - percentile(&mut d, 0.5),
        percentile(&mut g, 0.99) - percentile(&mut d, 0.99)
    );

    // 200 streams held open through the gateway.
    hold_streams.store(true, std::sync::atomic::Ordering::SeqCst);
    let before = resident_kib();
    let client = reqwest::Client::new();
    let mut open = Vec::new();
    for _ in 0..200 {
        let mut response = client
            .post(&through)
            .header("x-api-key", pass.token())
            .body(r#"{"model":"fake-model","max_tokens":64,"stream":true,"messages":[]}"#)
            .send()
            .await
            .unwrap();
        let _ = response.chunk().await.unwrap();
        open.push(response);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = resident_kib();
    held.notify_waiters();
    println!(
        "200 streams held open: resident memory of the whole bench process (gateway, relay, fake provider and 200 clients) grew by {:.1} MB",
        (during.saturating_sub(before)) as f64 / 1024.0
    );
    drop(open);
    let meter = pass.close();
    println!(
        "metered: {} requests, {} tokens",
        meter.requests,
        meter.counts.total()
    );
    stop.cancel();
}

/// The LiteLLM proxy's master key, which the load generator sends as its `x-api-key`.
const LITELLM_KEY: &str = "sk-forgepool-bench-0123456789abcdef";

/// One LiteLLM proxy process in front of the same fake: its rows beside the direct ones, and
/// what it adds.
async fn compare_litellm(litellm: &str, provider: std::net::SocketAddr, direct: &str) {
    let folder = tempfile::tempdir().unwrap();
    let config = folder.path().join("litellm.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: fake-model\n    litellm_params:\n      model: anthropic/fake-model\n      api_base: http://{provider}\n      api_key: k\n"
        ),
    )
    .unwrap();
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let log = std::fs::File::create(folder.path().join("litellm.log")).unwrap();
    let mut child = tokio::process::Command::new(litellm)
        .args(["--config", config.to_str().unwrap(), "--host", "127.0.0.1"])
        .args(["--port", &port.to_string(), "--num_workers", "1"])
        // Offline: the price list bundled with the package, no telemetry.
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_TELEMETRY", "False")
        // Its plain mode still wants a master key (it refuses to start without one); no
        // database, so no per-key budgets or spend logs.
        .env("LITELLM_MASTER_KEY", LITELLM_KEY)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("LITELLM names the litellm executable");
    let through = format!("http://127.0.0.1:{port}/v1/messages");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = client
            .get(format!("http://127.0.0.1:{port}/health/liveliness"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        let exited = child.try_wait().ok().flatten().is_some();
        assert!(
            Instant::now() < deadline && !exited,
            "the LiteLLM proxy did not start within 120 s: {}",
            std::fs::read_to_string(folder.path().join("litellm.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!("| path | clients | rate (req/s) | p50 ms | p99 ms |");
    println!("|---|---|---|---|---|");
    let mut added = Vec::new();
    for clients in [1, 8] {
        let (mut d, d_rate) = drive(direct, "k", clients, false).await;
        let (mut l, l_rate) = drive(&through, LITELLM_KEY, clients, false).await;
        let (d50, d99) = (percentile(&mut d, 0.5), percentile(&mut d, 0.99));
        let (l50, l99) = (percentile(&mut l, 0.5), percentile(&mut l, 0.99));
        println!("| direct | {clients} | {d_rate:.0} | {d50:.3} | {d99:.3} |");
        println!("| LiteLLM proxy | {clients} | {l_rate:.0} | {l50:.3} | {l99:.3} |");
        added.push((clients, l50 - d50, l99 - d99));
    }
    for (clients, p50, p99) in added {
        println!("added by LiteLLM, {clients} client(s): p50 {p50:.3} ms, p99 {p99:.3} ms");
    }
    let _ = child.kill().await;
}

fn telemetry_metrics() -> telemetry::Metrics {
    telemetry::Metrics::new(telemetry::Role::Worker)
}
