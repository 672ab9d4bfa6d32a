//! The gateway's HTTP side: one connection per relay connection (or a TCP client in tests),
//! each request checked, reserved, forwarded with the provider's key, and its answer streamed
//! back through the meter.

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::api::{Api, Call};
use crate::ledger::{Amount, Reservation};
use crate::meter::Meter;
use crate::metered::MeteredBody;
use crate::providers::{Price, Provider, DEFAULT_MAX_OUTPUT_TOKENS};
use crate::{reset, Gateway, GrantState, PEER_PREFACE};

/// The largest request body forwarded.
pub const MAX_REQUEST_BODY: usize = 32 * 1024 * 1024;
/// The time a client has to send its whole request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The time a provider has to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest silence within a provider's answer (between its bytes).
const READ_TIMEOUT: Duration = Duration::from_secs(300);
/// The most connections served at once.
const MAX_CONNECTIONS: usize = 1024;
/// The time the relay has to send its preface.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(5);

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// The HTTP client for one provider: no redirects (a redirect would carry the key
/// elsewhere), the system roots plus the provider's CA file, bounded connects and silences.
pub(crate) fn client_for(provider: &Provider) -> Result<reqwest::Client, String> {
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(CONNECT_TIMEOUT)
        .read_timeout(READ_TIMEOUT)
        .pool_idle_timeout(Duration::from_secs(60))
        .tcp_nodelay(true);
    if let Some(path) = &provider.ca_file {
        let pem = std::fs::read(path).map_err(|e| {
            format!(
                "provider {}: cannot read ca_file {}: {e}",
                provider.name,
                path.display()
            )
        })?;
        let certificate = reqwest::Certificate::from_pem(&pem).map_err(|e| {
            format!(
                "provider {}: ca_file {} is not a PEM certificate: {e}",
                provider.name,
                path.display()
            )
        })?;
        builder = builder.add_root_certificate(certificate);
    }
    builder
        .build()
        .map_err(|e| format!("provider {}: {e}", provider.name))
}

/// Serves relay connections on a Unix socket until `shutdown`: each starts with the relay's
/// preface naming the container that connected.
pub async fn serve_unix(
    listener: UnixListener,
    gateway: Arc<Gateway>,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "the gateway cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        let (gateway, shutdown) = (Arc::clone(&gateway), shutdown.clone());
        tokio::spawn(async move {
            let mut stream = stream;
            let Ok(Some(peer)) = tokio::time::timeout(PREFACE_TIMEOUT, preface(&mut stream)).await
            else {
                return;
            };
            connection(TokioIo::new(stream), gateway, peer, shutdown).await;
            drop(permit);
        });
    }
}

/// Serves TCP clients until `shutdown`, each known by its address (tests and benchmarks;
/// a worker serves stages through [`serve_unix`]).
pub async fn serve_tcp(listener: TcpListener, gateway: Arc<Gateway>, shutdown: CancellationToken) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, address) = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let (gateway, shutdown) = (Arc::clone(&gateway), shutdown.clone());
        tokio::spawn(async move {
            connection(TokioIo::new(stream), gateway, address.ip(), shutdown).await;
            drop(permit);
        });
    }
}

async fn connection<I>(
    io: TokioIo<I>,
    gateway: Arc<Gateway>,
    peer: IpAddr,
    shutdown: CancellationToken,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |request| {
        let gateway = Arc::clone(&gateway);
        async move { Ok::<_, Infallible>(handle(&gateway, peer, request).await) }
    });
    let served = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Some(REQUEST_TIMEOUT))
        .max_buf_size(64 * 1024)
        .serve_connection(io, service);
    tokio::pin!(served);
    tokio::select! {
        _ = &mut served => {}
        () = shutdown.cancelled() => {
            served.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(5), served).await;
        }
    }
}

/// Reads the relay's `FORGEPOOL-PEER address\n` line, byte by byte so that none of the HTTP
/// request behind it is consumed.
async fn preface(stream: &mut tokio::net::UnixStream) -> Option<IpAddr> {
    let mut line = Vec::with_capacity(64);
    loop {
        let byte = stream.read_u8().await.ok()?;
        if byte == b'\n' {
            break;
        }
        if line.len() >= 64 {
            return None;
        }
        line.push(byte);
    }
    let text = std::str::from_utf8(&line).ok()?;
    text.strip_prefix(PEER_PREFACE)?.trim().parse().ok()
}

/// A refused request, answered in the shape of the API's own errors so that the CLI prints
/// the message.
struct Refusal {
    status: StatusCode,
    api: Option<Api>,
    kind: &'static str,
    message: String,
    retry_after: Option<u64>,
}

impl Refusal {
    fn new(status: StatusCode, api: Option<Api>, kind: &'static str, message: String) -> Refusal {
        Refusal {
            status,
            api,
            kind,
            message,
            retry_after: None,
        }
    }

    fn response(self) -> Response<Body> {
        let message = format!("forgepool gateway: {}", self.message);
        let body = match self.api {
            Some(Api::AnthropicMessages) => {
                json!({"type": "error", "error": {"type": self.kind, "message": message}})
            }
            Some(Api::OpenaiResponses) | Some(Api::OpenaiChat) => {
                json!({"error": {"message": message, "type": self.kind, "code": self.kind}})
            }
            Some(Api::Gemini) => {
                json!({"error": {"code": self.status.as_u16(), "message": message, "status": self.kind}})
            }
            None => json!({"error": {"type": self.kind, "message": message}}),
        };
        let mut response = Response::new(full(Bytes::from(body.to_string())));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

fn full(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

async fn handle(
    gateway: &Arc<Gateway>,
    peer: IpAddr,
    request: Request<Incoming>,
) -> Response<Body> {
    let started = Instant::now();
    match forward(gateway, peer, request, started).await {
        Ok(response) => response,
        Err(refusal) => {
            tracing::debug!(status = refusal.status.as_u16(), message = %refusal.message, "the gateway refused a request");
            refusal.response()
        }
    }
}

/// Headers never forwarded either way: the connection's own, and every credential.
fn forwarded(name: &HeaderName) -> bool {
    !matches!(
        name.as_str(),
        "host"
            | "authorization"
            | "x-api-key"
            | "x-goog-api-key"
            | "api-key"
            | "cookie"
            | "content-length"
            | "connection"
            | "keep-alive"
            | "proxy-authorization"
            | "proxy-authenticate"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "accept-encoding"
            | "forwarded"
            | "x-forwarded-for"
    )
}

async fn forward(
    gateway: &Arc<Gateway>,
    peer: IpAddr,
    request: Request<Incoming>,
    started: Instant,
) -> Result<Response<Body>, Refusal> {
    let path = request.uri().path().to_string();
    let query = request.uri().query().map(str::to_string);
    let (name, rest) = path
        .strip_prefix('/')
        .and_then(|p| p.split_once('/'))
        .map(|(name, rest)| (name.to_string(), format!("/{rest}")))
        .unwrap_or_default();
    let provider = gateway.providers.get(&name).ok_or_else(|| {
        Refusal::new(
            StatusCode::NOT_FOUND,
            None,
            "not_found_error",
            format!(
                "no provider is called {name:?}; this gateway serves /{{provider}}/… for {}",
                gateway.providers.names().join(", ")
            ),
        )
    })?;
    let api = provider.api;
    let refuse = |status, kind, message: String| Refusal::new(status, Some(api), kind, message);
    let grant = authorize(gateway, provider, peer, &request, query.as_deref()).await?;
    let call = api.route(request.method(), &rest).ok_or_else(|| {
        refuse(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!(
                "{} {rest} is not a call of the {} API; the gateway forwards nothing else",
                request.method(),
                api.as_str()
            ),
        )
    })?;
    let profile = grant.request.profile.clone();
    if let Some(until) = gateway.paused(&profile, &provider.name) {
        let wait = until
            .duration_since(SystemTime::now())
            .unwrap_or_default()
            .as_secs()
            .max(1);
        let mut refusal = refuse(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!(
                "the provider {} rate-limited profile `{profile}`; it rests for {wait} s more",
                provider.name
            ),
        );
        refusal.retry_after = Some(wait);
        return Err(refusal);
    }
    let key = gateway.keys.get(&provider.name).ok_or_else(|| {
        refuse(
            StatusCode::BAD_GATEWAY,
            "api_error",
            format!("the worker has no key for {}", provider.name),
        )
    })?;
    let call = Admitted {
        gateway,
        provider,
        grant,
        call,
        rest,
        query,
        started,
    };
    let (parts, body, reservation, requested_model) = call.read_and_reserve(request).await?;
    let answer = call
        .send(parts, body, key, requested_model.as_deref())
        .await?;
    call.pass_on(answer, reservation, requested_model)
}

/// A request that passed its checks: what it may call, for whom.
struct Admitted<'g> {
    gateway: &'g Arc<Gateway>,
    provider: &'g Provider,
    grant: Arc<GrantState>,
    call: Call,
    rest: String,
    query: Option<String>,
    started: Instant,
}

impl Admitted<'_> {
    fn refuse(&self, status: StatusCode, kind: &'static str, message: String) -> Refusal {
        Refusal::new(status, Some(self.provider.api), kind, message)
    }

    /// Reads the body (bounded in size and time) and, for a call that spends tokens,
    /// reserves its worst case against the run's budget; a spent budget halts the stage.
    async fn read_and_reserve(
        &self,
        request: Request<Incoming>,
    ) -> Result<
        (
            http::request::Parts,
            Bytes,
            Option<Reservation>,
            Option<String>,
        ),
        Refusal,
    > {
        let (gateway, provider, api) = (self.gateway, self.provider, self.provider.api);
        let refuse = |status, kind, message| self.refuse(status, kind, message);
        let rest = &self.rest;
        let grant = &self.grant;
        let started = self.started;
        let profile = grant.request.profile.clone();
        let (parts, body) = request.into_parts();
        let body = tokio::time::timeout(
            REQUEST_TIMEOUT,
            Limited::new(body, MAX_REQUEST_BODY).collect(),
        )
        .await
        .map_err(|_| {
            refuse(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                "the request's body did not arrive in time".into(),
            )
        })?
        .map_err(|_| {
            refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("a request's body may hold at most {MAX_REQUEST_BODY} bytes"),
            )
        })?
        .to_bytes();
        let (reservation, requested_model) = match self.call {
            Call::Free => (None, None),
            Call::Spending => {
                let value: Value = serde_json::from_slice(&body).map_err(|e| {
                    refuse(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        format!("the request's body is not JSON: {e}"),
                    )
                })?;
                let model = api.requested_model(rest, &value);
                let price = provider.price(model.as_deref());
                let worst = worst_case(api, &value, body.len(), &price);
                match gateway.ledger.reserve(grant.request.run_id, worst) {
                    Ok(reservation) if grant.request.daily_budget => {
                        let hold = self.hold_daily(worst).await?;
                        (Some(reservation.with_daily(hold)), model)
                    }
                    Ok(reservation) => (Some(reservation), model),
                    Err(exhausted) => {
                        let mut meter = grant.meter.lock().unwrap_or_else(|p| p.into_inner());
                        meter.exhausted.get_or_insert(exhausted.0.clone());
                        drop(meter);
                        grant.halt.cancel();
                        gateway.observe_request(&profile, provider, None, 403, started);
                        return Err(refuse(
                            StatusCode::FORBIDDEN,
                            "budget_exhausted",
                            exhausted.0,
                        ));
                    }
                }
            }
        };
        Ok((parts, body, reservation, requested_model))
    }

    /// Holds a request's worst case against its profile's daily allotment. A spent day
    /// pauses the profile until the next UTC day, as a provider's quota would (the stage is
    /// halted and paused, and resumes by itself); no answer from the pool refuses this request
    /// only, as an overloaded provider would.
    async fn hold_daily(&self, worst: Amount) -> Result<crate::daily::DailyHold, Refusal> {
        let (gateway, grant) = (self.gateway, &self.grant);
        let Some(daily) = &gateway.daily else {
            return Err(self.refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded_error",
                "the profile's daily budget has nowhere to be checked".into(),
            ));
        };
        let profile = &grant.request.profile;
        match daily.reserve(profile, worst).await {
            Ok(hold) => Ok(hold),
            Err(crate::daily::Refused::Spent(reason)) => {
                let now = SystemTime::now();
                let until = proto::allotment::next_day(now);
                gateway.record_pause(grant, until, reason.clone());
                gateway.observe_request(profile, self.provider, None, 429, self.started);
                let mut refusal =
                    self.refuse(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", reason);
                refusal.retry_after = Some(
                    until
                        .duration_since(now)
                        .unwrap_or_default()
                        .as_secs()
                        .max(1),
                );
                Err(refusal)
            }
            Err(crate::daily::Refused::Unknown(reason)) => {
                gateway.observe_request(profile, self.provider, None, 503, self.started);
                Err(self.refuse(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded_error",
                    format!("the profile's daily budget cannot be checked now: {reason}"),
                ))
            }
        }
    }

    /// Forwards the request with the provider's key in place of every client credential.
    async fn send(
        &self,
        parts: http::request::Parts,
        body: Bytes,
        key: &str,
        requested_model: Option<&str>,
    ) -> Result<reqwest::Response, Refusal> {
        let (gateway, provider, api) = (self.gateway, self.provider, self.provider.api);
        let refuse = |status, kind, message| self.refuse(status, kind, message);
        let (rest, query, started) = (&self.rest, &self.query, self.started);
        let profile = self.grant.request.profile.clone();
        let mut url = format!("{}{rest}", provider.base_url);
        if let Some(query) = api.forwarded_query(query.as_deref()) {
            url.push('?');
            url.push_str(&query);
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &parts.headers {
            if forwarded(name) {
                headers.append(name.clone(), value.clone());
            }
        }
        let (key_name, key_value) = api.key_header(key);
        let mut key_value = HeaderValue::from_str(&key_value).map_err(|_| {
            refuse(
                StatusCode::BAD_GATEWAY,
                "api_error",
                "the worker's key is not a valid header value".into(),
            )
        })?;
        key_value.set_sensitive(true);
        headers.insert(HeaderName::from_static(key_name), key_value);
        headers.insert(
            http::header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        let client = &gateway.clients[&provider.name];
        let answer = client
            .request(parts.method, &url)
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|error| {
                gateway.observe_request(&profile, provider, requested_model, 502, started);
                refuse(
                    StatusCode::BAD_GATEWAY,
                    "api_error",
                    format!(
                        "the provider {} did not answer: {}",
                        provider.name,
                        error.without_url()
                    ),
                )
            })?;
        Ok(answer)
    }

    /// Passes the provider's answer on as it arrives, through the meter; a rate-limit answer
    /// pauses the profile and halts the stage first.
    fn pass_on(
        self,
        answer: reqwest::Response,
        reservation: Option<Reservation>,
        requested_model: Option<String>,
    ) -> Result<Response<Body>, Refusal> {
        let (gateway, provider, api) = (self.gateway, self.provider, self.provider.api);
        let grant = Arc::clone(&self.grant);
        let started = self.started;
        let status = answer.status();
        if reset::pauses(status.as_u16()) {
            let (until, named) = reset::reset_time(answer.headers(), SystemTime::now());
            let reason = format!(
                "the provider {} answered {}{}",
                provider.name,
                status.as_u16(),
                if named { "" } else { " without a reset time" }
            );
            gateway.record_pause(&grant, until, reason);
        }
        let stream = answer
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut response = Response::builder().status(status.as_u16());
        for (name, value) in answer.headers() {
            if forwarded(name) || name == http::header::CONTENT_LENGTH {
                response = response.header(name, value);
            }
        }
        grant
            .meter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .requests += 1;
        let metered = MeteredBody {
            inner: Box::pin(answer.bytes_stream()),
            meter: Some(Meter::new(api, stream)),
            reservation,
            grant,
            gateway: Arc::clone(gateway),
            price_of: provider.clone(),
            requested_model,
            status: status.as_u16(),
            started,
        };
        let body = StreamBody::new(metered).boxed_unsync();
        response.body(body).map_err(|e| {
            self.refuse(
                StatusCode::BAD_GATEWAY,
                "api_error",
                format!("the provider's answer could not be passed on: {e}"),
            )
        })
    }
}

/// Checks the request's token: known, alive, for this provider, used from its container.
async fn authorize(
    gateway: &Arc<Gateway>,
    provider: &Provider,
    peer: IpAddr,
    request: &Request<Incoming>,
    query: Option<&str>,
) -> Result<Arc<GrantState>, Refusal> {
    let api = provider.api;
    let refuse =
        |status, message: String| Refusal::new(status, Some(api), "authentication_error", message);
    let credential = api
        .client_credential(request.headers(), query)
        .ok_or_else(|| refuse(StatusCode::UNAUTHORIZED, "no stage token was sent".into()))?;
    let grant = gateway
        .grant(&credential)
        .filter(|grant| grant.expires > Instant::now())
        .ok_or_else(|| {
            refuse(
                StatusCode::UNAUTHORIZED,
                "the token is not a live stage's token (a stage's token dies when the stage ends)"
                    .into(),
            )
        })?;
    if grant.request.provider != provider.name {
        return Err(refuse(
            StatusCode::FORBIDDEN,
            format!(
                "this stage's token is for the provider {}, not {}",
                grant.request.provider, provider.name
            ),
        ));
    }
    if let Some(peers) = &gateway.peers {
        let pinned = *grant.peer.lock().unwrap_or_else(|p| p.into_inner());
        let expected = match pinned {
            Some(address) => Some(address),
            None => {
                let found = peers.address(&grant.request.container).await;
                if let Some(address) = found {
                    *grant.peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(address);
                }
                found
            }
        };
        if expected != Some(peer) {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "this token belongs to another container".into(),
            ));
        }
    }
    Ok(grant)
}

/// A request's worst case: every byte of its body a prompt token (a token is at least a
/// byte), its whole output allowance written, each priced at the dearest rate it may take.
fn worst_case(api: Api, body: &Value, body_bytes: usize, price: &Price) -> Amount {
    let output = api
        .requested_output_limit(body)
        .or(price.max_output_tokens)
        .unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS);
    let input = body_bytes as u64;
    Amount {
        tokens: input + output,
        cost_usd: (input as f64 * price.dearest_per_mtok() + output as f64 * price.output_per_mtok)
            / 1_000_000.0,
    }
}
