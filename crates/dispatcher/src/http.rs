//! The dispatcher's HTTP API (SPEC 12): runs, their events as Server-Sent Events, health,
//! readiness, and the OpenAPI document. Every error is `{"error": {code, message, field}}`.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::Stream;
use proto::{ApiError, ApiErrorBody, RunList, RunState, RunView, StateChange, SubmitResponse};
use serde::Deserialize;
use uuid::Uuid;

use crate::dispatcher::{Cancelled, Dispatcher, ResumeFailure, Submission, SubmitFailure};
use crate::store::{RunFilter, RunRecord, RunStore};
use crate::streams::StreamSlot;
use crate::SubmitError;

/// The router with every route and the bearer-token check on `/v1`.
pub fn router(dispatcher: Arc<Dispatcher>) -> Router {
    let api = Router::new()
        .route("/v1/runs", post(submit).get(list))
        .route("/v1/runs/{id}", get(show))
        .route("/v1/runs/{id}/events", get(events))
        .route("/v1/runs/{id}/cancel", post(cancel))
        .route("/v1/runs/{id}/resume", post(resume))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&dispatcher),
            authenticate,
        ));
    Router::new()
        .merge(api)
        .route("/v1/openapi.json", get(openapi))
        .route(
            "/healthz",
            get(|| async { Json(serde_json::json!({"status": "ok"})) }),
        )
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        // Bodies are checked against the 1 MiB limit by the request parser, which answers in
        // JSON; this larger limit only stops abuse.
        .layer(DefaultBodyLimit::max(8 * 1024 * 1024))
        .with_state(dispatcher)
}

/// An API error with its status.
#[derive(Debug)]
pub struct Failure(StatusCode, ApiErrorBody);

impl Failure {
    fn new(
        status: StatusCode,
        code: &str,
        message: impl Into<String>,
        field: Option<&str>,
    ) -> Failure {
        Failure(
            status,
            ApiErrorBody {
                code: code.into(),
                message: message.into(),
                field: field.map(String::from),
            },
        )
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let unread = matches!(
            self.0,
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT
        );
        let mut response = (self.0, Json(ApiError { error: self.1 })).into_response();
        if unread {
            // The body was not read to its end: the connection cannot carry another request,
            // and the client must not try.
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        response
    }
}

impl From<SubmitError> for Failure {
    fn from(error: SubmitError) -> Failure {
        let status = match error {
            SubmitError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            SubmitError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        };
        Failure::new(status, error.code(), error.to_string(), error.field())
    }
}

fn internal(error: impl std::fmt::Display) -> Failure {
    Failure::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        error.to_string(),
        None,
    )
}

async fn authenticate(
    State(dispatcher): State<Arc<Dispatcher>>,
    headers: HeaderMap,
    request: Request,
    next: Next,
) -> Response {
    if let Some(token) = &dispatcher.api_token {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let matches =
            given.is_some_and(|given| constant_time_eq(given.as_bytes(), token.as_bytes()));
        if !matches {
            let message = if given.is_none() {
                "a bearer token is required (Authorization: Bearer TOKEN)"
            } else {
                "the bearer token is wrong"
            };
            return Failure::new(StatusCode::UNAUTHORIZED, "unauthorized", message, None)
                .into_response();
        }
    }
    next.run(request).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The time a client has to send a request body.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(15);
/// The most event streams open on one run at once.
pub const MAX_STREAMS_PER_RUN: usize = 16;
/// The most events an event stream reads from the store at once.
pub const EVENT_PAGE: u32 = 256;

/// Reads a request body of at most `limit` bytes within [`BODY_READ_TIMEOUT`]. A larger body
/// is refused as soon as its size is known, whatever it is, with the same JSON error as a
/// request over the limit; a slow one gets a JSON 408.
async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    limit: usize,
) -> Result<Bytes, Failure> {
    let too_large = |size: usize| -> Failure {
        SubmitError::TooLarge {
            field: "body".into(),
            size,
            limit,
        }
        .into()
    };
    // An announced size over the limit is refused before a byte of the body is read.
    if let Some(announced) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        if announced > limit as u64 {
            drain(body, announced).await;
            return Err(too_large(usize::try_from(announced).unwrap_or(usize::MAX)));
        }
    }
    match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, limit)).await {
        Err(_) => Err(Failure::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            format!(
                "the request body did not arrive within {} s",
                BODY_READ_TIMEOUT.as_secs()
            ),
            None,
        )),
        Ok(Ok(bytes)) => Ok(bytes),
        // Over the limit, or the client went away mid-body.
        Ok(Err(_)) => Err(too_large(limit + 1)),
    }
}

/// The most of a refused body read and dropped before the answer.
const DRAIN_BYTES: u64 = 8 * 1024 * 1024;
/// How long a refused body is read before the answer.
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads and drops a refused body of `announced` bytes when it is at most [`DRAIN_BYTES`],
/// for at most [`DRAIN_TIME`], holding no more than one chunk: a client that sends a body a
/// little over the limit finishes writing and reads the answer, instead of a broken pipe.
async fn drain(body: axum::body::Body, announced: u64) {
    use futures_util::StreamExt;
    if announced > DRAIN_BYTES {
        return;
    }
    let mut chunks = body.into_data_stream();
    let _ = tokio::time::timeout(DRAIN_TIME, async {
        let mut read = 0u64;
        while let Some(Ok(chunk)) = chunks.next().await {
            read += chunk.len() as u64;
            if read > DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

async fn submit(
    State(dispatcher): State<Arc<Dispatcher>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<(StatusCode, Json<SubmitResponse>), Failure> {
    let body = read_body(&headers, body, crate::freeze::MAX_REQUEST_BYTES).await?;
    let request = crate::request::from_json(&body)?;
    let key = idempotency_key(&headers)?;
    match dispatcher.submit_once(request, key.as_deref()).await {
        Ok(Submission::New(frozen)) => Ok((
            StatusCode::CREATED,
            Json(SubmitResponse {
                run_id: frozen.job.run_id,
                state: RunState::Queued,
                warnings: frozen.warnings,
            }),
        )),
        Ok(Submission::Repeat(first)) => {
            // The first run, as it stands now.
            let record = record(&dispatcher, &first.to_string()).await?;
            Ok((
                StatusCode::OK,
                Json(SubmitResponse {
                    run_id: first,
                    state: record.state,
                    warnings: record.job.warnings,
                }),
            ))
        }
        Err(SubmitFailure::Invalid(error)) => Err(error.into()),
        Err(SubmitFailure::Store(error)) => Err(internal(error)),
    }
}

/// The longest `Idempotency-Key` accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The submission's `Idempotency-Key`, namespaced for the store: 1 to 255 visible ASCII
/// characters.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Failure> {
    let Some(value) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let key = value.to_str().unwrap_or("");
    let valid = !key.is_empty()
        && key.len() <= MAX_IDEMPOTENCY_KEY
        && key.bytes().all(|b| b.is_ascii_graphic());
    if !valid {
        return Err(Failure::new(
            StatusCode::BAD_REQUEST,
            "invalid_header",
            format!("the Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters"),
            Some("Idempotency-Key"),
        ));
    }
    Ok(Some(format!("http:{key}")))
}

fn parse_id(id: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(id).map_err(|_| {
        Failure::new(
            StatusCode::BAD_REQUEST,
            "invalid_field",
            format!("id: {id:?} is not a run id (a UUID)"),
            Some("id"),
        )
    })
}

async fn record(dispatcher: &Dispatcher, id: &str) -> Result<RunRecord, Failure> {
    let run_id = parse_id(id)?;
    dispatcher
        .store
        .get_run(run_id)
        .await
        .map_err(internal)?
        .ok_or_else(|| {
            Failure::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no run {run_id}"),
                None,
            )
        })
}

/// The API view of a stored run.
pub fn view(record: RunRecord) -> RunView {
    let result = record.result;
    let waiting_for_profile = record
        .states
        .last()
        .filter(|_| record.state == RunState::Queued)
        .and_then(|(_, reason, _)| proto::waiting_profile(reason))
        .map(str::to_string);
    RunView {
        waiting_for_profile,
        usage: result.as_ref().and_then(|r| r.usage.clone()),
        budget: record.job.budget.clone(),
        run_id: record.job.run_id,
        ticket: record.job.ticket,
        skill: record.job.skill,
        step: record.job.step,
        state: record.state,
        states: record
            .states
            .into_iter()
            .map(|(state, reason, time)| StateChange {
                state,
                reason,
                time,
            })
            .collect(),
        warnings: record.job.warnings,
        repair_budget: record.job.repair_budget,
        implementation_rounds: result.as_ref().map_or(0, |r| r.implementation_rounds),
        repair_history: result
            .as_ref()
            .map(|r| r.repair_history.clone())
            .unwrap_or_default(),
        cycles: record.cycles,
        report: result.as_ref().map(|r| r.report.clone()),
        result,
    }
}

async fn show(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
) -> Result<Json<RunView>, Failure> {
    Ok(Json(view(record(&dispatcher, &id).await?)))
}

#[derive(Deserialize)]
struct ListQuery {
    state: Option<String>,
    ticket: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

async fn list(
    State(dispatcher): State<Arc<Dispatcher>>,
    Query(query): Query<ListQuery>,
) -> Result<Json<RunList>, Failure> {
    let state = match query.state.as_deref() {
        None | Some("") => None,
        Some(name) => Some(RunState::parse(name).ok_or_else(|| {
            Failure::new(
                StatusCode::BAD_REQUEST,
                "invalid_field",
                format!("state: {name:?} is not a run state"),
                Some("state"),
            )
        })?),
    };
    let limit = match query.limit.as_deref() {
        None | Some("") => 50,
        Some(text) => text
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=500).contains(n))
            .ok_or_else(|| {
                Failure::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_field",
                    format!("limit: must be 1..=500, got {text:?}"),
                    Some("limit"),
                )
            })?,
    };
    let filter = RunFilter {
        state,
        ticket: query.ticket.filter(|t| !t.is_empty()),
        limit,
        cursor: query.cursor,
    };
    let (runs, next_cursor) = dispatcher.store.list_runs(filter).await.map_err(internal)?;
    Ok(Json(RunList { runs, next_cursor }))
}

async fn cancel(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), Failure> {
    let record = record(&dispatcher, &id).await?;
    if record.state.is_terminal() {
        return Err(Failure::new(
            StatusCode::CONFLICT,
            "not_cancellable",
            format!("run {} already ended {}", record.job.run_id, record.state),
            None,
        ));
    }
    let cancelled = dispatcher
        .cancel(&record.job, record.state)
        .await
        .map_err(internal)?;
    let answer = match cancelled {
        Cancelled::Now => "done",
        Cancelled::Requested => "requested",
    };
    Ok((
        StatusCode::ACCEPTED,
        Json(serde_json::json!({"run_id": record.job.run_id, "cancel": answer})),
    ))
}

async fn resume(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<serde_json::Value>), Failure> {
    let record = record(&dispatcher, &id).await?;
    // A resume whose job never reached the queue (the dispatcher stopped in between) may be
    // asked again; workers settle a duplicate by its lease and done marker.
    let unfinished_resume = record.state == RunState::Queued
        && record.states.last().is_some_and(|(_, reason, _)| {
            reason.starts_with(proto::RESUMED_REASON)
                || reason.starts_with(proto::AUTO_RESUMED_REASON)
        });
    if record.state != RunState::Paused && !unfinished_resume {
        return Err(Failure::new(
            StatusCode::CONFLICT,
            "not_paused",
            format!("run {} is {}, not paused", record.job.run_id, record.state),
            None,
        ));
    }
    match dispatcher.resume(&record).await {
        Ok(checkpoint) => Ok((
            StatusCode::ACCEPTED,
            Json(
                serde_json::json!({"run_id": record.job.run_id, "state": "queued", "checkpoint": checkpoint}),
            ),
        )),
        Err(error @ ResumeFailure::NoCheckpoint(_)) => Err(Failure::new(
            StatusCode::CONFLICT,
            "no_checkpoint",
            error.to_string(),
            None,
        )),
        Err(ResumeFailure::Store(error)) => Err(internal(error)),
        Err(error @ ResumeFailure::Broker(_)) => Err(Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            error.to_string(),
            None,
        )),
    }
}

/// Where one Server-Sent Events stream is.
struct Follow {
    _slot: StreamSlot,
    dispatcher: Arc<Dispatcher>,
    wake: tokio::sync::watch::Receiver<u64>,
    position: i64,
    finished: bool,
    paused: bool,
    pending: std::collections::VecDeque<SseEvent>,
}

impl Follow {
    /// Reads the next page of stored events into `pending` (one page at a time: the stream
    /// holds at most a page, whatever the run printed, and reads the next one only when the
    /// client has taken this one). Returns how many were read.
    async fn read_page(&mut self, run_id: Uuid) -> usize {
        let stored = self
            .dispatcher
            .store
            .events_page(run_id, self.position, EVENT_PAGE)
            .await
            .unwrap_or_default();
        let read = stored.len();
        for (at, event) in stored {
            self.position = at;
            if let proto::EventKind::State { state, .. } = &event.kind {
                // A terminal state is final even if a late event follows it.
                self.finished |= state.is_terminal();
                self.paused = *state == RunState::Paused;
            }
            let data = serde_json::to_string(&event).unwrap_or_default();
            self.pending.push_back(
                SseEvent::default()
                    .id(at.to_string())
                    .event(event.kind.name())
                    .data(data),
            );
        }
        read
    }

    /// Whether the run is paused now (a resume starts a new stream).
    async fn still_paused(&self, run_id: Uuid) -> bool {
        self.dispatcher
            .store
            .get_run(run_id)
            .await
            .ok()
            .flatten()
            .is_some_and(|r| r.state == RunState::Paused)
    }
}

async fn events(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, Failure> {
    let current = record(&dispatcher, &id).await?;
    let run_id = current.job.run_id;
    // A stream of a run that has already ended (or paused) ends once everything after its
    // starting point is sent, even when that point is past the final state.
    let ended_at_start = current.state.is_terminal();
    let paused_at_start = current.state == RunState::Paused;
    // A reconnecting client continues after the last event it saw.
    let position = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok())
        .filter(|p| *p >= 0)
        .unwrap_or(0);
    let slot = StreamSlot::take(&dispatcher.streams, run_id, MAX_STREAMS_PER_RUN).ok_or_else(|| {
        Failure::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too_many_streams",
            format!("run {run_id} already has {MAX_STREAMS_PER_RUN} event streams open; close one or poll GET /v1/runs/{run_id}"),
            None,
        )
    })?;
    let wake = dispatcher.events_stored.subscribe();
    let follow = Follow {
        _slot: slot,
        dispatcher,
        wake,
        position,
        finished: false,
        paused: paused_at_start,
        pending: std::collections::VecDeque::new(),
    };
    // The stream ends after a terminal state, once everything stored is sent while the run
    // is paused (a resume starts a new stream), or when the dispatcher shuts down (clients
    // say so and can watch again).
    let stream = futures_util::stream::unfold(follow, move |mut follow| async move {
        loop {
            if let Some(event) = follow.pending.pop_front() {
                return Some((Ok(event), follow));
            }
            if follow.finished || follow.dispatcher.stopping.is_cancelled() {
                return None;
            }
            follow.wake.borrow_and_update();
            let read = follow.read_page(run_id).await;
            let full_page = read == EVENT_PAGE as usize;
            if read == 0 && ended_at_start {
                return None;
            }
            if follow.pending.is_empty() && follow.paused && follow.still_paused(run_id).await {
                return None;
            }
            if follow.pending.is_empty() && !full_page {
                let stopping = follow.dispatcher.stopping.clone();
                tokio::select! {
                    _ = tokio::time::timeout(Duration::from_secs(1), follow.wake.changed()) => {},
                    () = stopping.cancelled() => {},
                }
            }
        }
    });
    // A comment first: the response starts at once, even for a run with nothing stored yet,
    // instead of at the first event or keep-alive.
    let opening = futures_util::stream::once(async { Ok(SseEvent::default().comment("events")) });
    Ok(Sse::new(futures_util::StreamExt::chain(opening, stream)).keep_alive(KeepAlive::default()))
}

async fn ready(State(dispatcher): State<Arc<Dispatcher>>) -> Response {
    let store = dispatcher.store.ping().await.is_ok();
    let broker = dispatcher.broker_ready.load(Ordering::SeqCst);
    let status = if store && broker {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(serde_json::json!({"store": store, "broker": broker})),
    )
        .into_response()
}

async fn metrics(State(dispatcher): State<Arc<Dispatcher>>) -> Response {
    (
        [(header::CONTENT_TYPE, telemetry::CONTENT_TYPE)],
        dispatcher.metrics.render(),
    )
        .into_response()
}

async fn openapi() -> Json<serde_json::Value> {
    Json(crate::openapi::document())
}
