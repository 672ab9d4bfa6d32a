//! The gateway's HTTP side: one connection per relay connection (or a TCP client in tests),
//! each sender held to its share of connections (`conns`), each request checked, its body
//! held within the stage's and the worker's allowance, its worst case reserved, forwarded
//! with the provider's key and only the allowed headers, and its answer streamed back through
//! the meter with the key masked.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use serde_json::json;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::{Api, Call};
use crate::ledger::{Amount, Reservation};
use crate::meter::Meter;
use crate::metered::MeteredBody;
use crate::policy::Redactor;
use crate::providers::Provider;
use crate::request::{ask_for_usage, Asked, Worst};
use crate::{reset, Gateway, GrantState};

/// The largest request body forwarded, and the most of them one stage holds at once.
pub const MAX_REQUEST_BODY: usize = 32 * 1024 * 1024;
/// The most request body bytes every stage of the worker together holds at once: past it, a
/// request waits (within its time to send) for others to have been sent on.
pub const MAX_HELD_BODIES: usize = 48 * 1024 * 1024;
/// The calls of free routes (token counts, model lists) one stage may make in a minute; past
/// them the gateway answers 429 itself, and pauses nothing.
pub const FREE_CALLS_PER_MINUTE: u32 = 60;
/// The time a client has to send its whole request.
pub(crate) const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The time a provider has to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest silence within a provider's answer (between its bytes).
const READ_TIMEOUT: Duration = Duration::from_secs(300);

pub(crate) type Body = UnsyncBoxBody<Bytes, std::io::Error>;

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

pub(crate) async fn handle(
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
    rests(gateway, provider, &grant, call, &rest)?;
    let key = gateway.keys.get(&provider.name).ok_or_else(|| {
        refuse(
            StatusCode::BAD_GATEWAY,
            "api_error",
            format!("the worker has no key for {}", provider.name),
        )
    })?;
    let headers = crate::policy::request_headers(provider, request.headers())
        .map_err(|refused| refuse(StatusCode::BAD_REQUEST, "invalid_request_error", refused.0))?;
    let call = Admitted {
        gateway,
        provider,
        grant,
        call,
        rest,
        query,
        started,
    };
    let method = request.method().clone();
    let (body, held) = call.read_body(request).await?;
    let (body, mut reserved) = call.check_and_reserve(body).await?;
    if let Some(reserved) = reserved.as_mut() {
        reserved.reservation.set_sent(true);
    }
    let model = reserved.as_ref().and_then(|r| r.model.clone());
    let sent = call
        .send(method, headers, body, key, model.as_deref())
        .await;
    // The body is gone with the request: its bytes count no more.
    drop(held);
    let answer = match sent {
        Ok(answer) => answer,
        Err((refusal, reached)) => {
            if let (false, Some(reserved)) = (reached, reserved.as_mut()) {
                // The provider was never reached: nothing was spent.
                reserved.reservation.set_sent(false);
            }
            return Err(refusal);
        }
    };
    call.pass_on(answer, reserved, key)
}

/// Refuses a call the gateway answers itself: a free route called past its rate, or any call
/// of a profile resting from the provider's rate limit.
fn rests(
    gateway: &Gateway,
    provider: &Provider,
    grant: &GrantState,
    call: Call,
    rest: &str,
) -> Result<(), Refusal> {
    let refuse =
        |status, kind, message: String| Refusal::new(status, Some(provider.api), kind, message);
    let profile = &grant.request.profile;
    if call == Call::Free && !grant.free_call() {
        let mut refusal = refuse(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            format!(
                "a stage may call {rest} (a route that spends nothing) {FREE_CALLS_PER_MINUTE} times a minute"
            ),
        );
        refusal.retry_after = Some(60);
        return Err(refusal);
    }
    if let Some(until) = gateway.paused(profile, &provider.name) {
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
    Ok(())
}

/// What a spending call holds while it is answered.
struct Reserved {
    reservation: Reservation,
    /// Its worst case: what it is settled at when its answer never states its usage.
    worst: Worst,
    /// The model it asked for.
    model: Option<String>,
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

    /// Reads the body, bounded in size and time, once the stage's and the worker's allowance
    /// of held bodies has room for it (its declared length, else the largest body): the
    /// bytes and the room they take, given back once the request has been sent on.
    async fn read_body(
        &self,
        request: Request<Incoming>,
    ) -> Result<(Vec<u8>, [OwnedSemaphorePermit; 2]), Refusal> {
        let refuse = |status, message| self.refuse(status, "invalid_request_error", message);
        let too_large = || format!("a request's body may hold at most {MAX_REQUEST_BODY} bytes");
        let declared = request
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        if declared.is_some_and(|length| length > MAX_REQUEST_BODY) {
            return Err(refuse(StatusCode::PAYLOAD_TOO_LARGE, too_large()));
        }
        let room = declared.unwrap_or(MAX_REQUEST_BODY).max(1);
        let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
        let late = || {
            refuse(
                StatusCode::REQUEST_TIMEOUT,
                "the request's body did not arrive in time".into(),
            )
        };
        let take = |pool: &Arc<Semaphore>| {
            let pool = Arc::clone(pool);
            async move {
                tokio::time::timeout_at(deadline, pool.acquire_many_owned(room as u32))
                    .await
                    .ok()
                    .and_then(Result::ok)
            }
        };
        let stage = take(&self.grant.bodies).await.ok_or_else(late)?;
        let worker = take(&self.gateway.bodies).await.ok_or_else(late)?;
        // Room for the few bytes a rewrite adds, so that it moves the bytes in place.
        let mut bytes = Vec::with_capacity(declared.unwrap_or(64 * 1024) + 64);
        let mut body = request.into_body();
        loop {
            let frame = tokio::time::timeout_at(deadline, body.frame())
                .await
                .map_err(|_| late())?;
            match frame {
                None => break,
                Some(Err(_)) => {
                    return Err(refuse(
                        StatusCode::BAD_REQUEST,
                        "the request's body was cut short".into(),
                    ))
                }
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        if bytes.len() + data.len() > room.min(MAX_REQUEST_BODY) {
                            return Err(refuse(StatusCode::PAYLOAD_TOO_LARGE, too_large()));
                        }
                        bytes.extend_from_slice(&data);
                    }
                }
            }
        }
        Ok((bytes, [stage, worker]))
    }

    /// For a call that spends tokens: reads what the body asks for, refuses what the profile
    /// does not allow, asks a Chat Completions stream for its usage, and reserves the
    /// request's worst case against the run's budget (and the profile's day); a request that
    /// does not fit halts the stage.
    async fn check_and_reserve(
        &self,
        mut body: Vec<u8>,
    ) -> Result<(Vec<u8>, Option<Reserved>), Refusal> {
        if self.call == Call::Free {
            return Ok((body, None));
        }
        let (gateway, provider, api) = (self.gateway, self.provider, self.provider.api);
        let grant = &self.grant;
        let profile = &grant.request.profile;
        let asked = Asked::read(api, &body)
            .map_err(|e| self.refuse(StatusCode::BAD_REQUEST, "invalid_request_error", e))?;
        if let Some(tool) = asked
            .server_tools
            .iter()
            .find(|tool| !grant.request.server_tools.contains(tool))
        {
            gateway.observe_request(profile, provider, None, 403, self.started);
            return Err(self.refuse(
                StatusCode::FORBIDDEN,
                "permission_error",
                format!(
                    "the request names the server-side tool `{tool}`, which the provider runs against addresses the stage chooses; profile `{profile}` does not allow it (agents.{profile}.server_tools)"
                ),
            ));
        }
        if let Some(tier) = &asked.dear_tier {
            return Err(self.refuse(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!(
                    "service_tier {tier:?} is priced above the gateway's price table; leave it out"
                ),
            ));
        }
        if asked.stream && asked.include_usage.is_none() {
            ask_for_usage(&mut body);
        }
        let model = api.requested_model(&self.rest, asked.model.clone());
        let price = provider.price(model.as_deref());
        let worst = asked.worst_case(body.len(), &price);
        let reservation = match gateway.ledger.reserve(grant.request.run_id, worst.amount()) {
            Ok(reservation) if grant.request.daily_budget => {
                let hold = self.hold_daily(worst.amount()).await?;
                reservation.with_daily(hold)
            }
            Ok(reservation) => reservation,
            Err(exhausted) => {
                let mut meter = grant.meter.lock().unwrap_or_else(|p| p.into_inner());
                meter.exhausted.get_or_insert(exhausted.0.clone());
                drop(meter);
                grant.halt.cancel();
                gateway.observe_request(profile, provider, None, 403, self.started);
                return Err(self.refuse(StatusCode::FORBIDDEN, "budget_exhausted", exhausted.0));
            }
        };
        Ok((
            body,
            Some(Reserved {
                reservation,
                worst,
                model,
            }),
        ))
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

    /// Forwards the request with the allowed headers and the provider's key. The error says
    /// whether the provider may have been reached (anything but a failed connection).
    async fn send(
        &self,
        method: http::Method,
        mut headers: HeaderMap,
        body: Vec<u8>,
        key: &str,
        requested_model: Option<&str>,
    ) -> Result<reqwest::Response, (Refusal, bool)> {
        let (gateway, provider, api) = (self.gateway, self.provider, self.provider.api);
        let refuse = |status, kind, message| self.refuse(status, kind, message);
        let (rest, query, started) = (&self.rest, &self.query, self.started);
        let profile = &self.grant.request.profile;
        let mut url = format!("{}{rest}", provider.base_url);
        if let Some(query) = api.forwarded_query(query.as_deref()) {
            url.push('?');
            url.push_str(&query);
        }
        let (key_name, key_value) = api.key_header(key);
        let mut key_value = HeaderValue::from_str(&key_value).map_err(|_| {
            let refusal = refuse(
                StatusCode::BAD_GATEWAY,
                "api_error",
                "the worker's key is not a valid header value".into(),
            );
            (refusal, false)
        })?;
        key_value.set_sensitive(true);
        headers.insert(HeaderName::from_static(key_name), key_value);
        headers.insert(
            http::header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        let client = &gateway.clients[&provider.name];
        client
            .request(method, &url)
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|error| {
                gateway.observe_request(profile, provider, requested_model, 502, started);
                let reached = !error.is_connect();
                let refusal = refuse(
                    StatusCode::BAD_GATEWAY,
                    "api_error",
                    format!(
                        "the provider {} did not answer: {}",
                        provider.name,
                        error.without_url()
                    ),
                );
                (refusal, reached)
            })
    }

    /// Passes the provider's answer on as it arrives, through the meter, with only the
    /// allowed headers and the key masked; a rate-limit answer to a spending call pauses the
    /// profile and halts the stage first.
    fn pass_on(
        self,
        answer: reqwest::Response,
        reserved: Option<Reserved>,
        key: &str,
    ) -> Result<Response<Body>, Refusal> {
        let (gateway, provider, api) = (self.gateway, self.provider, self.provider.api);
        let grant = Arc::clone(&self.grant);
        let started = self.started;
        let status = answer.status();
        if self.call == Call::Spending && reset::pauses(status.as_u16()) {
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
        let redactor = Redactor::new(key);
        let mut response = Response::builder().status(status.as_u16());
        for (name, value) in answer.headers() {
            if !crate::policy::answer_header(name) {
                continue;
            }
            match redactor.as_ref().and_then(|r| r.header(value)) {
                Some(masked) => response = response.header(name, masked),
                None => response = response.header(name, value),
            }
        }
        grant
            .meter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .requests += 1;
        let (reservation, worst, requested_model) = match reserved {
            Some(r) => (Some(r.reservation), Some(r.worst), r.model),
            None => (None, None, None),
        };
        let metered = MeteredBody {
            inner: Box::pin(answer.bytes_stream()),
            meter: Some(Meter::new(api, stream)),
            redactor,
            reservation,
            worst,
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
