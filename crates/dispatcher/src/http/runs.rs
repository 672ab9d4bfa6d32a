//! The runs: submit, list, show (with an entity tag), cancel, resume.
//!
//! A submission is answered with `Location`; the list takes a checked cursor; a run comes with
//! its `ETag`.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use proto::{
    CancelAnswer, CancelProgress, Problem, ResumeAnswer, RunList, RunState, RunView, StateChange,
    SubmitResponse,
};
use serde::Deserialize;
use uuid::Uuid;

use crate::dispatcher::{Cancelled, Dispatcher, ResumeFailure, Submission, SubmitFailure};
use crate::store::{RunFilter, RunRecord, RunStore};

use super::body::read_body;
use super::problem::{internal, query_number, Failure};
use proto::RunRequest;

/// Where a run is read.
fn run_location(run_id: Uuid) -> [(header::HeaderName, String); 1] {
    [(header::LOCATION, format!("/v1/runs/{run_id}"))]
}

#[utoipa::path(
    post,
    path = "/v1/runs",
    tag = "runs",
    summary = "Submit a run request",
    request_body(content = RunRequest, content_type = "application/json"),
    params(("Idempotency-Key" = Option<String>, Header, max_length = 255, min_length = 1, pattern = r"^[!-~]+$",
            description = "1 to 255 visible ASCII characters; a repeat within 24 hours returns the first run instead of creating another")),
    responses(
        (status = 201, description = "accepted: the run id and any warnings", body = SubmitResponse,
         headers(("Location" = String, description = "the run: /v1/runs/{id}"))),
        (status = 200, description = "a repeat of an Idempotency-Key seen in the last 24 hours with the same request: the first run, as it stands", body = SubmitResponse,
         headers(("Location" = String, description = "the first run: /v1/runs/{id}"))),
        (status = 400, description = "the request breaks its documented shape (a brief over 256 KiB too); `field` names the field (or the Idempotency-Key header)", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 415, description = "a body that is not sent as `Content-Type: application/json`", content_type = "application/problem+json", body = Problem),
        (status = 408, description = "the body did not arrive within 15 s", content_type = "application/problem+json", body = Problem),
        (status = 413, description = "the body is over 1 MiB", content_type = "application/problem+json", body = Problem),
        (status = 422, description = "the request has the documented shape but names what this dispatcher does not have or allow (a skill, an agent profile, a URL scheme, a ref git refuses, a blank brief), or an Idempotency-Key used in the last 24 hours for another request; `field` names it", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn submit(
    State(dispatcher): State<Arc<Dispatcher>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<
    (
        StatusCode,
        [(header::HeaderName, String); 1],
        Json<SubmitResponse>,
    ),
    Failure,
> {
    let body = read_body(&headers, body, crate::freeze::MAX_REQUEST_BYTES).await?;
    let request = crate::request::from_json(&body)?;
    let key = idempotency_key(&headers)?;
    match dispatcher.submit_once(request, key.as_deref()).await {
        Ok(Submission::New(frozen)) => Ok((
            StatusCode::CREATED,
            run_location(frozen.job.run_id),
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
                run_location(first),
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

pub(super) fn parse_id(id: &str) -> Result<Uuid, Failure> {
    Uuid::parse_str(id).map_err(|_| {
        Failure::new(
            StatusCode::BAD_REQUEST,
            "invalid_field",
            format!("id: {id:?} is not a run id (a UUID)"),
            Some("id"),
        )
    })
}

pub(super) async fn record(dispatcher: &Dispatcher, id: &str) -> Result<RunRecord, Failure> {
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

#[utoipa::path(
    get,
    path = "/v1/runs/{id}",
    tag = "runs",
    summary = "A run: state, history of states, rounds, cycles with their files, result, report",
    params(
        ("id" = uuid::Uuid, Path, description = "the run id"),
        ("If-None-Match" = Option<String>, Header, description = "an entity tag of an earlier answer: 304 while the run is unchanged"),
    ),
    responses(
        (status = 200, description = "the run", body = RunView,
         headers(("ETag" = String, description = "changes whenever the run does"))),
        (status = 304, description = "the run is unchanged since the entity tag given",
         headers(("ETag" = String, description = "the run's entity tag"))),
        (status = 400, description = "the id is not a UUID (`field`: `id`)", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn show(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, Failure> {
    let body = serde_json::to_vec(&view(record(&dispatcher, &id).await?)).map_err(internal)?;
    let tag = entity_tag(&body);
    let cached = headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| none_match(v, &tag));
    let etag = [(header::ETAG, tag)];
    if cached {
        return Ok((StatusCode::NOT_MODIFIED, etag).into_response());
    }
    Ok((etag, [(header::CONTENT_TYPE, "application/json")], body).into_response())
}

/// A strong entity tag of a run's document: the first 128 bits of its SHA-256, quoted.
fn entity_tag(body: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(body);
    format!("\"{}\"", hex::encode(&digest[..16]))
}

/// Whether an `If-None-Match` value matches `tag` (`*`, or any tag in the list, compared
/// weakly as RFC 9110 asks).
fn none_match(value: &str, tag: &str) -> bool {
    value
        .split(',')
        .map(str::trim)
        .any(|given| given == "*" || given.strip_prefix("W/").unwrap_or(given) == tag)
}

#[derive(Deserialize)]
pub(super) struct ListQuery {
    state: Option<String>,
    ticket: Option<String>,
    skill: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

#[utoipa::path(
    get,
    path = "/v1/runs",
    tag = "runs",
    summary = "List runs, newest first",
    params(
        ("state" = Option<RunState>, Query, description = "only runs in this state"),
        ("ticket" = Option<String>, Query, description = "only runs of this ticket"),
        ("skill" = Option<String>, Query, description = "only runs of this skill"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 500, description = "at most this many runs (50 by default)"),
        ("cursor" = Option<String>, Query, pattern = r"^[1-9][0-9]{0,17}$", description = "the `next_cursor` of the page before"),
    ),
    responses(
        (status = 200, description = "a page of runs", body = RunList),
        (status = 400, description = "a query parameter breaks its rule; `field` names it", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn list(
    State(dispatcher): State<Arc<Dispatcher>>,
    Query(query): Query<ListQuery>,
) -> Result<Json<RunList>, Failure> {
    let state = match query.state.as_deref() {
        None => None,
        Some(name) => Some(RunState::parse(name).ok_or_else(|| {
            Failure::new(
                StatusCode::BAD_REQUEST,
                "invalid_field",
                format!("state: {name:?} is not a run state"),
                Some("state"),
            )
        })?),
    };
    let limit = query_number(query.limit.as_deref(), "limit", 1..=500, 50)?;
    let cursor = match query.cursor.as_deref() {
        None => None,
        Some(text) => Some(
            text.parse::<i64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    Failure::new(
                        StatusCode::BAD_REQUEST,
                        "invalid_field",
                        format!("cursor: {text:?} is not a cursor; pass the next_cursor of an earlier page, or none for the first page"),
                        Some("cursor"),
                    )
                })?,
        ),
    };
    let filter = RunFilter {
        state,
        ticket: query.ticket.filter(|t| !t.is_empty()),
        skill: query.skill.filter(|s| !s.is_empty()),
        limit,
        cursor,
    };
    let (runs, next_cursor) = dispatcher.store.list_runs(filter).await.map_err(internal)?;
    Ok(Json(RunList {
        runs,
        next_cursor: next_cursor.map(|c| c.to_string()),
    }))
}

#[utoipa::path(
    post,
    path = "/v1/runs/{id}/cancel",
    tag = "runs",
    summary = "Cancel a run (stored first)",
    params(("id" = uuid::Uuid, Path, description = "the run id")),
    responses(
        (status = 202, description = "`done` for a queued or paused run (cancelled now), `requested` for a running one (its worker stops it)", body = CancelAnswer),
        (status = 400, description = "the id is not a UUID (`field`: `id`)", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 415, description = "a body that is not sent as `Content-Type: application/json`", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run", content_type = "application/problem+json", body = Problem),
        (status = 409, description = "the run already ended", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn cancel(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<CancelAnswer>), Failure> {
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
    let cancel = match cancelled {
        Cancelled::Now => CancelProgress::Done,
        Cancelled::Requested => CancelProgress::Requested,
    };
    Ok((
        StatusCode::ACCEPTED,
        Json(CancelAnswer {
            run_id: record.job.run_id,
            cancel,
        }),
    ))
}

#[utoipa::path(
    post,
    path = "/v1/runs/{id}/resume",
    tag = "runs",
    summary = "Resume a paused run from its latest checkpoint, with its original frozen job",
    params(("id" = uuid::Uuid, Path, description = "the run id")),
    responses(
        (status = 202, description = "queued again", body = ResumeAnswer),
        (status = 400, description = "the id is not a UUID (`field`: `id`)", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 415, description = "a body that is not sent as `Content-Type: application/json`", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run", content_type = "application/problem+json", body = Problem),
        (status = 409, description = "the run is not paused (`not_paused`), or has no saved progress (`no_checkpoint`)", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
        (status = 503, description = "the broker cannot be reached; the run stays paused", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn resume(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
) -> Result<(StatusCode, Json<ResumeAnswer>), Failure> {
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
            Json(ResumeAnswer {
                run_id: record.job.run_id,
                state: RunState::Queued,
                checkpoint,
            }),
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
