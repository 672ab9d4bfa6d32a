//! What the web view reads besides the runs themselves: the pool at a glance, and a run's
//! timeline with the tail of its log. Both are bounded whatever the pool or the run hold.
//!
//! `GET /v1/pool` answers the pool as `refresh_gauges` last sampled it.
//! `GET /v1/runs/{id}/timeline` holds a run's stage, state, check and cycle events and its
//! log's tail, each read by kind through the `(run, kind, position)` index (migration `V3`), so
//! a run's 100,000 log lines are never read.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::Json;
use proto::{
    EventKind, PoolView, PositionedEvent, Problem, RunTimeline, Stage, StageTranscript,
    TIMELINE_EVENTS,
};
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
        (status = 200, description = "the pool as the dispatcher last sampled it (every 5 s), with the workers alive now", body = PoolView),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn pool(State(dispatcher): State<Arc<Dispatcher>>) -> Json<PoolView> {
    let mut view = dispatcher
        .pool
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    // The roster is read as it is now, not as last sampled.
    view.hosts = dispatcher.roster.hosts(std::time::Instant::now());
    Json(view)
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
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
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

#[utoipa::path(
    get,
    path = "/v1/runs/{id}/stages/{n}/transcript",
    tag = "runs",
    summary = "What an agent kind's stage said and did: messages, tool calls and their results, with its usage",
    params(
        ("id" = uuid::Uuid, Path, description = "the run id"),
        ("n" = u32, Path, minimum = 1, maximum = 1000, description = "the stage's place among the run's stages, from 1, in the order they started (a run's first 1,000 stages are counted)"),
    ),
    responses(
        (status = 200, description = "the stage's transcript (the latest, when a resumed run repeated the stage)", body = StageTranscript),
        (status = 400, description = "the id is not a UUID, or `n` is not a number from 1 to 1000; `field` names it", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run, no such stage, or a stage without a transcript (a `command` profile, a verification command, or a stage still running)", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn transcript(
    State(dispatcher): State<Arc<Dispatcher>>,
    Path((id, n)): Path<(String, String)>,
) -> Result<Json<StageTranscript>, Failure> {
    let index = query_number(Some(n.as_str()), "n", 1..=MAX_STAGES, 1)?;
    let run_id = record(&dispatcher, &id).await?.job.run_id;
    let store = &dispatcher.store;
    let started = store
        .events_of_kinds(run_id, &["stage_started"], false, MAX_STAGES)
        .await
        .map_err(internal)?;
    let missing = |what: String| Failure::new(StatusCode::NOT_FOUND, "not_found", what, None);
    let Some((_, event)) = started.get(index as usize - 1) else {
        return Err(missing(format!(
            "run {run_id} has {} stages, not {index}",
            started.len()
        )));
    };
    let EventKind::StageStarted {
        stage,
        round,
        cycle,
    } = event.kind
    else {
        return Err(missing(format!("run {run_id} has no stage {index}")));
    };
    let ended = store
        .events_of_kinds(
            run_id,
            &["transcript", "stage_finished"],
            false,
            2 * MAX_STAGES,
        )
        .await
        .map_err(internal)?;
    let same = |s: Stage, r: u32, c: Option<u32>| s == stage && r == round && c == cycle;
    let usage = ended.iter().rev().find_map(|(_, e)| match &e.kind {
        EventKind::StageFinished {
            stage: s,
            round: r,
            cycle: c,
            usage,
            ..
        } if same(*s, *r, *c) => usage.clone(),
        _ => None,
    });
    ended
        .into_iter()
        .rev()
        .find_map(|(_, e)| match e.kind {
            EventKind::Transcript { stage: s, round: r, cycle: c, agent, transcript } if same(s, r, c) => {
                Some(StageTranscript {
                    index,
                    stage: stage.as_str().to_string(),
                    round,
                    cycle,
                    agent: agent.as_str().to_string(),
                    transcript,
                    usage: usage.clone(),
                })
            }
            _ => None,
        })
        .map(Json)
        .ok_or_else(|| {
            missing(format!(
                "stage {index} of run {run_id} ({} stage, round {round}) has no transcript: only agent kinds' stages have one, once they end",
                stage.as_str()
            ))
        })
}

/// The most stages a transcript is looked up among.
const MAX_STAGES: u32 = 1000;
