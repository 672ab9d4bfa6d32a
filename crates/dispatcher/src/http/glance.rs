//! What the web view reads besides the runs themselves: the pool at a glance, and a run's
//! timeline with the tail of its log. Both are bounded whatever the pool or the run hold.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::Json;
use proto::{PoolView, PositionedEvent, Problem, RunTimeline, TIMELINE_EVENTS};
use serde::Deserialize;

use crate::dispatcher::Dispatcher;
use crate::store::{RunStore, TIMELINE_KINDS};

use super::problem::{internal, query_number, Failure};
use super::runs::record;

#[utoipa::path(
    get,
    path = "/v1/pool",
    tag = "pool",
    summary = "The pool at a glance: queue depth, workers, busy slots, runs by state",
    responses(
        (status = 200, description = "the pool as the dispatcher last sampled it (every 5 s)", body = PoolView),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn pool(State(dispatcher): State<Arc<Dispatcher>>) -> Json<PoolView> {
    Json(
        dispatcher
            .pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
    )
}

#[derive(Deserialize)]
pub(super) struct TimelineQuery {
    log_lines: Option<String>,
}

/// The most log events `GET /v1/runs/{id}/timeline` returns.
pub const MAX_LOG_LINES: u32 = 2000;

#[utoipa::path(
    get,
    path = "/v1/runs/{id}/timeline",
    tag = "runs",
    summary = "A run's stages, states, checks, cycles and pull request as events, with its log's tail",
    params(
        ("id" = uuid::Uuid, Path, description = "the run id"),
        ("log_lines" = Option<u32>, Query, minimum = 0, maximum = 2000, description = "how many of the last log events to return (500 by default)"),
    ),
    responses(
        (status = 200, description = "the timeline; `last_position` is where the event stream continues", body = RunTimeline),
        (status = 400, description = "the id is not a UUID, or `log_lines` is out of range; `field` names it", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn timeline(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path(id): Path<String>,
    Query(query): Query<TimelineQuery>,
) -> Result<Json<RunTimeline>, Failure> {
    let log_lines = query_number(
        query.log_lines.as_deref(),
        "log_lines",
        0..=MAX_LOG_LINES,
        500,
    )?;
    let run_id = record(&dispatcher, &id).await?.job.run_id;
    let store = &dispatcher.store;
    let (events, log_tail) = tokio::try_join!(
        store.events_of_kinds(run_id, TIMELINE_KINDS, false, TIMELINE_EVENTS),
        store.events_of_kinds(run_id, &["log"], true, log_lines.max(1)),
    )
    .map_err(internal)?;
    let log_tail = if log_lines == 0 { Vec::new() } else { log_tail };
    let positioned = |events: Vec<(i64, proto::Event)>| -> Vec<PositionedEvent> {
        events
            .into_iter()
            .map(|(position, event)| PositionedEvent { position, event })
            .collect()
    };
    let last_position = events
        .iter()
        .chain(log_tail.iter())
        .map(|(position, _)| *position)
        .max()
        .unwrap_or(0);
    Ok(Json(RunTimeline {
        events: positioned(events),
        log_tail: positioned(log_tail),
        last_position,
    }))
}
