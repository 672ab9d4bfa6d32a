//! The gateway end to end on loopback: a real HTTP client as the stage, the gateway served
//! over TCP, and a fake provider (axum) that records what reached it. Judged by what the
//! provider received and what the client and the pass saw.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use forgepool_gateway as gateway;
use gateway::daily::{Allotter, LocalAllotter};
use gateway::{Amount, Gateway, Limits, Pass, PassRequest, PeerCheck, Providers, Settings};
use tokio::sync::{mpsc, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const KEY: &str = "sk-real-provider-key-MARKER-5150";

#[derive(Default)]
struct Provider {
    /// Every request: its path and headers.
    seen: Mutex<Vec<(String, HeaderMap, serde_json::Value)>>,
    /// What to answer next: a status and its headers, else a stream.
    rate_limit: Mutex<Option<u64>>,
    /// Holds a stream after its first event until notified.
    hold: Option<Arc<Notify>>,
}

async fn messages(
    State(provider): State<Arc<Provider>>,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: String,
) -> Response {
    let value: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    provider
        .seen
        .lock()
        .unwrap()
        .push((uri.to_string(), headers, value.clone()));
    if let Some(seconds) = *provider.rate_limit.lock().unwrap() {
        return Response::builder()
            .status(429)
            .header("retry-after", seconds.to_string())
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
            ))
            .unwrap();
    }
    // The usage the provider states: the whole request body as input (7 of it read from the
    // cache), the output limit as output: the worst case a reservation must cover.
    let input = body.len() as u64 - 7;
    let output = value["max_tokens"].as_u64().unwrap_or(10);
    let first = format!(
        "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"model\":\"fake-model\",\"usage\":{{\"input_tokens\":{input},\"cache_read_input_tokens\":7,\"output_tokens\":1}}}}}}\n\n"
    );
    let last = format!(
        "event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{output}}}}}\n\nevent: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n"
    );
    let (sender, receiver) = mpsc::channel::<Result<String, std::io::Error>>(4);
    let hold = provider.hold.clone();
    tokio::spawn(async move {
        let _ = sender.send(Ok(first)).await;
        if let Some(hold) = hold {
            hold.notified().await;
        }
        let _ = sender.send(Ok(last)).await;
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
        ))
        .unwrap()
}

struct Setup {
    gateway: Arc<Gateway>,
    metrics: Arc<telemetry::Metrics>,
    provider: Arc<Provider>,
    address: SocketAddr,
    _stop: tokio_util::sync::DropGuard,
}

#[derive(Debug)]
struct FixedPeers(HashMap<String, IpAddr>);

impl PeerCheck for FixedPeers {
    fn address(
        &self,
        container: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<IpAddr>> + Send + '_>> {
        let found = self.0.get(container).copied();
        Box::pin(async move { found })
    }
}

async fn setup(provider: Provider, peers: Option<FixedPeers>) -> Setup {
    setup_with(provider, peers, None).await
}

async fn setup_with(
    provider: Provider,
    peers: Option<FixedPeers>,
    allotter: Option<Arc<dyn Allotter>>,
) -> Setup {
    let provider = Arc::new(provider);
    let app = axum::Router::new()
        .route("/v1/messages", axum::routing::post(messages))
        .route(
            "/v1/organizations/keys",
            axum::routing::get(|| async { "secret admin data" }),
        )
        .with_state(Arc::clone(&provider));
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_address = upstream.local_addr().unwrap();
    let stop = CancellationToken::new();
    {
        let stop = stop.clone();
        tokio::spawn(async move {
            axum::serve(upstream, app)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
                .unwrap();
        });
    }
    let providers = Providers::parse(&format!(
        "[[provider]]\nname = \"fake\"\napi = \"anthropic-messages\"\nbase_url = \"http://{upstream_address}\"\nkey_env = \"FAKE_KEY\"\n[provider.prices.\"fake-model\"]\ninput_per_mtok = 1.0\noutput_per_mtok = 2.0\nmax_output_tokens = 1000\n"
    ))
    .unwrap();
    let metrics = Arc::new(telemetry::Metrics::new(telemetry::Role::Worker));
    let gateway = Gateway::new(Settings {
        providers: Some(providers),
        keys: Some(HashMap::from([("FAKE_KEY".to_string(), KEY.to_string())])),
        peers: peers.map(|p| Arc::new(p) as Arc<dyn PeerCheck>),
        metrics: Some(Arc::clone(&metrics)),
        root: "http://gateway".into(),
        allotter,
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(gateway::serve_tcp(
        listener,
        Arc::clone(&gateway),
        stop.clone(),
    ));
    Setup {
        gateway,
        metrics,
        provider,
        address,
        _stop: stop.drop_guard(),
    }
}

fn pass(gateway: &Arc<Gateway>, run: Uuid, provider: &str, limits: Limits) -> Pass {
    pass_with(gateway, run, provider, limits, false)
}

fn pass_with(
    gateway: &Arc<Gateway>,
    run: Uuid,
    provider: &str,
    limits: Limits,
    daily_budget: bool,
) -> Pass {
    gateway
        .pass(PassRequest {
            run_id: run,
            profile: "claude".into(),
            provider: provider.into(),
            container: "stage-a".into(),
            limits,
            spent: Amount::default(),
            lifetime: Duration::from_secs(600),
            daily_budget,
            server_tools: Vec::new(),
        })
        .unwrap()
}

/// Sends `count` calls at once with `token`; returns their statuses.
async fn burst(address: SocketAddr, token: &str, body: &str, count: usize) -> Vec<u16> {
    let client = reqwest::Client::new();
    let calls = (0..count).map(|_| {
        let client = client.clone();
        let url = format!("http://{address}/fake/v1/messages");
        let (token, body) = (token.to_string(), body.to_string());
        async move {
            let response = client
                .post(url)
                .header("x-api-key", token)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let _ = response.bytes().await;
            status
        }
    });
    futures_util::future::join_all(calls).await
}

fn body(max_tokens: u64) -> String {
    format!(
        r#"{{"model":"fake-model","max_tokens":{max_tokens},"stream":true,"messages":[{{"role":"user","content":"hi"}}]}}"#
    )
}

async fn call(address: SocketAddr, path: &str, token: &str, body: String) -> (u16, String) {
    let response = reqwest::Client::new()
        .post(format!("http://{address}{path}"))
        .header("x-api-key", token)
        .header("anthropic-version", "2023-06-01")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// The provider gets the real key and never the stage's token; the stage gets the stream as
/// it was sent; the pass holds the usage the stream stated, priced; after the pass is closed
/// the token is refused.
/// Catches: a key not swapped in (or the token leaked upstream), usage lost, a token that
/// outlives its stage.
#[tokio::test]
async fn the_key_is_swapped_in_the_usage_metered_and_the_token_dies_with_its_stage() {
    let setup = setup(Provider::default(), None).await;
    let run = Uuid::new_v4();
    let pass = pass(&setup.gateway, run, "fake", Limits::default());
    let token = pass.token().to_string();
    let (status, text) = call(
        setup.address,
        "/fake/v1/messages?beta=true",
        &token,
        body(45),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("message_stop"), "{text}");
    {
        let seen = setup.provider.seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        let (uri, headers, _) = &seen[0];
        assert_eq!(uri, "/v1/messages?beta=true");
        assert_eq!(headers["x-api-key"], KEY);
        assert_eq!(headers["anthropic-version"], "2023-06-01");
        let all: String = headers
            .iter()
            .map(|(n, v)| format!("{n}: {v:?}\n"))
            .collect();
        assert!(
            !all.contains(&token),
            "the token reached the provider: {all}"
        );
    }
    let meter = pass.close();
    let input = body(45).len() as u64 - 7;
    assert_eq!(meter.requests, 1);
    assert_eq!(
        (
            meter.counts.input,
            meter.counts.output,
            meter.counts.cache_read
        ),
        (input, 45, 7)
    );
    assert_eq!(meter.counts.model.as_deref(), Some("fake-model"));
    let price = (input as f64 * 1.0 + 45.0 * 2.0) / 1e6;
    assert!(
        (meter.cost_usd - price).abs() < 1e-12,
        "{} vs {price}",
        meter.cost_usd
    );

    // The metrics count the call by a bounded model label (a model of the price table).
    let rendered = setup.metrics.render();
    for line in [
        "forgepool_model_requests_total{code=\"200\",model=\"fake-model\",profile=\"claude\",provider=\"fake\"} 1".to_string(),
        format!("forgepool_model_tokens_total{{kind=\"input\",model=\"fake-model\",profile=\"claude\"}} {input}"),
        "forgepool_model_tokens_total{kind=\"output\",model=\"fake-model\",profile=\"claude\"} 45".to_string(),
        "forgepool_model_request_duration_seconds_count{profile=\"claude\",provider=\"fake\"} 1".to_string(),
    ] {
        assert!(rendered.contains(&line), "{line} not in\n{rendered}");
    }
    assert!(rendered
        .contains("forgepool_model_cost_usd_total{model=\"fake-model\",profile=\"claude\"}"));

    let (status, text) = call(setup.address, "/fake/v1/messages", &token, body(45)).await;
    assert_eq!(status, 401, "{text}");
    assert!(text.contains("not a live stage's token"), "{text}");
    assert_eq!(setup.provider.seen.lock().unwrap().len(), 1);
}

/// Catches: a path outside the API forwarded with the key (an admin path, a traversal), a
/// token used for another provider, a token used from another container, no token at all.
#[tokio::test]
async fn a_token_is_refused_off_its_path_provider_and_container() {
    let peers = FixedPeers(HashMap::from([(
        "stage-a".to_string(),
        "10.9.9.9".parse().unwrap(),
    )]));
    let setup = setup(Provider::default(), Some(peers)).await;
    let run = Uuid::new_v4();
    let pass = pass(&setup.gateway, run, "fake", Limits::default());
    let token = pass.token().to_string();
    // From loopback, not the container's 10.9.9.9.
    let (status, text) = call(setup.address, "/fake/v1/messages", &token, body(5)).await;
    assert_eq!(status, 403, "{text}");
    assert!(text.contains("another container"), "{text}");

    let setup = self::setup(Provider::default(), None).await;
    let pass = self::pass(&setup.gateway, run, "fake", Limits::default());
    let token = pass.token().to_string();
    for (path, expected) in [
        ("/fake/v1/organizations/keys", 404),
        ("/fake/v1/messages/../organizations/keys", 404),
        ("/anthropic/v1/messages", 403),
        ("/nobody/v1/messages", 404),
    ] {
        let (status, text) = call(setup.address, path, &token, body(5)).await;
        assert_eq!(status, expected, "{path}: {text}");
    }
    let (status, _) = call(setup.address, "/fake/v1/messages", "", body(5)).await;
    assert_eq!(status, 401);
    assert!(
        setup.provider.seen.lock().unwrap().is_empty(),
        "nothing reached the provider"
    );
}

/// 64 requests at once on one run's token budget, each stating the worst case its
/// reservation covers, 100 times: the run's metered tokens pass the budget by at most one
/// request's reservation, and every refused request was refused before the provider.
/// Catches: a budget checked after the fact (all 64 pass, LiteLLM #34732), a reservation
/// not released, refused requests that still reached the provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_cannot_race_past_a_budget() {
    let setup = setup(Provider::default(), None).await;
    let client = reqwest::Client::new();
    let request_body = body(300);
    let reservation = request_body.len() as u64 + 300;
    let budget = 2_000;
    for trial in 0..100 {
        let run = Uuid::new_v4();
        let limits = Limits {
            max_tokens: Some(budget),
            max_cost_usd: None,
        };
        let pass = pass(&setup.gateway, run, "fake", limits);
        let before = setup.provider.seen.lock().unwrap().len();
        let calls = (0..64).map(|_| {
            let client = client.clone();
            let url = format!("http://{}/fake/v1/messages", setup.address);
            let (token, body) = (pass.token().to_string(), request_body.clone());
            async move {
                let response = client
                    .post(url)
                    .header("x-api-key", token)
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                let _ = response.bytes().await;
                status
            }
        });
        let statuses = futures_util::future::join_all(calls).await;
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let refused = statuses.iter().filter(|s| **s == 403).count();
        assert_eq!(admitted + refused, 64, "trial {trial}: {statuses:?}");
        let reached = setup.provider.seen.lock().unwrap().len() - before;
        assert_eq!(reached, admitted, "trial {trial}");
        let meter = pass.close();
        let spent = meter.counts.input + meter.counts.output + meter.counts.cache_read;
        assert!(admitted >= 1, "trial {trial}");
        assert!(
            spent <= budget + reservation,
            "trial {trial}: {spent} tokens spent on a budget of {budget} (one reservation is {reservation})"
        );
        assert!(meter
            .exhausted
            .as_deref()
            .is_some_and(|r| r.contains("budget exhausted")));
    }
}

/// One profile's daily budget, two gateways (two workers) sharing the pool's allotments:
/// 64 requests at once, 32 through each, 100 times. The two providers together are charged
/// at most the budget and one request's reservation; every refused request stayed in its
/// gateway, halted its stage with the day's end as its reset, and what the gateways did not
/// spend went back to the pool.
/// Catches: a daily budget kept per worker (each spends the whole budget: twice over), grants
/// without the one-request bound, refused calls forwarded, allotments never handed back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_daily_budget_holds_across_two_gateways() {
    let request_body = body(300);
    let reservation = request_body.len() as u64 + 300;
    let budget = 2_000;
    for trial in 0..100 {
        let allotter = Arc::new(LocalAllotter::new(HashMap::from([(
            "claude".to_string(),
            proto::Budget {
                max_cost_usd: None,
                max_tokens: Some(budget),
            },
        )])));
        let shared = Arc::clone(&allotter) as Arc<dyn Allotter>;
        let a = setup_with(Provider::default(), None, Some(Arc::clone(&shared))).await;
        let b = setup_with(Provider::default(), None, Some(shared)).await;
        let (pass_a, pass_b) = (
            pass_with(&a.gateway, Uuid::new_v4(), "fake", Limits::default(), true),
            pass_with(&b.gateway, Uuid::new_v4(), "fake", Limits::default(), true),
        );
        let (statuses_a, statuses_b) = tokio::join!(
            burst(a.address, pass_a.token(), &request_body, 32),
            burst(b.address, pass_b.token(), &request_body, 32),
        );
        let statuses: Vec<u16> = statuses_a.iter().chain(&statuses_b).copied().collect();
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        let refused = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!(admitted + refused, 64, "trial {trial}: {statuses:?}");
        let reached = a.provider.seen.lock().unwrap().len() + b.provider.seen.lock().unwrap().len();
        assert_eq!(
            reached, admitted,
            "trial {trial}: a refused call reached a provider"
        );
        assert!(
            refused > 0,
            "trial {trial}: 64 calls fit a budget of {budget}?"
        );
        let halted = pass_a.halted().is_cancelled() || pass_b.halted().is_cancelled();
        assert!(
            halted,
            "trial {trial}: a spent day halts the stage that hit it"
        );
        let (meter_a, meter_b) = (pass_a.close(), pass_b.close());
        let spent = [&meter_a, &meter_b]
            .iter()
            .map(|m| m.counts.total())
            .sum::<u64>();
        assert!(
            spent <= budget + reservation,
            "trial {trial}: {spent} tokens spent on a daily budget of {budget} (one reservation is {reservation})"
        );
        let reset = [&meter_a, &meter_b]
            .iter()
            .find_map(|m| m.rate_limited.clone())
            .expect("the stage that hit the limit is paused");
        assert_eq!(reset.0, proto::allotment::next_day(SystemTime::now()));
        assert!(reset.1.contains("daily budget exhausted"), "{}", reset.1);
        // The unspent rest of both allotments goes back: the pool's total is what was spent.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while allotter.allotted("claude").tokens != spent && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(allotter.allotted("claude").tokens, spent, "trial {trial}");
    }
}

/// A provider's 429 with `retry-after: 5` halts the stage, records the reset on the pass,
/// and the gateway answers the profile's next call itself until then.
/// Catches: a rate limit passed on as a plain failure, the reset time lost, a paused
/// profile that keeps hammering the provider.
#[tokio::test]
async fn a_rate_limit_halts_the_stage_and_rests_the_profile() {
    let setup = setup(Provider::default(), None).await;
    *setup.provider.rate_limit.lock().unwrap() = Some(5);
    let run = Uuid::new_v4();
    let pass = pass(&setup.gateway, run, "fake", Limits::default());
    let halted = pass.halted();
    let token = pass.token().to_string();
    let (status, _) = call(setup.address, "/fake/v1/messages", &token, body(5)).await;
    assert_eq!(status, 429);
    assert!(halted.is_cancelled());
    let (status, text) = call(setup.address, "/fake/v1/messages", &token, body(5)).await;
    assert_eq!(status, 429);
    assert!(text.contains("rests for"), "{text}");
    assert_eq!(
        setup.provider.seen.lock().unwrap().len(),
        1,
        "the second call stayed here"
    );
    let meter = pass.close();
    let (until, reason) = meter.rate_limited.expect("the pass holds the rate limit");
    let wait = until
        .duration_since(SystemTime::now())
        .unwrap()
        .as_secs_f64();
    assert!((3.0..=5.5).contains(&wait), "{wait}");
    assert!(reason.contains("429"), "{reason}");
}

/// The first event reaches the stage while the provider still holds the rest.
/// Catches: an answer buffered whole before it is passed on (a streaming CLI would stall).
#[tokio::test]
async fn a_stream_is_passed_on_as_it_arrives() {
    let hold = Arc::new(Notify::new());
    let setup = setup(
        Provider {
            hold: Some(Arc::clone(&hold)),
            ..Default::default()
        },
        None,
    )
    .await;
    let pass = pass(&setup.gateway, Uuid::new_v4(), "fake", Limits::default());
    let mut response = reqwest::Client::new()
        .post(format!("http://{}/fake/v1/messages", setup.address))
        .header("x-api-key", pass.token())
        .body(body(9))
        .send()
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), response.chunk())
        .await
        .expect("the first event arrives while the provider holds the rest")
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(&first).contains("message_start"));
    hold.notify_one();
    let mut rest = String::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(rest.contains("message_stop"), "{rest}");
    assert_eq!(pass.close().counts.output, 9);
}
