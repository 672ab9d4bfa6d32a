//! What a tracker's happening does (SPEC 17). In order: a bot's or the token's own account's
//! event is ignored; a repository outside `repositories` is ignored; the person is asked of
//! the tracker's API (never the payload) and a refusal starts nothing and reads nothing more;
//! then a start claims its trigger (one run per issue and trigger, whatever arrives twice),
//! reads the issue, makes the ticket and submits the run under an idempotency key made of the
//! claim, and the run's live comment follows it. A stop cancels the issue's running runs.

use std::collections::HashMap;
use std::sync::Arc;

use proto::RunRequest;
use tracing::{info, warn};
use trackers::{text, Ask, Happening, IssueRef, Tracker, TrackerConfig};

use trackers::AnyTracker;

use super::comment;
use crate::dispatcher::{Dispatcher, Submission};
use crate::store::trackers::Claim;
use crate::store::RunStore;

/// Works on one happening and counts its outcome.
pub(super) async fn handle(
    dispatcher: &Arc<Dispatcher>,
    tracker: &Arc<AnyTracker>,
    happening: Happening,
) {
    let name = tracker.get().config().name.clone();
    let outcome = match decide(dispatcher, tracker, &happening).await {
        Ok(outcome) => outcome,
        Err(error) => {
            warn!(tracker = %name, issue = %happening.issue.key(), %error, "a tracker event could not be acted on");
            "error"
        }
    };
    info!(tracker = %name, issue = %happening.issue.key(), actor = %happening.actor.login, outcome, "tracker event");
    dispatcher.metrics.tracker_delivery(&name, outcome);
}

async fn decide(
    dispatcher: &Arc<Dispatcher>,
    tracker: &Arc<AnyTracker>,
    happening: &Happening,
) -> Result<&'static str, String> {
    let t = tracker.get();
    let config = t.config();
    if happening.actor.bot || happening.actor.login.is_empty() {
        return Ok("ignored");
    }
    let own = t.own_login().await.map_err(|e| e.to_string())?;
    if happening.actor.login.eq_ignore_ascii_case(&own) {
        return Ok("ignored");
    }
    if !config.allows_repository(&happening.issue.repository) {
        return Ok("ignored");
    }
    let issue_key = happening.issue.key();
    let permitted = |login: String| async move {
        t.permitted(&happening.issue, &login)
            .await
            .map_err(|e| e.to_string())
    };
    match &happening.ask {
        Ask::Stop(reason) => {
            let by_order = reason.ends_with(" stop");
            if by_order && !permitted(happening.actor.login.clone()).await? {
                return Ok("refused_permission");
            }
            stop(
                dispatcher,
                config,
                &issue_key,
                reason,
                &happening.actor.login,
            )
            .await
        }
        Ask::Start | Ask::Mention(_) => {
            if !permitted(happening.actor.login.clone()).await? {
                warn!(tracker = %config.name, issue = %issue_key, actor = %happening.actor.login, "a trigger from a person without permission was refused");
                if config.reply_refused {
                    reply_refused(dispatcher, t, happening).await?;
                }
                return Ok("refused_permission");
            }
            start(dispatcher, tracker, happening).await
        }
    }
}

/// The one reply a refused person gets on an issue (`reply_refused = true`): a claim per
/// person and issue makes it one, also across redeliveries and replicas.
async fn reply_refused(
    dispatcher: &Arc<Dispatcher>,
    t: &impl Tracker,
    happening: &Happening,
) -> Result<(), String> {
    let config = t.config();
    let login = &happening.actor.login;
    let claim = Claim {
        tracker: config.name.clone(),
        claim: format!(
            "{}#refused:{}",
            happening.issue.key(),
            login.to_ascii_lowercase()
        ),
        issue: happening.issue.key(),
        run_id: uuid::Uuid::nil(),
        comment_id: None,
        finished: false,
    };
    if !dispatcher
        .store
        .tracker_claim(&claim)
        .await
        .map_err(|e| e.to_string())?
    {
        return Ok(());
    }
    let text = if config.kind == trackers::Kind::Jira {
        "forgepool takes requests on this project only from the groups and accounts it was told of; nothing was started.".to_string()
    } else {
        format!(
            "@{login}: forgepool takes requests on this repository only from people with {} access; nothing was started.",
            config.min_permission
        )
    };
    let id = t
        .comment(&happening.issue, &text)
        .await
        .map_err(|e| e.to_string())?;
    dispatcher
        .store
        .tracker_comment(&claim, id, true)
        .await
        .map_err(|e| e.to_string())
}

/// Cancels the runs of the issue's claims that have not ended.
async fn stop(
    dispatcher: &Arc<Dispatcher>,
    config: &TrackerConfig,
    issue: &str,
    reason: &str,
    actor: &str,
) -> Result<&'static str, String> {
    let claims = dispatcher
        .store
        .tracker_claims(Some(&config.name), Some(issue))
        .await
        .map_err(|e| e.to_string())?;
    let mut stopped = false;
    for claim in claims {
        let Ok(Some(record)) = dispatcher.store.get_run(claim.run_id).await else {
            continue;
        };
        if record.state.is_terminal() {
            continue;
        }
        info!(run_id = %claim.run_id, %reason, %actor, "cancelling the run: its issue said so");
        dispatcher
            .cancel(&record.job, record.state)
            .await
            .map_err(|e| e.to_string())?;
        stopped = true;
    }
    Ok(if stopped { "stopped" } else { "ignored" })
}

async fn start(
    dispatcher: &Arc<Dispatcher>,
    tracker: &Arc<AnyTracker>,
    happening: &Happening,
) -> Result<&'static str, String> {
    let t = tracker.get();
    let config = t.config();
    let issue_key = happening.issue.key();
    let (claim_key, mention) = match &happening.ask {
        Ask::Mention(mention) => (format!("{issue_key}#comment:{}", mention.id), Some(mention)),
        _ => (format!("{issue_key}#label"), None),
    };
    let store = &dispatcher.store;
    if store
        .tracker_claim_of(&config.name, &claim_key)
        .await
        .map_err(|e| e.to_string())?
        .is_some()
    {
        return Ok("duplicate");
    }
    let earlier = store
        .tracker_claims(Some(&config.name), Some(&issue_key))
        .await
        .map_err(|e| e.to_string())?;
    if happening.pull_request || (mention.is_some() && !earlier.is_empty()) {
        // A mention on a run's pull request, or on an issue that had a run: a follow-up.
        let Some(mention) = mention else {
            return Ok("ignored");
        };
        return follow_up(dispatcher, tracker, happening, mention, claim_key).await;
    }
    if mention.is_none() && !earlier.is_empty() {
        return Ok("duplicate");
    }
    let issue = t.issue(&happening.issue).await.map_err(|e| e.to_string())?;
    if !issue.open {
        return Ok("ignored");
    }
    let brief = brief(t, &happening.issue, &issue, mention.map(|m| m.id)).await?;
    let mut request = serde_json::Map::new();
    request.insert(
        "ticket".into(),
        trackers::ticket_key(config, &happening.issue).into(),
    );
    request.insert("skill".into(), config.skill.clone().into());
    request.insert("brief".into(), brief.into());
    request.insert(
        "repository".into(),
        serde_json::json!({"url": happening.clone_url, "ref": happening.default_branch}),
    );
    for (key, value) in &config.request {
        request.insert(key.clone(), value.clone());
    }
    let request: RunRequest =
        serde_json::from_value(serde_json::Value::Object(request)).map_err(|e| {
            format!(
                "the trackers file's request fields for {:?} are not a valid request: {e}",
                config.name
            )
        })?;
    let key = format!("tracker:{}:{claim_key}", config.name);
    let run_id = match dispatcher.submit_once(request, Some(&key)).await {
        Ok(Submission::New(frozen)) => frozen.job.run_id,
        Ok(Submission::Repeat(_)) => return Ok("duplicate"),
        Err(error) => return Err(format!("the run was refused: {error:?}")),
    };
    let claim = Claim {
        tracker: config.name.clone(),
        claim: claim_key,
        issue: issue_key,
        run_id,
        comment_id: None,
        finished: false,
    };
    take(dispatcher, tracker, happening, mention, claim, "started").await
}

/// A follow-up round asked on the issue or on the run's pull request: the ticket's latest
/// delivered run is continued with the comment (and a line comment's file, line and hunk).
async fn follow_up(
    dispatcher: &Arc<Dispatcher>,
    tracker: &Arc<AnyTracker>,
    happening: &Happening,
    mention: &trackers::Mention,
    claim_key: String,
) -> Result<&'static str, String> {
    let t = tracker.get();
    let config = t.config();
    let Some((ticket, issue)) = ticket_of(t, happening).await? else {
        return Ok("ignored");
    };
    let (runs, _) = dispatcher
        .store
        .list_runs(crate::store::RunFilter {
            ticket: Some(ticket.clone()),
            limit: 100,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let delivered = runs.iter().find(|r| {
        matches!(
            r.state,
            proto::RunState::Delivered | proto::RunState::DeliveredWithWarnings
        )
    });
    let Some(previous) = delivered else {
        info!(tracker = %config.name, %ticket, "a follow-up was asked of a ticket with no delivered run");
        return Ok("ignored");
    };
    let mut feedback = text::clean(&mention.body, trackers::MAX_BRIEF_BYTES);
    if let Some(context) = &mention.context {
        feedback = format!(
            "{feedback}\n\n{}",
            text::clean(context, trackers::MAX_BRIEF_BYTES)
        );
    }
    let key = format!("tracker:{}:{claim_key}", config.name);
    let run_id = match dispatcher
        .follow_up(
            previous.run_id,
            &feedback,
            Some(&key),
            config.max_follow_ups,
        )
        .await
    {
        Ok(Submission::New(frozen)) => frozen.job.run_id,
        Ok(Submission::Repeat(_)) => return Ok("duplicate"),
        Err(refused) => {
            warn!(tracker = %config.name, %ticket, ?refused, "a follow-up was not started");
            return Ok("ignored");
        }
    };
    let claim = Claim {
        tracker: config.name.clone(),
        claim: claim_key,
        issue: issue.key(),
        run_id,
        comment_id: None,
        finished: false,
    };
    take(
        dispatcher,
        tracker,
        happening,
        Some(mention),
        claim,
        "followed_up",
    )
    .await
}

/// The end of a start or a follow-up: the claim stored (a replica that lost the race does
/// nothing more), 👀 on the triggering comment, and the run's comment followed.
async fn take(
    dispatcher: &Arc<Dispatcher>,
    tracker: &Arc<AnyTracker>,
    happening: &Happening,
    mention: Option<&trackers::Mention>,
    claim: Claim,
    outcome: &'static str,
) -> Result<&'static str, String> {
    let t = tracker.get();
    if !dispatcher
        .store
        .tracker_claim(&claim)
        .await
        .map_err(|e| e.to_string())?
    {
        return Ok("duplicate");
    }
    if let Some(mention) = mention.filter(|_| t.reacts()) {
        let reacted = t.react(&happening.issue, mention).await;
        comment::record_action(
            dispatcher,
            claim.run_id,
            t.config(),
            "react",
            reacted.err().map(|e| e.to_string()),
        )
        .await;
    }
    comment::follow(Arc::clone(dispatcher), Arc::clone(tracker), claim);
    Ok(outcome)
}

/// The ticket a follow-up is asked of, and its issue: for a pull request, from its head
/// branch (`forge/{ticket}`); `None` for a pull request that is not a run's.
async fn ticket_of(
    t: &impl Tracker,
    happening: &Happening,
) -> Result<Option<(String, IssueRef)>, String> {
    let config = t.config();
    Ok(Some(if happening.pull_request {
        let head = match &happening.head_ref {
            Some(head) => head.clone(),
            None => t
                .pull_head(&happening.issue)
                .await
                .map_err(|e| e.to_string())?,
        };
        let Some(ticket) = head.strip_prefix("forge/").map(str::to_ascii_uppercase) else {
            return Ok(None);
        };
        let Some(number) = ticket.rsplit('-').next().and_then(|n| n.parse().ok()) else {
            return Ok(None);
        };
        let issue = IssueRef {
            repository: happening.issue.repository.clone(),
            number,
        };
        (ticket, issue)
    } else {
        (
            trackers::ticket_key(config, &happening.issue),
            happening.issue.clone(),
        )
    }))
}

/// The brief: the title, the body, and the comments of permitted people up to the trigger,
/// each cleaned of what a person does not see and the whole bounded.
async fn brief(
    t: &impl Tracker,
    issue_ref: &IssueRef,
    issue: &trackers::Issue,
    until: Option<u64>,
) -> Result<String, String> {
    let limit = trackers::MAX_BRIEF_BYTES;
    let mut brief = format!(
        "# {}\n\n{}\n",
        text::clean(&issue.title, 1_000),
        text::clean(&issue.body, limit)
    );
    let own = t.own_login().await.map_err(|e| e.to_string())?;
    let comments = t.comments(issue_ref).await.map_err(|e| e.to_string())?;
    let mut allowed: HashMap<String, bool> = HashMap::new();
    let mut written = Vec::new();
    for comment in comments {
        if until.is_some_and(|until| comment.id > until) {
            break;
        }
        if comment.author.bot || comment.author.login.eq_ignore_ascii_case(&own) {
            continue;
        }
        let login = comment.author.login.clone();
        let may = match allowed.get(&login) {
            Some(may) => *may,
            None => {
                let may = t.permitted(issue_ref, &login).await.unwrap_or(false);
                allowed.insert(login.clone(), may);
                may
            }
        };
        if may {
            written.push(format!(
                "**{login}**: {}",
                text::clean(&comment.body, limit)
            ));
        }
    }
    if !written.is_empty() {
        brief.push_str("\n## Comments\n\n");
        brief.push_str(&written.join("\n\n"));
        brief.push('\n');
    }
    Ok(text::cut(&brief, limit))
}
