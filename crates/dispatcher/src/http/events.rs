//! A run's events as Server-Sent Events: stored events page by page, then live ones.
//!
//! A stream opens with a comment, so its response begins at once. Stored events are paged 256 at
//! a time from `Last-Event-ID`; then live events come from the dispatcher's broadcast
//! (`Dispatcher::events_stored`, 1,024 events, sent in position order under `event_order`); a
//! stream that falls behind reads from the store again. At most 16 streams per run; a stream ends
//! at a terminal state, a pause or shutdown.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::Stream;
use proto::{Problem, RunState};
use tokio::sync::broadcast;
use uuid::Uuid;

use crate::dispatcher::Dispatcher;
use crate::store::RunStore;
use crate::streams::StreamSlot;

use super::problem::Failure;
use super::runs::record;
use super::{EVENT_PAGE, MAX_STREAMS_PER_RUN};
use crate::dispatcher::RESYNC;

/// Where one Server-Sent Events stream is. It reads what is stored page by page until it
/// reaches the head, then takes live events from the dispatcher's broadcast (which carries
/// them in position order); when it falls behind the broadcast it reads from the store again.
struct Follow {
    _slot: StreamSlot,
    dispatcher: Arc<Dispatcher>,
    run_id: Uuid,
    live: broadcast::Receiver<Arc<(i64, proto::Event)>>,
    /// Reading from the store (from the start, or after falling behind the broadcast).
    catching_up: bool,
    /// The broadcast ended: the dispatcher is going away.
    closed: bool,
    position: i64,
    finished: bool,
    paused: bool,
    pending: std::collections::VecDeque<SseEvent>,
}

impl Follow {
    /// Queues `event` at `position` to be sent, and notes whether it ends or pauses the run.
    fn push(&mut self, position: i64, event: &proto::Event) {
        self.position = position;
        if let proto::EventKind::State { state, .. } = &event.kind {
            // A terminal state is final even if a late event follows it.
            self.finished |= state.is_terminal();
            self.paused = *state == RunState::Paused;
        }
        let data = serde_json::to_string(event).unwrap_or_default();
        self.pending.push_back(
            SseEvent::default()
                .id(position.to_string())
                .event(event.kind.name())
                .data(data),
        );
    }

    /// Reads the next page of stored events into `pending` (one page at a time: the stream
    /// holds at most a page, whatever the run printed, and reads the next one only when the
    /// client has taken this one). Returns how many were read.
    async fn read_page(&mut self) -> usize {
        let stored = self
            .dispatcher
            .store
            .events_page(self.run_id, self.position, EVENT_PAGE)
            .await
            .unwrap_or_default();
        let read = stored.len();
        for (at, event) in &stored {
            self.push(*at, event);
        }
        read
    }

    /// Waits up to a second for the next live event of this run and queues it. A repeat of
    /// what was read from the store is skipped; falling behind the broadcast means reading
    /// from the store again.
    async fn take_live(&mut self) {
        let stopping = self.dispatcher.stopping.clone();
        let received = tokio::select! {
            received = tokio::time::timeout(Duration::from_secs(1), self.live.recv()) => received,
            () = stopping.cancelled() => return,
        };
        let shared = self.dispatcher.shared_store;
        match received {
            Ok(Ok(live)) => {
                let (position, event) = &*live;
                if event.run_id != self.run_id {
                    return;
                }
                if *position == RESYNC || shared {
                    // No position, or other dispatchers store this run's events too: what is
                    // stored is the truth, read in order.
                    self.catching_up = true;
                } else if *position > self.position {
                    self.push(*position, event);
                }
            }
            Ok(Err(broadcast::error::RecvError::Lagged(_))) => self.catching_up = true,
            Ok(Err(broadcast::error::RecvError::Closed)) => self.closed = true,
            // A quiet second: with a shared store, another dispatcher may have stored events.
            Err(_) => self.catching_up = shared,
        }
    }

    /// The run's state as stored (`None` when the store does not answer, or the run is gone).
    async fn stored_state(&self) -> Option<RunState> {
        let run = self.dispatcher.store.get_run(self.run_id).await;
        run.ok().flatten().map(|r| r.state)
    }

    /// Whether the run has ended, as stored: a terminal state the stream read may be a
    /// superseded execution's, which the run did not take.
    async fn really_ended(&self) -> bool {
        self.stored_state().await.is_none_or(RunState::is_terminal)
    }

    /// Whether the run is paused now (a resume starts a new stream).
    async fn still_paused(&self) -> bool {
        self.stored_state().await == Some(RunState::Paused)
    }
}

/// One Server-Sent Event of a run's stream, as an SSE client parses it (the schema of each
/// event, as OpenAPI 3.1 tools such as schemathesis read a `text/event-stream` schema).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub(super) struct StreamedEvent {
    /// The event's position in the run (the `Last-Event-ID` to continue after it).
    id: Option<String>,
    /// The event's kind (`state`, `stage_started`, `log`, `cycle`, `result`, …).
    event: Option<String>,
    /// The event itself, as JSON.
    #[schema(content_media_type = "application/json")]
    data: String,
}

#[utoipa::path(
    get,
    path = "/v1/runs/{id}/events",
    tag = "runs",
    summary = "The run's events so far, then live, as Server-Sent Events",
    params(
        ("id" = uuid::Uuid, Path, description = "the run id"),
        ("Last-Event-ID" = Option<String>, Header, description = "continue after this event position (the `id` of the last event received)"),
    ),
    responses(
        (status = 200, description = "Server-Sent Events: each `event` is an event kind, each `data` an event (JSON), each `id` its position; the stream ends after a terminal state, or once everything stored is sent while the run is paused. The schema is one event's, as a client parses it", content_type = "text/event-stream", body = StreamedEvent),
        (status = 400, description = "the id is not a UUID (`field`: `id`)", content_type = "application/problem+json", body = Problem),
        (status = 401, description = "a token is configured and the request has none, or a wrong one", content_type = "application/problem+json", body = Problem),
        (status = 403, description = "the dispatcher has no API token and the request is not local: a Host that is not a loopback name, or a cross-site Origin or Sec-Fetch-Site", content_type = "application/problem+json", body = Problem),
        (status = 404, description = "no such run", content_type = "application/problem+json", body = Problem),
        (status = 429, description = "the run already has 16 event streams open", content_type = "application/problem+json", body = Problem),
        (status = 500, description = "the store failed; nothing was changed", content_type = "application/problem+json", body = Problem),
    )
)]
pub(super) async fn events(
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
    // Subscribed before the first store read: whatever is stored after it arrives live.
    let live = dispatcher.events_stored.subscribe();
    let follow = Follow {
        _slot: slot,
        dispatcher,
        run_id,
        live,
        catching_up: true,
        closed: false,
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
            if follow.closed || follow.dispatcher.stopping.is_cancelled() {
                return None;
            }
            if follow.finished {
                if ended_at_start || follow.really_ended().await {
                    return None;
                }
                follow.finished = false;
            }
            if follow.catching_up {
                if follow.read_page().await == EVENT_PAGE as usize {
                    continue;
                }
                follow.catching_up = false;
                // A run that had ended when the stream began ends with what is stored.
                follow.finished |= ended_at_start;
                continue;
            }
            // Everything stored is sent: a paused run's stream ends here.
            if follow.paused && follow.still_paused().await {
                return None;
            }
            follow.take_live().await;
        }
    });
    // A comment first: the response starts at once, even for a run with nothing stored yet,
    // instead of at the first event or keep-alive.
    let opening = futures_util::stream::once(async { Ok(SseEvent::default().comment("events")) });
    Ok(Sse::new(futures_util::StreamExt::chain(opening, stream)).keep_alive(KeepAlive::default()))
}
