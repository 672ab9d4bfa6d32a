//! The gateway against a hostile stage, judged by what a fake provider that bills like a real
//! one received and billed: it bills every request it accepts for the whole body as input and
//! every answer's whole output allowance (`n` answers for `n`, `candidateCount` for Gemini),
//! and states usage only where the real API does (a Chat Completions stream only when
//! `stream_options.include_usage` asks; an Anthropic stream only in its `message_delta`, which
//! a stage may never read). Two gateways stand for two workers sharing one profile's day.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Uri};
use axum::response::Response;
use forgepool_gateway as gateway;
use gateway::daily::{Allotter, LocalAllotter};
use gateway::{Amount, Gateway, Limits, Pass, PassRequest, Providers, Settings};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const KEY: &str = "sk-real-provider-key-HOSTILE-0451";
/// US dollars per million tokens, input and output: dear, so that a few answers matter.
const INPUT_PRICE: f64 = 1000.0;
const OUTPUT_PRICE: f64 = 10_000.0;

/// What the fake provider received and billed.
#[derive(Default)]
struct Billing {
    billed_usd: Mutex<f64>,
    requests: Mutex<Vec<(String, HeaderMap, String)>>,
    /// Answers that echo the key they were sent (header, body and stream).
    echo: bool,
}

fn cost(input: u64, output: u64) -> f64 {
    (input as f64 * INPUT_PRICE + output as f64 * OUTPUT_PRICE) / 1_000_000.0
}

fn sse(events: &[String]) -> Body {
    let chunks: Vec<Result<String, std::io::Error>> = events.iter().cloned().map(Ok).collect();
    // One chunk per event, a little apart: a stage can hang up between any two.
    let stream = futures_util::stream::iter(chunks).then(|chunk| async move {
        tokio::time::sleep(Duration::from_millis(2)).await;
        chunk
    });
    Body::from_stream(stream)
}

use futures_util::StreamExt;

async fn provider(
    State(billing): State<Arc<Billing>>,
    uri: Uri,
    headers: HeaderMap,
    body: String,
) -> Response {
    billing
        .requests
        .lock()
        .unwrap()
        .push((uri.to_string(), headers.clone(), body.clone()));
    let value: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let path = uri.path();
    // The free route is rate-limited by the provider: a stage can provoke 429s there at will.
    if path.ends_with("/count_tokens") {
        return Response::builder()
            .status(429)
            .header("retry-after", "86400")
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
            ))
            .unwrap();
    }
    let key = headers
        .get("x-api-key")
        .or_else(|| headers.get("authorization"))
        .or_else(|| headers.get("x-goog-api-key"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let input = body.len() as u64;
    let (allowance, answers) = if path.contains("models/") {
        let config = &value["generationConfig"];
        (
            config["maxOutputTokens"].as_u64().unwrap_or(100),
            config["candidateCount"].as_u64().unwrap_or(1),
        )
    } else {
        let limit = value["max_tokens"]
            .as_u64()
            .or(value["max_completion_tokens"].as_u64())
            .or(value["max_output_tokens"].as_u64())
            .unwrap_or(100);
        (limit, value["n"].as_u64().unwrap_or(1))
    };
    let output = allowance * answers;
    *billing.billed_usd.lock().unwrap() += cost(input, output);
    let echoed = if billing.echo {
        key.clone()
    } else {
        String::new()
    };
    let stream = value["stream"].as_bool() == Some(true) || path.contains("stream");
    let builder = Response::builder().header("x-echo", format!("seen {echoed}"));
    let (content_type, body) = if path.ends_with("/v1/messages") {
        if stream {
            let events = vec![
                format!("event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"model\":\"fake-model\",\"usage\":{{\"input_tokens\":{input},\"output_tokens\":1}}}}}}\n\n"),
                format!("event: content_block_start\ndata: {{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{{\"type\":\"text\",\"text\":\"{echoed}\"}}}}\n\n"),
                "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n".to_string(),
                format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{output}}}}}\n\n"),
                "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_string(),
            ];
            ("text/event-stream", sse(&events))
        } else {
            let text = format!("{{\"type\":\"message\",\"model\":\"fake-model\",\"content\":[{{\"type\":\"text\",\"text\":\"{echoed}\"}}],\"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output}}}}}");
            ("application/json", Body::from(text))
        }
    } else if path.ends_with("/chat/completions") {
        if stream {
            let mut events: Vec<String> = (0..answers)
                .map(|i| format!("data: {{\"model\":\"fake-model\",\"choices\":[{{\"index\":{i},\"delta\":{{\"content\":\"{echoed}\"}}}}]}}\n\n"))
                .collect();
            if value["stream_options"]["include_usage"] == true {
                events.push(format!("data: {{\"model\":\"fake-model\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{input},\"completion_tokens\":{output}}}}}\n\n"));
            }
            events.push("data: [DONE]\n\n".to_string());
            ("text/event-stream", sse(&events))
        } else {
            let text = format!("{{\"model\":\"fake-model\",\"choices\":[{{\"message\":{{\"content\":\"{echoed}\"}}}}],\"usage\":{{\"prompt_tokens\":{input},\"completion_tokens\":{output}}}}}");
            ("application/json", Body::from(text))
        }
    } else if path.ends_with("/v1/responses") {
        let text = format!("{{\"object\":\"response\",\"model\":\"fake-model\",\"output_text\":\"{echoed}\",\"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output}}}}}");
        ("application/json", Body::from(text))
    } else {
        // Gemini: running figures in every chunk; the last ends its candidates.
        let chunk = |out: u64, done: bool| {
            let finish = if done {
                ",\"finishReason\":\"STOP\""
            } else {
                ""
            };
            format!("data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":\"{echoed}\"}}]}}{finish}}}],\"usageMetadata\":{{\"promptTokenCount\":{input},\"candidatesTokenCount\":{out}}},\"modelVersion\":\"fake-model\"}}\n\n")
        };
        let events = vec![
            chunk(1, false),
            chunk(output / 2, false),
            chunk(output, true),
        ];
        ("text/event-stream", sse(&events))
    };
    builder
        .header("content-type", content_type)
        .body(body)
        .unwrap()
}

struct Setup {
    gateway: Arc<Gateway>,
    billing: Arc<Billing>,
    address: SocketAddr,
    _stop: tokio_util::sync::DropGuard,
}

const APIS: [(&str, &str); 4] = [
    ("anthropic-messages", "anthropic"),
    ("openai-chat", "chat"),
    ("openai-responses", "responses"),
    ("gemini", "gemini"),
];

async fn setup(billing: Billing, allotter: Option<Arc<dyn Allotter>>) -> Setup {
    let billing = Arc::new(billing);
    let app = axum::Router::new()
        .fallback(axum::routing::any(provider))
        .layer(axum::extract::DefaultBodyLimit::max(64 << 20))
        .with_state(Arc::clone(&billing));
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
    let mut file = String::new();
    for (api, name) in APIS {
        file.push_str(&format!(
            "[[provider]]\nname = \"{name}\"\napi = \"{api}\"\nbase_url = \"http://{upstream_address}\"\nkey_env = \"FAKE_KEY\"\norganization = \"org-operator\"\n[provider.prices.\"*\"]\ninput_per_mtok = {INPUT_PRICE}\noutput_per_mtok = {OUTPUT_PRICE}\nmax_output_tokens = 100\n"
        ));
    }
    let gateway = Gateway::new(Settings {
        providers: Some(Providers::parse(&file).unwrap()),
        keys: Some(HashMap::from([("FAKE_KEY".to_string(), KEY.to_string())])),
        peers: None,
        metrics: None,
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
        billing,
        address,
        _stop: stop.drop_guard(),
    }
}

fn pass(gateway: &Arc<Gateway>, run: Uuid, provider: &str, limits: Limits, daily: bool) -> Pass {
    gateway
        .pass(PassRequest {
            run_id: run,
            profile: "claude".into(),
            provider: provider.into(),
            container: "stage".into(),
            limits,
            spent: Amount::default(),
            lifetime: Duration::from_secs(600),
            daily_budget: daily,
            server_tools: Vec::new(),
        })
        .unwrap()
}

/// The tricks a stage plays with ordinary API parameters.
#[derive(Clone, Copy, Debug)]
enum Trick {
    /// A Chat Completions stream that does not ask for its usage.
    ChatStreamWithoutUsage,
    /// A Chat Completions stream that says it wants no usage.
    ChatStreamRefusingUsage,
    /// Many answers to one request.
    ManyChoices,
    /// An Anthropic stream dropped after `content_block_stop`, before `message_delta`.
    AnthropicStreamDropped,
    /// Gemini candidates, its stream dropped after the first chunk.
    GeminiCandidatesDropped,
    /// A Responses call that names no output limit.
    ResponsesWithoutLimit,
}

const TRICKS: [Trick; 6] = [
    Trick::ChatStreamWithoutUsage,
    Trick::ChatStreamRefusingUsage,
    Trick::ManyChoices,
    Trick::AnthropicStreamDropped,
    Trick::GeminiCandidatesDropped,
    Trick::ResponsesWithoutLimit,
];

/// The provider a trick calls, its path, body, and the text after which the stage hangs up.
fn request_for(
    trick: Trick,
    n: usize,
) -> (&'static str, &'static str, String, Option<&'static str>) {
    let messages = r#""messages":[{"role":"user","content":"hi"}]"#;
    match trick {
        Trick::ChatStreamWithoutUsage => (
            "chat",
            "/v1/chat/completions",
            format!(r#"{{"model":"fake-model","max_tokens":50,"stream":true,{messages}}}"#),
            None,
        ),
        Trick::ChatStreamRefusingUsage => (
            "chat",
            "/v1/chat/completions",
            format!(r#"{{"model":"fake-model","max_tokens":50,"stream":true,"stream_options":{{"include_usage":false}},{messages}}}"#),
            None,
        ),
        Trick::ManyChoices => (
            "chat",
            "/v1/chat/completions",
            // Most ask for a few answers; some for 64, more than a run's budget holds.
            format!(
                r#"{{"model":"fake-model","max_tokens":50,"n":{},{messages}}}"#,
                if n.is_multiple_of(8) { 64 } else { 3 }
            ),
            None,
        ),
        Trick::AnthropicStreamDropped => (
            "anthropic",
            "/v1/messages",
            format!(r#"{{"model":"fake-model","max_tokens":50,"stream":true,{messages}}}"#),
            Some("content_block_stop"),
        ),
        Trick::GeminiCandidatesDropped => (
            "gemini",
            "/v1beta/models/fake-model:streamGenerateContent?alt=sse",
            r#"{"contents":[{"parts":[{"text":"hi"}]}],"generationConfig":{"candidateCount":4,"maxOutputTokens":40}}"#.to_string(),
            Some("candidatesTokenCount"),
        ),
        Trick::ResponsesWithoutLimit => (
            "responses",
            "/v1/responses",
            r#"{"model":"fake-model","input":"hi"}"#.to_string(),
            None,
        ),
    }
}

/// Sends one request of `trick` with the pass's token; reads the answer to its end, or hangs
/// up after the text the trick names. The status.
async fn play(
    client: &reqwest::Client,
    address: SocketAddr,
    token: &str,
    trick: Trick,
    n: usize,
) -> u16 {
    let (_, path, body, hang_up) = request_for(trick, n);
    let provider = request_for(trick, n).0;
    let mut request = client
        .post(format!("http://{address}/{provider}{path}"))
        .body(body);
    request = match provider {
        "anthropic" => request.header("x-api-key", token),
        "gemini" => request.header("x-goog-api-key", token),
        _ => request.bearer_auth(token),
    };
    let Ok(mut response) = request.send().await else {
        return 0;
    };
    let status = response.status().as_u16();
    let mut seen = String::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
        if hang_up.is_some_and(|text| seen.contains(text)) {
            break;
        }
    }
    status
}

/// 100 trials of 64 requests at once, 32 through each of two gateways (two workers), each
/// gateway's on a run of its own with a run budget, both runs of one profile with a daily
/// budget shared through one allotter. Whatever the tricks: neither run, nor the day, is billed
/// past its budget and one reservation; and each run's recorded cost is never below what the
/// provider billed it.
async fn trials(tricks: &[Trick]) {
    let client = reqwest::Client::new();
    let run_budget = 2.0;
    let day_budget = 3.0;
    // The dearest single request of any trick: 64 answers of 50 tokens and its body.
    let one_reservation = cost(200, 64 * 50);
    for trial in 0..100 {
        let allotter = Arc::new(LocalAllotter::new(HashMap::from([(
            "claude".to_string(),
            proto::Budget {
                max_cost_usd: Some(day_budget),
                max_tokens: None,
            },
        )])));
        let shared = Arc::clone(&allotter) as Arc<dyn Allotter>;
        let workers = [
            setup(Billing::default(), Some(Arc::clone(&shared))).await,
            setup(Billing::default(), Some(shared)).await,
        ];
        let limits = Limits {
            max_tokens: None,
            max_cost_usd: Some(run_budget),
        };
        let mut passes: Vec<Vec<Pass>> = Vec::new();
        for worker in &workers {
            let run = Uuid::new_v4();
            passes.push(
                APIS.iter()
                    .map(|(_, name)| pass(&worker.gateway, run, name, limits, true))
                    .collect(),
            );
        }
        let calls = (0..64).map(|n| {
            let w = n % 2;
            let trick = tricks[(n / 2) % tricks.len()];
            let provider = request_for(trick, n).0;
            let index = APIS.iter().position(|(_, name)| *name == provider).unwrap();
            let token = passes[w][index].token().to_string();
            let (client, address) = (client.clone(), workers[w].address);
            async move { play(&client, address, &token, trick, n).await }
        });
        let statuses = futures_util::future::join_all(calls).await;
        assert!(
            statuses.iter().all(|s| [200, 403, 429].contains(s)),
            "trial {trial}: {statuses:?}"
        );
        // Every answer is settled once its body is gone.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let mut day_billed = 0.0;
        for (worker, passes) in workers.iter().zip(passes) {
            let billed = *worker.billing.billed_usd.lock().unwrap();
            day_billed += billed;
            let recorded: f64 = passes.into_iter().map(|p| p.close().cost_usd).sum();
            assert!(
                billed <= run_budget + one_reservation + 1e-9,
                "trial {trial} {tricks:?}: a run was billed ${billed:.4} on a budget of ${run_budget}"
            );
            assert!(
                recorded + 1e-9 >= billed,
                "trial {trial} {tricks:?}: the run recorded ${recorded:.4}, the provider billed ${billed:.4}"
            );
        }
        assert!(
            day_billed <= day_budget + one_reservation + 1e-9,
            "trial {trial} {tricks:?}: the day was billed ${day_billed:.4} on a budget of ${day_budget}"
        );
        assert!(
            statuses.contains(&200),
            "trial {trial}: nothing was admitted {statuses:?}"
        );
    }
}

/// Catches: a stream that states no usage settled at nothing (12x past the budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_without_usage_cannot_pass_a_budget() {
    trials(&[Trick::ChatStreamWithoutUsage]).await;
    trials(&[Trick::ChatStreamRefusingUsage]).await;
}

/// Catches: `n` answers reserved as one (77x past the budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_answers_cannot_pass_a_budget() {
    trials(&[Trick::ManyChoices]).await;
}

/// Catches: a stream cut before its final usage settled at what was read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_dropped_before_their_usage_cannot_pass_a_budget() {
    trials(&[Trick::AnthropicStreamDropped]).await;
    trials(&[Trick::GeminiCandidatesDropped]).await;
}

/// Catches: any of the tricks working together where each alone fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_trick_together_cannot_pass_a_budget() {
    trials(&TRICKS).await;
}

/// A Chat Completions stream that did not ask for its usage is asked for it: the provider
/// received `include_usage`, and the run recorded what it billed, to the cent.
/// Catches: the gateway settling such streams at their reservation only (every stream would
/// cost its whole worst case), or not forwarding the rewritten body.
#[tokio::test]
async fn a_chat_stream_is_asked_for_its_usage_and_recorded_exactly() {
    let setup = setup(Billing::default(), None).await;
    let pass = pass(
        &setup.gateway,
        Uuid::new_v4(),
        "chat",
        Limits::default(),
        false,
    );
    let status = play(
        &reqwest::Client::new(),
        setup.address,
        pass.token(),
        Trick::ChatStreamWithoutUsage,
        1,
    )
    .await;
    assert_eq!(status, 200);
    let received = setup.billing.requests.lock().unwrap()[0].2.clone();
    let value: serde_json::Value = serde_json::from_str(&received).unwrap();
    assert_eq!(value["stream_options"]["include_usage"], true, "{received}");
    let billed = *setup.billing.billed_usd.lock().unwrap();
    let recorded = pass.close().cost_usd;
    assert!(
        (recorded - billed).abs() < 1e-9,
        "{recorded} against {billed}"
    );
}

async fn call(
    address: SocketAddr,
    provider: &str,
    path: &str,
    token: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, HeaderMap, String) {
    let mut request = reqwest::Client::new()
        .post(format!("http://{address}/{provider}{path}"))
        .body(body.to_string());
    request = match provider {
        "anthropic" => request.header("x-api-key", token),
        "gemini" => request.header("x-goog-api-key", token),
        _ => request.bearer_auth(token),
    };
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

/// Requests that would make the provider reach addresses the stage names, or act for another
/// account, reach no upstream; a request within the rules reaches it with only the allowed
/// headers and the operator's organization.
/// Catches: `mcp_servers`, web tools or unlisted betas forwarded (the provider fetches or posts
/// anywhere, around `network = "none"`), a stage choosing the key's organization, or request
/// headers passed as the stage wrote them.
#[tokio::test]
async fn requests_that_reach_the_network_through_the_provider_reach_no_upstream() {
    let setup = setup(Billing::default(), None).await;
    let run = Uuid::new_v4();
    let passes: HashMap<&str, Pass> = APIS
        .iter()
        .map(|(_, name)| {
            (
                *name,
                pass(&setup.gateway, run, name, Limits::default(), false),
            )
        })
        .collect();
    let refused = [
        (
            "anthropic",
            "/v1/messages",
            vec![],
            r#"{"model":"fake-model","max_tokens":5,"mcp_servers":[{"type":"url","url":"https://attacker.example/mcp","name":"x"}],"messages":[]}"#,
        ),
        (
            "anthropic",
            "/v1/messages",
            vec![],
            r#"{"model":"fake-model","max_tokens":5,"tools":[{"type":"web_fetch_20250910","name":"web_fetch"}],"messages":[]}"#,
        ),
        (
            "anthropic",
            "/v1/messages",
            vec![(
                "anthropic-beta",
                "claude-code-20250219,mcp-client-2025-04-04",
            )],
            r#"{"model":"fake-model","max_tokens":5,"messages":[]}"#,
        ),
        (
            "anthropic",
            "/v1/messages",
            vec![("anthropic-beta", "context-1m-2025-08-07")],
            r#"{"model":"fake-model","max_tokens":5,"messages":[]}"#,
        ),
        (
            "responses",
            "/v1/responses",
            vec![],
            r#"{"model":"fake-model","max_output_tokens":5,"tools":[{"type":"mcp","server_url":"https://attacker.example"}],"input":"x"}"#,
        ),
        (
            "responses",
            "/v1/responses",
            vec![],
            r#"{"model":"fake-model","max_output_tokens":5,"tools":[{"type":"web_search"}],"input":"x"}"#,
        ),
        (
            "responses",
            "/v1/responses",
            vec![("openai-organization", "org-attacker")],
            r#"{"model":"fake-model","max_output_tokens":5,"input":"x"}"#,
        ),
        (
            "chat",
            "/v1/chat/completions",
            vec![],
            r#"{"model":"fake-model","max_tokens":5,"web_search_options":{},"messages":[]}"#,
        ),
        (
            "chat",
            "/v1/chat/completions",
            vec![],
            r#"{"model":"fake-model","max_tokens":5,"service_tier":"priority","messages":[]}"#,
        ),
        (
            "gemini",
            "/v1beta/models/fake-model:generateContent",
            vec![],
            r#"{"contents":[],"tools":[{"url_context":{}}],"generationConfig":{"maxOutputTokens":5}}"#,
        ),
        (
            "gemini",
            "/v1beta/models/fake-model:generateContent",
            vec![],
            r#"{"contents":[],"tools":[{"googleSearch":{}}],"generationConfig":{"maxOutputTokens":5}}"#,
        ),
    ];
    for (provider, path, headers, body) in &refused {
        let (status, _, text) = call(
            setup.address,
            provider,
            path,
            passes[provider].token(),
            headers,
            body,
        )
        .await;
        assert!(
            [400, 403].contains(&status) && text.contains("forgepool gateway"),
            "{provider} {body} {headers:?}: {status} {text}"
        );
    }
    assert!(
        setup.billing.requests.lock().unwrap().is_empty(),
        "a refused request reached the provider"
    );

    let (status, _, _) = call(
        setup.address,
        "anthropic",
        "/v1/messages",
        passes["anthropic"].token(),
        &[
            (
                "anthropic-beta",
                "claude-code-20250219,some-new-beta-2026-12-01,interleaved-thinking-2025-05-14",
            ),
            ("anthropic-version", "2023-06-01"),
            ("x-stage-note", "exfiltrated"),
            ("cookie", "a=b"),
        ],
        r#"{"model":"fake-model","max_tokens":5,"tools":[{"name":"Bash","input_schema":{}}],"messages":[]}"#,
    )
    .await;
    assert_eq!(status, 200);
    let (status, _, _) = call(
        setup.address,
        "responses",
        "/v1/responses",
        passes["responses"].token(),
        &[],
        r#"{"model":"fake-model","max_output_tokens":5,"input":"x"}"#,
    )
    .await;
    assert_eq!(status, 200);
    let requests = setup.billing.requests.lock().unwrap();
    let (_, headers, _) = &requests[0];
    let allowed = [
        "accept",
        "accept-encoding",
        "anthropic-beta",
        "anthropic-version",
        "content-length",
        "content-type",
        "host",
        "user-agent",
        "x-api-key",
    ];
    for name in headers.keys() {
        assert!(allowed.contains(&name.as_str()), "{name} was forwarded");
    }
    assert_eq!(
        headers["anthropic-beta"],
        "claude-code-20250219,interleaved-thinking-2025-05-14"
    );
    assert!(!headers.contains_key("x-stage-note") && !headers.contains_key("cookie"));
    assert_eq!(requests[1].1["openai-organization"], "org-operator");
}

/// A provider that echoes the key it was sent, in a header, a body and a stream: the stage
/// sees none of it.
/// Catches: answer headers passed unless on a drop list, bodies passed unchanged, a key cut
/// across two chunks of a stream.
#[tokio::test]
async fn an_echoed_key_never_reaches_the_stage() {
    let setup = setup(
        Billing {
            echo: true,
            ..Billing::default()
        },
        None,
    )
    .await;
    let run = Uuid::new_v4();
    for (provider, path, body) in [
        (
            "anthropic",
            "/v1/messages",
            r#"{"model":"fake-model","max_tokens":5,"messages":[]}"#,
        ),
        (
            "anthropic",
            "/v1/messages",
            r#"{"model":"fake-model","max_tokens":5,"stream":true,"messages":[]}"#,
        ),
        (
            "chat",
            "/v1/chat/completions",
            r#"{"model":"fake-model","max_tokens":5,"stream":true,"messages":[]}"#,
        ),
        (
            "gemini",
            "/v1beta/models/fake-model:streamGenerateContent",
            r#"{"contents":[],"generationConfig":{"maxOutputTokens":5}}"#,
        ),
    ] {
        let pass = pass(&setup.gateway, run, provider, Limits::default(), false);
        let (status, headers, text) =
            call(setup.address, provider, path, pass.token(), &[], body).await;
        assert_eq!(status, 200, "{provider}: {text}");
        assert!(
            !text.contains(KEY),
            "{provider}: the body holds the key: {text}"
        );
        assert!(
            text.contains("****"),
            "{provider}: the key was masked in place: {text}"
        );
        for (name, value) in &headers {
            assert!(
                !value.to_str().unwrap_or("").contains(KEY),
                "{provider}: header {name} holds the key"
            );
        }
        assert!(
            !headers.contains_key("x-echo"),
            "an unlisted answer header passed"
        );
    }
}

/// A stage that provokes the provider's 429s on the free `count_tokens` route pauses nothing:
/// its pass holds no rate limit, it is not halted, and the profile's spending calls still go
/// through; past 60 calls a minute the gateway answers them itself.
/// Catches: a free route's 429 taken for the provider's view of the profile (a stage could
/// rest its profile across the pool for a day).
#[tokio::test]
async fn a_free_routes_429_pauses_nothing() {
    let setup = setup(Billing::default(), None).await;
    let pass = pass(
        &setup.gateway,
        Uuid::new_v4(),
        "anthropic",
        Limits::default(),
        false,
    );
    // The provider answers count_tokens 429 (a day's reset); past the stage's rate, the
    // gateway answers 429 itself without asking it.
    let mut ours = 0;
    for _ in 0..70 {
        let (status, headers, text) = call(
            setup.address,
            "anthropic",
            "/v1/messages/count_tokens",
            pass.token(),
            &[],
            r#"{"model":"fake-model","messages":[]}"#,
        )
        .await;
        assert_eq!(status, 429, "{text}");
        assert!(headers.contains_key("retry-after"));
        ours += usize::from(text.contains("forgepool gateway"));
    }
    assert_eq!(ours, 10, "the gateway answered past 60 calls a minute");
    assert_eq!(
        setup.billing.requests.lock().unwrap().len(),
        60,
        "the provider saw the stage's first 60 calls only"
    );
    assert!(
        !pass.halted().is_cancelled(),
        "a free route halted the stage"
    );
    assert!(
        pass.rate_limited().is_none(),
        "a free route paused the profile"
    );
    let (status, _, _) = call(
        setup.address,
        "anthropic",
        "/v1/messages",
        pass.token(),
        &[],
        r#"{"model":"fake-model","max_tokens":5,"messages":[]}"#,
    )
    .await;
    assert_eq!(status, 200, "the profile's spending calls go on");
}

/// 1,100 idle connections from one stage to the relay, none of them sending a byte: another
/// stage's call through the same relay is answered.
/// Catches: one shared cap on connections (one stage takes every place and the others'
/// connections are reset), idle connections that hold a place for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_of_one_stage_leave_the_others_answered() {
    let setup = setup(Billing::default(), None).await;
    let folder = tempfile::tempdir().unwrap();
    let socket = folder.path().join("gateway.sock");
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    tokio::spawn(gateway::serve_unix(
        tokio::net::UnixListener::bind(&socket).unwrap(),
        Arc::clone(&setup.gateway),
        stop.clone(),
    ));
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_address = relay.local_addr().unwrap();
    tokio::spawn(gateway::relay::relay(relay, socket, stop.clone()));
    let mut idle = Vec::new();
    for _ in 0..1100 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        idle.push(socket.connect(relay_address).await.unwrap());
    }
    let pass = pass(
        &setup.gateway,
        Uuid::new_v4(),
        "anthropic",
        Limits::default(),
        false,
    );
    let client = reqwest::Client::builder()
        .local_address("127.0.0.3".parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let answered = tokio::time::timeout(
        Duration::from_secs(10),
        client
            .post(format!("http://{relay_address}/anthropic/v1/messages"))
            .header("x-api-key", pass.token())
            .body(r#"{"model":"fake-model","max_tokens":5,"messages":[]}"#)
            .send(),
    )
    .await
    .expect("another stage's call is answered while one stage holds 1,100 connections")
    .expect("another stage's call is not reset");
    assert_eq!(answered.status(), 200);
    drop(idle);
}

/// The child process of [`three_big_bodies_grow_the_gateway_by_at_most_64_mb`]: a gateway
/// alone in its process, so its memory is measured apart from the client's and the
/// provider's. Does nothing unless the parent started it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_child_process() {
    let Ok(upstream) = std::env::var("HOSTILE_UPSTREAM") else {
        return;
    };
    let providers = Providers::parse(&format!(
        "[[provider]]\nname = \"anthropic\"\napi = \"anthropic-messages\"\nbase_url = \"http://{upstream}\"\nkey_env = \"FAKE_KEY\"\n[provider.prices.\"*\"]\ninput_per_mtok = 0.0\noutput_per_mtok = 1.0\n"
    ))
    .unwrap();
    let gateway = Gateway::new(Settings {
        providers: Some(providers),
        keys: Some(HashMap::from([("FAKE_KEY".to_string(), KEY.to_string())])),
        peers: None,
        metrics: None,
        root: "http://gateway".into(),
        allotter: None,
    })
    .unwrap();
    let pass = pass(
        &gateway,
        Uuid::new_v4(),
        "anthropic",
        Limits::default(),
        false,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("CHILD {} {}", listener.local_addr().unwrap(), pass.token());
    let stop = CancellationToken::new();
    tokio::spawn(gateway::serve_tcp(listener, gateway, stop.clone()));
    // Until the parent closes its standard input.
    let _ =
        tokio::task::spawn_blocking(|| std::io::Read::read(&mut std::io::stdin(), &mut [0u8; 1]))
            .await;
    stop.cancel();
}

fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Three requests of 31 MiB at once from one stage: the gateway's peak memory grows by at
/// most 64 MB, and all three are answered.
/// Catches: a body parsed whole into a JSON value (16-18 times its size: two such grew a
/// worker by 1 GB), or bodies held without a bound per stage and per worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_big_bodies_grow_the_gateway_by_at_most_64_mb() {
    let setup = setup(Billing::default(), None).await;
    let upstream = {
        // The fake provider's address: the providers file of `setup` names it.
        let provider = setup.gateway.providers().get("anthropic").unwrap();
        provider.base_url.trim_start_matches("http://").to_string()
    };
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["gateway_child_process", "--exact", "--nocapture"])
        .env("HOSTILE_UPSTREAM", &upstream)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let line = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("CHILD "))
    })
    .await
    .unwrap()
    .expect("the child gateway started");
    let mut words = line.split(' ').skip(1);
    let (address, token) = (
        words.next().unwrap().to_string(),
        words.next().unwrap().to_string(),
    );
    let client = reqwest::Client::new();
    let big = |size: usize| {
        let mut body = String::from(
            r#"{"model":"fake-model","max_tokens":5,"messages":[{"role":"user","content":""#,
        );
        body.push_str(&"x".repeat(size));
        body.push_str(r#""}]}"#);
        body
    };
    let send = |body: String| {
        let (client, address, token) = (client.clone(), address.clone(), token.clone());
        async move {
            client
                .post(format!("http://{address}/anthropic/v1/messages"))
                .header("x-api-key", token)
                .body(body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(send(big(1024)).await, 200);
    let before = status_kib(child.id(), "VmHWM:");
    let statuses = futures_util::future::join_all((0..3).map(|_| send(big(31 << 20)))).await;
    let peak = status_kib(child.id(), "VmHWM:");
    drop(child.stdin.take());
    let _ = child.wait();
    assert_eq!(statuses, [200, 200, 200]);
    let grown_mb = (peak.saturating_sub(before)) as f64 / 1024.0;
    eprintln!("three 31 MiB bodies grew the gateway's peak memory by {grown_mb:.1} MB");
    assert!(
        grown_mb <= 64.0,
        "three 31 MiB bodies grew the gateway by {grown_mb:.1} MB"
    );
}
