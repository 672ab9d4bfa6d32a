//! `POST /v1/runs/{id}/follow-up` (SPEC 12, 17): a new run continuing a delivered run's
//! branch with the given feedback, answered `201` with its `Location`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use proto::{Problem, RunState, SubmitResponse};
use serde::Deserialize;

use super::body::read_body;
use super::problem::{internal, Failure};
use crate::dispatcher::{Dispatcher, Submission, SubmitFailure};
use crate::follow_up::{Refused, DEFAULT_MAX_FOLLOW_UPS, MAX_FEEDBACK_BYTES};

/// A follow-up's ask.
#[derive(Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct Ask {
    /// What the implementer is asked to change, given as `## Reviewer Feedback`.
    feedback: String,
}

#[utoipa::path(
    post,
    path = "/v1/runs/{id}/follow-up",
    tag = "runs",
    summary = "Continue a delivered run's branch with feedback: a new run whose delivery adds a commit to the same branch",
    params(("id" = uuid::Uuid, Path, description = "the delivered run to continue")),
    request_body = Ask,
    responses(
        (status = 201, description = "the new run, queued; `Location` names it", body = SubmitResponse),
        (status = 400, description = "the id is not a UUID (`field`: `id`)", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run", content_type = "application/problem+json", body = Problem),
        (status = 408, description = "the body was not sent in time", content_type = "application/problem+json", body = Problem),
        (status = 409, description = "the run has not delivered a branch, another run of its ticket has not ended, or the ticket has had its most follow-ups", content_type = "application/problem+json", body = Problem),
        (status = 413, description = "the body is too large", content_type = "application/problem+json", body = Problem),
        (status = 415, description = "a body that is not sent as `Content-Type: application/json`", content_type = "application/problem+json", body = Problem),
        (status = 422, description = "the body is not `{\"feedback\": \"…\"}` with 1 to 60,000 bytes of feedback (`field`: `feedback`)", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn follow_up(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
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
    let run_id = super::runs::parse_id(&id)?;
    let body = read_body(&headers, body, MAX_FEEDBACK_BYTES + 1024).await?;
    let ask: Ask = serde_json::from_slice(&body).map_err(|e| {
        Failure::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            format!("the body must be {{\"feedback\": \"…\"}}: {e}"),
            Some("feedback"),
        )
    })?;
    let started = dispatcher
        .follow_up(run_id, &ask.feedback, None, DEFAULT_MAX_FOLLOW_UPS)
        .await;
    let refused =
        |status, code: &str, detail: String, field| Failure::new(status, code, detail, field);
    match started {
        Ok(Submission::New(frozen)) => Ok((
            StatusCode::CREATED,
            [(header::LOCATION, format!("/v1/runs/{}", frozen.job.run_id))],
            Json(SubmitResponse {
                run_id: frozen.job.run_id,
                state: RunState::Queued,
                warnings: frozen.warnings,
            }),
        )),
        Ok(Submission::Repeat(first)) => Err(refused(
            StatusCode::CONFLICT,
            "conflict",
            format!("this follow-up was asked already: run {first}"),
            None,
        )),
        Err(Refused::Unknown) => Err(refused(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no run {run_id}"),
            None,
        )),
        Err(Refused::Feedback(detail)) => Err(refused(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_field",
            detail,
            Some("feedback"),
        )),
        Err(Refused::Conflict(detail)) => {
            Err(refused(StatusCode::CONFLICT, "conflict", detail, None))
        }
        Err(Refused::Submit(SubmitFailure::Invalid(error))) => Err(error.into()),
        Err(Refused::Submit(SubmitFailure::Store(error))) | Err(Refused::Store(error)) => {
            Err(internal(error))
        }
    }
}
