//! One comment per run on its issue (SPEC 17), written when the run is accepted and edited
//! in place as it moves: state, review cycles with the start of their feedback, the pull
//! request, tokens and cost, duration, the outcome. It is read from the store every
//! [`EVERY`], so edits are coalesced and the last state is always written; a hidden marker
//! (`<!-- forgepool:run:{id} -->`) lets a restarted dispatcher find its comment instead of
//! writing a second. The tracker being slow, down or rate-limited delays only the comment:
//! the run never waits for it. Each write is an event of the run (`tracker`).

use std::sync::Arc;
use std::time::Duration;

use proto::{Event, EventKind};
use tracing::warn;
use trackers::{IssueRef, Tracker, TrackerConfig, TrackerError};

use crate::dispatcher::Dispatcher;
use crate::store::trackers::Claim;
use crate::store::{RunRecord, RunStore};
use trackers::AnyTracker;

/// How often a run's comment is brought up to date (at most one edit per run in this time).
const EVERY: Duration = Duration::from_secs(5);
/// The longest wait for a tracker's rate limit before trying again.
const LONGEST_WAIT: Duration = Duration::from_secs(600);

/// The hidden marker of a run's comment.
pub fn marker(run_id: uuid::Uuid) -> String {
    format!("<!-- forgepool:run:{run_id} -->")
}

/// Follows a claim's run until its comment holds the run's final state.
pub(super) fn follow(dispatcher: Arc<Dispatcher>, tracker: Arc<AnyTracker>, claim: Claim) {
    tokio::spawn(async move {
        let stopping = dispatcher.stopping.clone();
        tokio::select! {
            () = keep_up(&dispatcher, &tracker, claim) => {}
            () = stopping.cancelled() => {}
        }
    });
}

async fn keep_up(dispatcher: &Arc<Dispatcher>, tracker: &Arc<AnyTracker>, claim: Claim) {
    let t = tracker.get();
    let config = t.config();
    let Some(issue) = issue_of(&claim.issue) else {
        return;
    };
    let run_url = dispatcher
        .trackers
        .as_ref()
        .and_then(|t| t.run_url.clone())
        .map(|url| url.replace("{run_id}", &claim.run_id.to_string()));
    let mut comment = claim.comment_id;
    let mut written = String::new();
    loop {
        let run = match dispatcher.store.get_run(claim.run_id).await {
            Ok(Some(run)) => run,
            Ok(None) => return,
            Err(error) => {
                warn!(run_id = %claim.run_id, %error, "cannot read the run for its comment");
                tokio::time::sleep(EVERY).await;
                continue;
            }
        };
        let terminal = run.state.is_terminal();
        let text = render(&run, run_url.as_deref());
        if text != written {
            let result = write(t, &issue, &mut comment, claim.run_id, &text).await;
            let action = if claim.comment_id.is_none() && written.is_empty() {
                "comment"
            } else {
                "edit"
            };
            match result {
                Ok(id) => {
                    if written.is_empty() || terminal {
                        record_comment(dispatcher, &claim, id, terminal).await;
                    }
                    written = text;
                    record_action(dispatcher, claim.run_id, config, action, None).await;
                    if terminal {
                        return;
                    }
                }
                Err(TrackerError::RateLimited(wait)) => {
                    record_action(
                        dispatcher,
                        claim.run_id,
                        config,
                        action,
                        Some(format!("rate-limited for {} s", wait.as_secs())),
                    )
                    .await;
                    tokio::time::sleep(wait.min(LONGEST_WAIT)).await;
                    continue;
                }
                Err(error) => {
                    record_action(
                        dispatcher,
                        claim.run_id,
                        config,
                        action,
                        Some(error.to_string()),
                    )
                    .await;
                }
            }
        } else if terminal {
            return;
        }
        tokio::time::sleep(EVERY).await;
    }
}

async fn record_comment(dispatcher: &Dispatcher, claim: &Claim, id: u64, terminal: bool) {
    if let Err(error) = dispatcher.store.tracker_comment(claim, id, terminal).await {
        warn!(run_id = %claim.run_id, %error, "cannot store the run's comment");
    }
}

/// Writes the comment: edits the known one, or finds it by its marker (a dispatcher before
/// this one wrote it), or writes a new one.
async fn write(
    t: &impl Tracker,
    issue: &IssueRef,
    comment: &mut Option<u64>,
    run_id: uuid::Uuid,
    text: &str,
) -> Result<u64, TrackerError> {
    if comment.is_none() {
        let own = t.own_login().await?;
        let marker = marker(run_id);
        *comment = t
            .comments(issue)
            .await?
            .into_iter()
            .find(|c| c.author.login.eq_ignore_ascii_case(&own) && c.body.contains(&marker))
            .map(|c| c.id);
    }
    match *comment {
        Some(id) => t.edit_comment(issue, id, text).await.map(|()| id),
        None => {
            let id = t.comment(issue, text).await?;
            *comment = Some(id);
            Ok(id)
        }
    }
}

fn issue_of(key: &str) -> Option<IssueRef> {
    let (repository, number) = key.rsplit_once('#')?;
    Some(IssueRef {
        repository: repository.to_string(),
        number: number.parse().ok()?,
    })
}

/// The comment's text for the run as the store holds it.
pub fn render(record: &RunRecord, run_url: Option<&str>) -> String {
    let run_id = record.job.run_id;
    let short = &run_id.to_string()[..8];
    let link = match run_url {
        Some(url) => format!("[`{short}`]({url})"),
        None => format!("`{run_id}`"),
    };
    let headline = match record.state {
        proto::RunState::Queued => "forgepool is on it: queued".to_string(),
        state if state.is_terminal() => format!("forgepool: **{state}**"),
        state => format!("forgepool is on it: **{state}**"),
    };
    let mut text = format!("{}\n{headline} · run {link}\n", marker(run_id));
    if let Some((_, reason, _)) = record.states.last() {
        if !reason.is_empty() {
            text.push_str(&format!("\n> {}\n", one_line(reason, 300)));
        }
    }
    if !record.cycles.is_empty() {
        text.push_str("\n| review cycle | verdict | feedback |\n|---|---|---|\n");
        for cycle in &record.cycles {
            text.push_str(&format!(
                "| {} | {} | {} |\n",
                cycle.cycle,
                cycle.verdict,
                one_line(&cycle.feedback, 140).replace('|', "\\|")
            ));
        }
    }
    if let Some(result) = &record.result {
        if let Some(pull) = &result.pull_request {
            text.push_str(&format!("\nPull request: {pull}\n"));
        } else if let Some(branch) = &result.branch {
            text.push_str(&format!("\nBranch: `{branch}`\n"));
        }
        if let Some(usage) = &result.usage {
            text.push_str(&format!(
                "\nTokens: {} in, {} out · cost ${:.4}\n",
                usage.input_tokens + usage.cache_read_tokens + usage.cache_write_tokens,
                usage.output_tokens,
                usage.cost_usd
            ));
        }
    }
    if let (Some(first), Some(last)) = (record.states.first(), record.states.last()) {
        let at = |t: &str| humantime::parse_rfc3339_weak(t).ok();
        if let (Some(from), Some(to)) = (at(&first.2), at(&last.2)) {
            if let Ok(took) = to.duration_since(from) {
                text.push_str(&format!("\nDuration: {} s\n", took.as_secs()));
            }
        }
    }
    text
}

/// The start of `text` on one line, at most `limit` characters.
fn one_line(text: &str, limit: usize) -> String {
    // An agent's words never mention anyone on the tracker (no notification from them).
    let flat: String = text
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('@', "@\u{2060}");
    if flat.chars().count() <= limit {
        return flat;
    }
    let cut: String = flat.chars().take(limit).collect();
    format!("{cut}…")
}

/// Stores a tracker action as an event of the run.
pub(super) async fn record_action(
    dispatcher: &Dispatcher,
    run_id: uuid::Uuid,
    config: &TrackerConfig,
    action: &str,
    error: Option<String>,
) {
    let status = match (&error, action) {
        (Some(_), _) => None,
        (None, "comment") => Some(201),
        (None, "react") => Some(201),
        (None, _) => Some(200),
    };
    let Ok(Some(record)) = dispatcher.store.get_run(run_id).await else {
        return;
    };
    let event = Event::new(
        run_id,
        EventKind::Tracker {
            tracker: config.name.clone(),
            action: action.to_string(),
            status,
            error,
        },
    );
    if let Err(error) = dispatcher.store_event(&record.job, &event).await {
        warn!(%run_id, %error, "cannot record a tracker action");
    }
}
