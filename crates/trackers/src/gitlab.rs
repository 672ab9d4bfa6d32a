//! GitLab: the Issue Hook and Note Hook events (as the go-gitlab test data shows them) and
//! the REST v4 calls forgepool makes: the member's access level, the token's own user, an
//! issue and its notes, a note written and edited, an award emoji, a merge request's source
//! branch, the issues carrying a label and who added it.
//!
//! The webhook's `X-Gitlab-Token` is the secret itself (GitLab signs nothing), compared in
//! constant time. Who may start a run is asked of the API when the event arrives (`GET
//! /projects/:id/members/all/:user_id`, its `access_level` against `min_permission`:
//! developer 30, maintainer 40, owner 50). A project or group access token's bot user
//! (`project_{id}_bot…`, `group_{id}_bot…`) and a login ending in `[bot]` are bots.

use reqwest::Method;
use serde_json::{json, Value};

use crate::client::{path_part, Client};
use crate::signature::check_token;
use crate::{
    header, is_stop, mentions, Actor, Ask, Comment, CommentPlace, Happening, Headers, Issue,
    IssueRef, Mention, Parsed, Tracker, TrackerConfig, TrackerError,
};

/// The secret header.
pub const TOKEN: &str = "x-gitlab-token";
/// The delivery id header.
pub const DELIVERY: &str = "x-gitlab-event-uuid";
/// The event name header.
pub const EVENT: &str = "x-gitlab-event";

/// A GitLab tracker.
#[derive(Debug)]
pub struct Gitlab {
    config: TrackerConfig,
    client: Client,
    own: tokio::sync::OnceCell<String>,
}

fn bot(username: &str) -> bool {
    let lower = username.to_ascii_lowercase();
    lower.ends_with("[bot]")
        || ["project_", "group_"].iter().any(|prefix| {
            lower
                .strip_prefix(prefix)
                .and_then(|rest| rest.split_once("_bot"))
                .is_some_and(|(id, _)| !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()))
        })
}

fn actor(user: &Value) -> Actor {
    let login = user["username"].as_str().unwrap_or("").to_string();
    Actor {
        bot: bot(&login) || user["bot"] == true,
        login,
    }
}

fn level(name: &str) -> u64 {
    match name {
        "owner" => 50,
        "maintainer" => 40,
        _ => 30,
    }
}

impl Gitlab {
    /// The tracker of a `kind = "gitlab"` entry.
    pub fn new(config: TrackerConfig) -> Result<Gitlab, String> {
        let client = Client::new(
            &config.api_url,
            format!("Bearer {}", config.token.expose()),
            Vec::new(),
        )?;
        Ok(Gitlab {
            config,
            client,
            own: tokio::sync::OnceCell::new(),
        })
    }

    /// The API client (to observe its answers).
    pub fn client(&self) -> &Client {
        &self.client
    }

    async fn get(&self, path: &str) -> Result<Value, TrackerError> {
        self.client.call(Method::GET, path, None).await
    }

    /// What `forgepool trackers check` finds wrong: the token refused (`GET /user`), or a
    /// project the token cannot see.
    pub async fn check(&self) -> Vec<String> {
        let name = &self.config.name;
        match self.get("/user").await {
            Ok(user) if user["username"].is_string() => {}
            Ok(_) => return vec![format!("tracker \"{name}\", `api_url`: `GET /user` did not name an account; is {} GitLab's API (…/api/v4)?", self.config.api_url)],
            Err(TrackerError::Status { status: 401, message }) => return vec![format!(
                "tracker \"{name}\", `token_env`: the token in {} was refused by GitLab (401: {message})",
                self.config.token_env
            )],
            Err(error) => return vec![format!("tracker \"{name}\", `api_url`: {error}")],
        }
        let mut problems = Vec::new();
        for repository in self.config.repositories.iter().filter(|r| !r.contains('*')) {
            match self.get(&format!("/projects/{}", path_part(repository))).await {
                Ok(_) => {}
                Err(TrackerError::Status { status: 404, .. }) => problems.push(format!(
                    "tracker \"{name}\", `repositories`: {repository}: GitLab knows no such project, or the token in {} cannot see it",
                    self.config.token_env
                )),
                Err(error) => problems.push(format!("tracker \"{name}\", `repositories`: {repository}: {error}")),
            }
        }
        problems
    }

    fn note(&self, payload: &Value) -> Result<(Ask, IssueRef, bool, Option<String>), Parsed> {
        let attributes = &payload["object_attributes"];
        let path = payload["project"]["path_with_namespace"]
            .as_str()
            .unwrap_or("");
        let (number, on_merge_request, head) = match attributes["noteable_type"].as_str() {
            Some("Issue") => (payload["issue"]["iid"].as_u64(), false, None),
            Some("MergeRequest") => (
                payload["merge_request"]["iid"].as_u64(),
                true,
                payload["merge_request"]["source_branch"]
                    .as_str()
                    .map(String::from),
            ),
            other => return Err(Parsed::Ignored(format!("notes on {other:?} start nothing"))),
        };
        let Some(number) = number else {
            return Err(Parsed::Ignored("the note names no issue".into()));
        };
        let body = attributes["note"].as_str().unwrap_or("");
        let Some(id) = attributes["id"].as_u64() else {
            return Err(Parsed::Ignored("the note has no id".into()));
        };
        if attributes["system"] == true {
            return Err(Parsed::Ignored("a system note".into()));
        }
        let issue = IssueRef {
            repository: path.to_string(),
            number,
        };
        if is_stop(body, &self.config.mention) {
            return Ok((
                Ask::Stop(format!("{} stop", self.config.mention)),
                issue,
                on_merge_request,
                head,
            ));
        }
        if !mentions(body, &self.config.mention) {
            return Err(Parsed::Ignored(format!(
                "the note does not mention {}",
                self.config.mention
            )));
        }
        let position = &attributes["position"];
        let context = position.is_object().then(|| {
            format!(
                "File: `{}`{}",
                position["new_path"]
                    .as_str()
                    .or(position["old_path"].as_str())
                    .unwrap_or("?"),
                position["new_line"]
                    .as_u64()
                    .map(|l| format!(", line {l}"))
                    .unwrap_or_default()
            )
        });
        let place = match (on_merge_request, context.is_some()) {
            (false, _) => CommentPlace::Issue,
            (true, true) => CommentPlace::ReviewLine,
            (true, false) => CommentPlace::Review,
        };
        let mention = Mention {
            id,
            body: body.to_string(),
            place,
            context,
        };
        Ok((Ask::Mention(mention), issue, on_merge_request, head))
    }

    fn issue_hook(&self, payload: &Value) -> Result<Ask, Parsed> {
        let attributes = &payload["object_attributes"];
        let label = &self.config.label;
        let titles = |side: &str| -> Vec<String> {
            payload["changes"]["labels"][side]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|l| l["title"].as_str().map(str::to_ascii_lowercase))
                .collect()
        };
        let (before, after) = (titles("previous"), titles("current"));
        let ours = label.to_ascii_lowercase();
        let added = after.contains(&ours) && !before.contains(&ours);
        let removed = before.contains(&ours) && !after.contains(&ours);
        match attributes["action"].as_str() {
            Some("close") => Ok(Ask::Stop("the issue was closed".into())),
            _ if removed => Ok(Ask::Stop("the label was removed".into())),
            _ if added && attributes["state"].as_str() == Some("opened") => Ok(Ask::Start),
            _ if added => Err(Parsed::Ignored("the issue is not open".into())),
            _ => Err(Parsed::Ignored(format!(
                "the label {label:?} was not added"
            ))),
        }
    }
}

impl Tracker for Gitlab {
    fn config(&self) -> &TrackerConfig {
        &self.config
    }

    fn verify(&self, headers: &Headers, _body: &[u8]) -> Result<(), String> {
        check_token(headers, TOKEN, &self.config.secret)
    }

    fn delivery_id(&self, headers: &Headers) -> Option<String> {
        crate::delivery_id(headers, DELIVERY)
    }

    fn parse(&self, headers: &Headers, body: &[u8]) -> Result<Parsed, String> {
        let event = header(headers, EVENT).ok_or("no `X-Gitlab-Event` header")?;
        let payload: Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let project = &payload["project"];
        let path = project["path_with_namespace"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let (ask, issue, pull_request, head_ref) = match event {
            "Issue Hook" => {
                let number = payload["object_attributes"]["iid"]
                    .as_u64()
                    .ok_or("the event names no issue")?;
                match self.issue_hook(&payload) {
                    Ok(ask) => (
                        ask,
                        IssueRef {
                            repository: path,
                            number,
                        },
                        false,
                        None,
                    ),
                    Err(ignored) => return Ok(ignored),
                }
            }
            "Note Hook" => match self.note(&payload) {
                Ok(found) => found,
                Err(ignored) => return Ok(ignored),
            },
            other => return Ok(Parsed::Ignored(format!("`{other}` events are not watched"))),
        };
        Ok(Parsed::Happening(Box::new(Happening {
            issue,
            pull_request,
            actor: actor(&payload["user"]),
            ask,
            clone_url: project["git_http_url"].as_str().unwrap_or("").to_string(),
            default_branch: project["default_branch"]
                .as_str()
                .unwrap_or("main")
                .to_string(),
            head_ref,
        })))
    }

    async fn permitted(&self, issue: &IssueRef, login: &str) -> Result<bool, TrackerError> {
        let users = self
            .get(&format!("/users?username={}", path_part(login)))
            .await?;
        let Some(id) = users
            .as_array()
            .and_then(|u| u.first())
            .and_then(|u| u["id"].as_u64())
        else {
            return Ok(false);
        };
        let member = self
            .get(&format!(
                "/projects/{}/members/all/{id}",
                path_part(&issue.repository)
            ))
            .await;
        let member = match member {
            Err(TrackerError::Status { status: 404, .. }) => return Ok(false),
            other => other?,
        };
        let state_active = member["state"].as_str().is_none_or(|s| s == "active");
        Ok(state_active
            && member["access_level"].as_u64().unwrap_or(0) >= level(&self.config.min_permission))
    }

    async fn own_login(&self) -> Result<String, TrackerError> {
        self.own
            .get_or_try_init(|| async {
                let answer = self.get("/user").await?;
                answer["username"]
                    .as_str()
                    .map(String::from)
                    .ok_or_else(|| TrackerError::Answer("`GET /user` named no username".into()))
            })
            .await
            .cloned()
    }

    async fn issue(&self, issue: &IssueRef) -> Result<Issue, TrackerError> {
        let answer = self
            .get(&format!(
                "/projects/{}/issues/{}",
                path_part(&issue.repository),
                issue.number
            ))
            .await?;
        Ok(Issue {
            title: answer["title"].as_str().unwrap_or("").to_string(),
            body: answer["description"].as_str().unwrap_or("").to_string(),
            html_url: answer["web_url"].as_str().unwrap_or("").to_string(),
            open: answer["state"].as_str() == Some("opened"),
        })
    }

    async fn comments(&self, issue: &IssueRef) -> Result<Vec<Comment>, TrackerError> {
        let answer = self
            .get(&format!(
                "/projects/{}/issues/{}/notes?per_page=100&sort=asc&order_by=created_at",
                path_part(&issue.repository),
                issue.number
            ))
            .await?;
        Ok(answer
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| n["system"] != true)
            .map(|n| Comment {
                id: n["id"].as_u64().unwrap_or(0),
                author: actor(&n["author"]),
                body: n["body"].as_str().unwrap_or("").to_string(),
            })
            .collect())
    }

    async fn comment(&self, issue: &IssueRef, body: &str) -> Result<u64, TrackerError> {
        let answer = self
            .client
            .call(
                Method::POST,
                &format!(
                    "/projects/{}/issues/{}/notes",
                    path_part(&issue.repository),
                    issue.number
                ),
                Some(&json!({ "body": body })),
            )
            .await?;
        answer["id"]
            .as_u64()
            .ok_or_else(|| TrackerError::Answer("the new note has no id".into()))
    }

    async fn edit_comment(
        &self,
        issue: &IssueRef,
        id: u64,
        body: &str,
    ) -> Result<(), TrackerError> {
        self.client
            .call(
                Method::PUT,
                &format!(
                    "/projects/{}/issues/{}/notes/{id}",
                    path_part(&issue.repository),
                    issue.number
                ),
                Some(&json!({ "body": body })),
            )
            .await
            .map(|_| ())
    }

    async fn labelled(&self, repository: &str) -> Result<Vec<Happening>, TrackerError> {
        let path = path_part(repository);
        let found = self.get(&format!("/projects/{path}")).await?;
        let clone_url = found["http_url_to_repo"].as_str().unwrap_or("").to_string();
        let default_branch = found["default_branch"]
            .as_str()
            .unwrap_or("main")
            .to_string();
        let label = &self.config.label;
        let issues = self
            .get(&format!(
                "/projects/{path}/issues?state=opened&per_page=100&labels={}",
                path_part(label)
            ))
            .await?;
        let mut happenings = Vec::new();
        for issue in issues.as_array().into_iter().flatten() {
            let Some(number) = issue["iid"].as_u64() else {
                continue;
            };
            let events = self
                .get(&format!(
                    "/projects/{path}/issues/{number}/resource_label_events?per_page=100"
                ))
                .await?;
            let labeller = events.as_array().into_iter().flatten().rfind(|e| {
                e["action"] == "add"
                    && e["label"]["name"]
                        .as_str()
                        .is_some_and(|n| n.eq_ignore_ascii_case(label))
            });
            let Some(event) = labeller else {
                continue;
            };
            happenings.push(Happening {
                issue: IssueRef {
                    repository: repository.to_string(),
                    number,
                },
                pull_request: false,
                actor: actor(&event["user"]),
                ask: Ask::Start,
                clone_url: clone_url.clone(),
                default_branch: default_branch.clone(),
                head_ref: None,
            });
        }
        Ok(happenings)
    }

    async fn pull_head(&self, issue: &IssueRef) -> Result<String, TrackerError> {
        let answer = self
            .get(&format!(
                "/projects/{}/merge_requests/{}",
                path_part(&issue.repository),
                issue.number
            ))
            .await?;
        answer["source_branch"]
            .as_str()
            .map(String::from)
            .ok_or_else(|| TrackerError::Answer("the merge request names no source branch".into()))
    }

    async fn react(&self, issue: &IssueRef, mention: &Mention) -> Result<(), TrackerError> {
        let kind = match mention.place {
            CommentPlace::Issue => "issues",
            CommentPlace::ReviewLine | CommentPlace::Review => "merge_requests",
        };
        self.client
            .call(
                Method::POST,
                &format!(
                    "/projects/{}/{kind}/{}/notes/{}/award_emoji",
                    path_part(&issue.repository),
                    issue.number,
                    mention.id
                ),
                Some(&json!({ "name": "eyes" })),
            )
            .await
            .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a project or group token's bot user taken for a person; a person taken for a
    /// bot.
    #[test]
    fn bots_are_told_apart() {
        assert!(bot("project_42_bot") && bot("project_42_bot_1a2b") && bot("group_7_bot_x"));
        assert!(bot("renovate[bot]"));
        assert!(!bot("user1") && !bot("project_lead") && !bot("group_bot"));
    }
}
