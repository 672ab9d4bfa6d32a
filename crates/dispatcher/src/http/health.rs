//! The service's own routes: liveness, readiness (store and broker) and Prometheus metrics.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use proto::Readiness;

use crate::dispatcher::Dispatcher;
use crate::store::RunStore;

/// Whether the process answers.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(super) struct Liveness {
    /// Always `ok`.
    status: &'static str,
}

#[utoipa::path(get, path = "/healthz", tag = "service", summary = "Liveness", security(()),
    responses((status = 200, description = "the process answers", body = Liveness)))]
pub(super) async fn healthz() -> Json<Liveness> {
    Json(Liveness { status: "ok" })
}

#[utoipa::path(get, path = "/readyz", tag = "service", summary = "Readiness: store and broker reachable", security(()),
    responses(
        (status = 200, description = "ready", body = Readiness),
        (status = 503, description = "the store or the broker cannot be reached (yet)", body = Readiness),
    ))]
pub(super) async fn ready(State(dispatcher): State<Arc<Dispatcher>>) -> Response {
    let store = dispatcher.store.ping().await.is_ok();
    let broker = dispatcher.broker_ready.load(Ordering::SeqCst);
    let status = if store && broker {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(Readiness { store, broker })).into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "service", summary = "Prometheus metrics", security(()),
    responses((status = 200, description = "the text exposition format", content_type = "text/plain", body = String)))]
pub(super) async fn metrics(State(dispatcher): State<Arc<Dispatcher>>) -> Response {
    (
        [(header::CONTENT_TYPE, telemetry::CONTENT_TYPE)],
        dispatcher.metrics.render(),
    )
        .into_response()
}
