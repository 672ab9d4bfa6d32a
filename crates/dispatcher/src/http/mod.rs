//! The dispatcher's HTTP API (SPEC 12): runs, their events as Server-Sent Events, health,
//! readiness, and the OpenAPI document. Every error, the framework's own included (unknown
//! routes, wrong methods, bodies it refuses), is RFC 9457 problem details
//! (`application/problem+json`, [`proto::Problem`]).
//!
//! This file holds the routes, the bearer-token middleware on `/v1` (answering with
//! `WWW-Authenticate`), and the health, readiness and metrics routes; each other file holds one
//! part of the API.

mod body;
mod events;
mod follow_up;
mod glance;
mod guard;
mod health;
mod openapi;
mod problem;
mod runs;
mod trackers;
mod view;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};

use crate::dispatcher::Dispatcher;

use events::events;
use health::{healthz, metrics, ready};
use problem::{problems_everywhere, unknown_route};
use runs::{cancel, list, resume, show, submit};

pub use problem::Failure;
pub use runs::view;

/// The routes of the metrics port (`FORGEPOOL_DISPATCHER_METRICS_ADDR`): `/metrics`, `/healthz` and
/// `/readyz`, no API, so that a network policy or an ingress for one never opens the other.
pub fn metrics_router(dispatcher: Arc<Dispatcher>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(ready))
        .fallback(unknown_route)
        .with_state(dispatcher)
}

/// The router with every route and the bearer-token check on `/v1`.
pub fn router(dispatcher: Arc<Dispatcher>) -> Router {
    let api = Router::new()
        .route("/v1/runs", post(submit).get(list))
        .route("/v1/runs/{id}", get(show))
        .route("/v1/runs/{id}/events", get(events))
        .route("/v1/runs/{id}/timeline", get(glance::timeline))
        .route(
            "/v1/runs/{id}/stages/{n}/transcript",
            get(glance::transcript),
        )
        .route("/v1/pool", get(glance::pool))
        .route("/v1/runs/{id}/cancel", post(cancel))
        .route("/v1/runs/{id}/resume", post(resume))
        .route("/v1/runs/{id}/follow-up", post(follow_up::follow_up))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&dispatcher),
            authenticate,
        ));
    let routes = Router::new()
        .merge(api)
        .merge(view::routes())
        .fallback(unknown_route)
        .route("/v1/openapi.json", get(openapi))
        // Signed by the tracker instead of the API token (SPEC 17).
        .route("/v1/trackers/{name}/events", post(trackers::event))
        .route("/healthz", get(healthz))
        .route("/readyz", get(ready));
    // `/metrics` answers on the API's port unless it has a port of its own.
    let routes = if dispatcher.metrics_apart {
        routes
    } else {
        routes.route("/metrics", get(metrics))
    };
    routes
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&dispatcher),
            guard::guard,
        ))
        .route_layer(middleware::from_fn_with_state(
            Arc::clone(&dispatcher),
            count_request,
        ))
        // Bodies are checked against the 1 MiB limit by the request parser, which answers in
        // JSON; this larger limit only stops abuse.
        .layer(DefaultBodyLimit::max(8 * 1024 * 1024))
        .layer(middleware::map_response(problems_everywhere))
        .with_state(dispatcher)
}

/// Counts each request a route answered, by method, route template and status, with its
/// time (`forgepool_http_requests_total`, `forgepool_http_request_duration_seconds`).
async fn count_request(
    State(dispatcher): State<Arc<Dispatcher>>,
    matched: Option<axum::extract::MatchedPath>,
    request: Request,
    next: Next,
) -> Response {
    use axum::http::Method;
    let method = match *request.method() {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    };
    let route = matched.map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let started = std::time::Instant::now();
    let response = next.run(request).await;
    dispatcher.metrics.http_request(
        method,
        &route,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
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

/// The OpenAPI document, made once.
async fn openapi() -> Json<serde_json::Value> {
    static DOCUMENT: std::sync::LazyLock<serde_json::Value> =
        std::sync::LazyLock::new(openapi::document);
    Json(DOCUMENT.clone())
}
