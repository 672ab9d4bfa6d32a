//! `POST /v1/trackers/{name}/events` (SPEC 17): a tracker's webhook. No API token: the
//! tracker's signature over the raw body is checked first, before anything is parsed or
//! stored. The answer comes at once (`202`; `200` for a delivery seen in the last 24 hours),
//! the work after it. The route reads at most [`trackers::MAX_EVENT_BYTES`] and answers 429
//! past a tracker's rate.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::problem::Failure;
use crate::dispatcher::Dispatcher;
use crate::trackers::set::Answer;

pub(super) async fn event(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let Some(trackers) = dispatcher.trackers.clone() else {
        return not_found(&name);
    };
    // At most 1 MiB, within the body read timeout, refused as soon as its size is known.
    let body = match super::body::read_body(&headers, body, trackers::MAX_EVENT_BYTES).await {
        Ok(body) => body,
        Err(failure) => return failure.into_response(),
    };
    let headers: trackers::Headers = headers
        .iter()
        .filter_map(|(key, value)| {
            Some((key.as_str().to_string(), value.to_str().ok()?.to_string()))
        })
        .collect();
    match trackers
        .receive(
            &dispatcher.store,
            &dispatcher.metrics,
            &name,
            &headers,
            &body,
        )
        .await
    {
        Answer::Unknown => not_found(&name),
        Answer::Unsigned(why) => Failure::new(
            StatusCode::UNAUTHORIZED,
            "bad_signature",
            format!("the delivery is not signed with this tracker's webhook secret: {why}"),
            None,
        )
        .into_response(),
        Answer::TooMany => {
            let mut response = Failure::new(
                StatusCode::TOO_MANY_REQUESTS,
                "too_many_requests",
                "too many deliveries from this tracker this second",
                None,
            )
            .into_response();
            response
                .headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
            response
        }
        Answer::Duplicate => (
            StatusCode::OK,
            Json(serde_json::json!({"status": "duplicate"})),
        )
            .into_response(),
        Answer::Accepted(why) => (
            StatusCode::ACCEPTED,
            Json(serde_json::json!({"status": "accepted", "detail": why})),
        )
            .into_response(),
        Answer::Busy(why) => Failure::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "busy",
            format!("{why}; the tracker may deliver it again"),
            None,
        )
        .into_response(),
    }
}

fn not_found(name: &str) -> Response {
    Failure::new(
        StatusCode::NOT_FOUND,
        "not_found",
        format!("no tracker named {name:?} in the trackers file"),
        None,
    )
    .into_response()
}
