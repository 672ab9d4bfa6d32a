//! Jira Cloud: the `jira:issue_updated` and `comment_created` webhooks, and the REST v3 calls
//! forgepool makes (as Jira Cloud's published description has them): the token's account
//! (`/myself`), a person's groups, an issue and its comments (rich text turned into
//! Markdown, `adf.rs`), a comment written and edited (in ADF), a project, the labelled
//! issues and who labelled them (the changelog).
//!
//! An issue is addressed as [`IssueRef`] `{repository: project key, number}`, so its key
//! (`SHOP-12`) is the ticket's. The repository is the `[[tracker.project]]` entry's; a
//! project not listed starts nothing. Who may start a run is asked when the event arrives:
//! an account in `allowed_accounts`, or a member of one of `allowed_groups` (`GET
//! /rest/api/3/user/groups`). An `app` account is a bot. The webhook's `X-Hub-Signature`
//! is `sha256=<hex>` of the body; its id is `X-Atlassian-Webhook-Identifier`.
//!
//! Jira has no hidden text: the run marker rides on the comment as a property
//! (`forgepool`), read back for the token's own comments only. Jira comments have no
//! reactions through the API, so none is made. Authentication is basic, the account's
//! email and the API token.

use base64::Engine;
use reqwest::Method;
use serde_json::{json, Value};

use crate::client::{path_part, Client};
use crate::config::Project;
use crate::signature::check_hmac;
use crate::{
    adf, is_stop, mentions, Actor, Ask, Comment, CommentPlace, Happening, Headers, Issue, IssueRef,
    Mention, Parsed, Tracker, TrackerConfig, TrackerError,
};

/// The signature header.
pub const SIGNATURE: &str = "x-hub-signature";
/// The delivery id header.
pub const DELIVERY: &str = "x-atlassian-webhook-identifier";
/// The comment property carrying the run marker.
pub const PROPERTY: &str = "forgepool";

/// A Jira tracker.
#[derive(Debug)]
pub struct Jira {
    config: TrackerConfig,
    client: Client,
    own: tokio::sync::OnceCell<String>,
}

fn actor(user: &Value) -> Actor {
    Actor {
        login: user["accountId"].as_str().unwrap_or("").to_string(),
        bot: user["accountType"] == "app",
    }
}

/// `SHOP-12` as the project key and the number.
fn split_key(key: &str) -> Option<IssueRef> {
    let (project, number) = key.rsplit_once('-')?;
    Some(IssueRef {
        repository: project.to_string(),
        number: number.parse().ok()?,
    })
}

fn key(issue: &IssueRef) -> String {
    format!("{}-{}", issue.repository, issue.number)
}

/// The labels of a changelog side (`fromString`, `toString`: space-separated).
fn labels(item: &Value, side: &str) -> Vec<String> {
    item[side]
        .as_str()
        .unwrap_or("")
        .split_whitespace()
        .map(str::to_ascii_lowercase)
        .collect()
}

/// The hidden markers of a Markdown text (`<!-- forgepool:… -->`), and the text without them.
fn markers(text: &str) -> (Vec<String>, String) {
    let mut found = Vec::new();
    let mut rest = text;
    let mut kept = String::new();
    while let Some(start) = rest.find("<!--") {
        kept.push_str(&rest[..start]);
        let Some(end) = rest[start..].find("-->") else {
            rest = "";
            break;
        };
        let inner = rest[start + 4..start + end].trim();
        if inner.starts_with("forgepool:") {
            found.push(inner.to_string());
        }
        rest = &rest[start + end + 3..];
    }
    kept.push_str(rest);
    (found, kept)
}

impl Jira {
    /// The tracker of a `kind = "jira"` entry.
    pub fn new(config: TrackerConfig) -> Result<Jira, String> {
        let email = config.email.as_ref().ok_or_else(|| {
            format!(
                "tracker \"{}\", `email_env`: a Jira tracker needs the account's email",
                config.name
            )
        })?;
        let basic = base64::engine::general_purpose::STANDARD.encode(format!(
            "{}:{}",
            email.expose(),
            config.token.expose()
        ));
        let client = Client::new(&config.api_url, format!("Basic {basic}"), Vec::new())?;
        Ok(Jira {
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

    fn project(&self, key: &str) -> Option<&Project> {
        self.config
            .projects
            .iter()
            .find(|p| p.key.eq_ignore_ascii_case(key))
    }

    /// What `forgepool trackers check` finds wrong: the email and token refused (`GET
    /// /rest/api/3/myself`), or a project the account cannot see.
    pub async fn check(&self) -> Vec<String> {
        let name = &self.config.name;
        match self.get("/rest/api/3/myself").await {
            Ok(me) if me["accountId"].is_string() => {}
            Ok(_) => return vec![format!("tracker \"{name}\", `api_url`: `GET /rest/api/3/myself` named no account; is {} a Jira site (https://…atlassian.net)?", self.config.api_url)],
            Err(TrackerError::Status { status: 401, message }) => return vec![format!(
                "tracker \"{name}\", `token_env`: the token in {} (with the email in `email_env`) was refused by Jira (401: {message})",
                self.config.token_env
            )],
            Err(error) => return vec![format!("tracker \"{name}\", `api_url`: {error}")],
        }
        let mut problems = Vec::new();
        for project in &self.config.projects {
            match self
                .get(&format!("/rest/api/3/project/{}", path_part(&project.key)))
                .await
            {
                Ok(_) => {}
                Err(TrackerError::Status { status: 404, .. }) => problems.push(format!(
                    "tracker \"{name}\", `project` {}: Jira knows no such project, or the account cannot see it",
                    project.key
                )),
                Err(error) => problems.push(format!(
                    "tracker \"{name}\", `project` {}: {error}",
                    project.key
                )),
            }
        }
        problems
    }

    fn issue_updated(&self, payload: &Value) -> Result<Ask, Parsed> {
        let items = payload["changelog"]["items"].as_array();
        let ours = self.config.label.to_ascii_lowercase();
        let done = payload["issue"]["fields"]["status"]["statusCategory"]["key"] == "done";
        for item in items.into_iter().flatten() {
            match item["field"].as_str() {
                Some("labels") => {
                    let (before, after) = (labels(item, "fromString"), labels(item, "toString"));
                    if after.contains(&ours) && !before.contains(&ours) {
                        if done {
                            return Err(Parsed::Ignored("the issue is done".into()));
                        }
                        return Ok(Ask::Start);
                    }
                    if before.contains(&ours) && !after.contains(&ours) {
                        return Ok(Ask::Stop("the label was removed".into()));
                    }
                }
                Some("status") | Some("resolution") if done => {
                    return Ok(Ask::Stop("the issue was done".into()));
                }
                _ => {}
            }
        }
        Err(Parsed::Ignored(format!(
            "the label {:?} was not added",
            self.config.label
        )))
    }

    fn comment_created(&self, payload: &Value) -> Result<Ask, Parsed> {
        let comment = &payload["comment"];
        let body = adf::to_markdown(&comment["body"]);
        let Some(id) = comment["id"].as_str().and_then(|id| id.parse().ok()) else {
            return Err(Parsed::Ignored("the comment has no id".into()));
        };
        if is_stop(&body, &self.config.mention) {
            return Ok(Ask::Stop(format!("{} stop", self.config.mention)));
        }
        // Wiki markup names a mentioned account `[~accountid:…]`.
        let mentioned_account = self
            .own
            .get()
            .is_some_and(|own| body.contains(&format!("[~accountid:{own}]")));
        if !mentions(&body, &self.config.mention) && !mentioned_account {
            return Err(Parsed::Ignored(format!(
                "the comment does not mention {}",
                self.config.mention
            )));
        }
        Ok(Ask::Mention(Mention {
            id,
            body,
            place: CommentPlace::Issue,
            context: None,
        }))
    }

    /// The own account's marker properties of comment `id`, as hidden markers.
    async fn marker_of(&self, id: u64) -> Result<String, TrackerError> {
        let found = self
            .get(&format!("/rest/api/3/comment/{id}/properties/{PROPERTY}"))
            .await;
        match found {
            Ok(property) => Ok(property["value"]["marker"]
                .as_str()
                .filter(|m| m.starts_with("forgepool:"))
                .map(|m| format!("\n<!-- {m} -->"))
                .unwrap_or_default()),
            Err(TrackerError::Status { status: 404, .. }) => Ok(String::new()),
            Err(error) => Err(error),
        }
    }
}

impl Tracker for Jira {
    fn config(&self) -> &TrackerConfig {
        &self.config
    }

    fn verify(&self, headers: &Headers, body: &[u8]) -> Result<(), String> {
        check_hmac(headers, SIGNATURE, body, &self.config.secret)
    }

    fn delivery_id(&self, headers: &Headers) -> Option<String> {
        crate::delivery_id(headers, DELIVERY)
    }

    fn parse(&self, _headers: &Headers, body: &[u8]) -> Result<Parsed, String> {
        let payload: Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let event = payload["webhookEvent"]
            .as_str()
            .ok_or("the body has no `webhookEvent`")?;
        let Some(issue) = payload["issue"]["key"].as_str().and_then(split_key) else {
            return Ok(Parsed::Ignored(format!("`{event}` names no issue key")));
        };
        let Some(project) = self.project(&issue.repository) else {
            return Ok(Parsed::Ignored(format!(
                "project {} is not in the trackers file",
                issue.repository
            )));
        };
        let (ask, who) = match event {
            "jira:issue_updated" => (self.issue_updated(&payload), &payload["user"]),
            "comment_created" => (
                self.comment_created(&payload),
                &payload["comment"]["author"],
            ),
            "jira:issue_deleted" => (
                Ok(Ask::Stop("the issue was deleted".into())),
                &payload["user"],
            ),
            other => return Ok(Parsed::Ignored(format!("`{other}` events are not watched"))),
        };
        let ask = match ask {
            Ok(ask) => ask,
            Err(ignored) => return Ok(ignored),
        };
        Ok(Parsed::Happening(Box::new(Happening {
            issue: IssueRef {
                repository: project.key.clone(),
                number: issue.number,
            },
            pull_request: false,
            actor: actor(who),
            ask,
            clone_url: project.repository.clone(),
            default_branch: project.git_ref.clone(),
            head_ref: None,
        })))
    }

    async fn permitted(&self, _issue: &IssueRef, login: &str) -> Result<bool, TrackerError> {
        if self.config.allowed_accounts.iter().any(|a| a == login) {
            return Ok(true);
        }
        if self.config.allowed_groups.is_empty() {
            return Ok(false);
        }
        let groups = self
            .get(&format!(
                "/rest/api/3/user/groups?accountId={}",
                path_part(login)
            ))
            .await;
        let groups = match groups {
            Err(TrackerError::Status { status: 404, .. }) => return Ok(false),
            other => other?,
        };
        Ok(groups.as_array().into_iter().flatten().any(|g| {
            g["name"].as_str().is_some_and(|name| {
                self.config
                    .allowed_groups
                    .iter()
                    .any(|allowed| allowed.eq_ignore_ascii_case(name))
            })
        }))
    }

    async fn own_login(&self) -> Result<String, TrackerError> {
        self.own
            .get_or_try_init(|| async {
                let me = self.get("/rest/api/3/myself").await?;
                me["accountId"].as_str().map(String::from).ok_or_else(|| {
                    TrackerError::Answer("`GET /rest/api/3/myself` named no accountId".into())
                })
            })
            .await
            .cloned()
    }

    async fn issue(&self, issue: &IssueRef) -> Result<Issue, TrackerError> {
        let key = key(issue);
        let answer = self
            .get(&format!(
                "/rest/api/3/issue/{}?fields=summary,description,status",
                path_part(&key)
            ))
            .await?;
        let fields = &answer["fields"];
        Ok(Issue {
            title: fields["summary"].as_str().unwrap_or("").to_string(),
            body: adf::to_markdown(&fields["description"]),
            html_url: format!("{}/browse/{key}", self.config.api_url),
            open: fields["status"]["statusCategory"]["key"] != "done",
        })
    }

    async fn comments(&self, issue: &IssueRef) -> Result<Vec<Comment>, TrackerError> {
        let answer = self
            .get(&format!(
                "/rest/api/3/issue/{}/comment?startAt=0&maxResults=100&orderBy=created",
                path_part(&key(issue))
            ))
            .await?;
        let own = self.own_login().await?;
        let mut comments = Vec::new();
        for c in answer["comments"].as_array().into_iter().flatten() {
            let Some(id) = c["id"].as_str().and_then(|id| id.parse().ok()) else {
                continue;
            };
            let author = actor(&c["author"]);
            let mut body = adf::to_markdown(&c["body"]);
            if author.login == own {
                body.push_str(&self.marker_of(id).await?);
            }
            comments.push(Comment { id, author, body });
        }
        Ok(comments)
    }

    async fn comment(&self, issue: &IssueRef, body: &str) -> Result<u64, TrackerError> {
        let (found, text) = markers(body);
        let mut request = json!({ "body": adf::from_markdown(&text) });
        if let Some(marker) = found.first() {
            request["properties"] = json!([{"key": PROPERTY, "value": {"marker": marker}}]);
        }
        let answer = self
            .client
            .call(
                Method::POST,
                &format!("/rest/api/3/issue/{}/comment", path_part(&key(issue))),
                Some(&request),
            )
            .await?;
        answer["id"]
            .as_str()
            .and_then(|id| id.parse().ok())
            .ok_or_else(|| TrackerError::Answer("the new comment has no id".into()))
    }

    async fn edit_comment(
        &self,
        issue: &IssueRef,
        id: u64,
        body: &str,
    ) -> Result<(), TrackerError> {
        let (_, text) = markers(body);
        self.client
            .call(
                Method::PUT,
                &format!("/rest/api/3/issue/{}/comment/{id}", path_part(&key(issue))),
                Some(&json!({ "body": adf::from_markdown(&text) })),
            )
            .await
            .map(|_| ())
    }

    async fn labelled(&self, repository: &str) -> Result<Vec<Happening>, TrackerError> {
        let Some(project) = self.project(repository).cloned() else {
            return Ok(Vec::new());
        };
        let jql = format!(
            "project = \"{}\" AND labels = \"{}\" AND statusCategory != Done ORDER BY created ASC",
            project.key.replace('"', ""),
            self.config.label.replace('"', "")
        );
        let found = self
            .get(&format!(
                "/rest/api/3/search/jql?jql={}&fields=summary&maxResults=100",
                path_part(&jql)
            ))
            .await?;
        let mut happenings = Vec::new();
        for issue in found["issues"].as_array().into_iter().flatten() {
            let Some(issue_ref) = issue["key"].as_str().and_then(split_key) else {
                continue;
            };
            let Some(labeller) = self.labeller(&issue_ref).await? else {
                continue;
            };
            happenings.push(Happening {
                issue: IssueRef {
                    repository: project.key.clone(),
                    number: issue_ref.number,
                },
                pull_request: false,
                actor: actor(&labeller),
                ask: Ask::Start,
                clone_url: project.repository.clone(),
                default_branch: project.git_ref.clone(),
                head_ref: None,
            });
        }
        Ok(happenings)
    }

    async fn pull_head(&self, _issue: &IssueRef) -> Result<String, TrackerError> {
        Err(TrackerError::Answer(
            "Jira issues have no pull requests".into(),
        ))
    }

    fn reacts(&self) -> bool {
        false
    }

    async fn react(&self, _issue: &IssueRef, _mention: &Mention) -> Result<(), TrackerError> {
        Ok(())
    }
}

impl Jira {
    /// Who last added the label to `issue`: the author of the newest changelog entry that
    /// added it (the last page of the changelog).
    async fn labeller(&self, issue: &IssueRef) -> Result<Option<Value>, TrackerError> {
        let path = format!("/rest/api/3/issue/{}/changelog", path_part(&key(issue)));
        let mut page = self
            .get(&format!("{path}?startAt=0&maxResults=100"))
            .await?;
        let total = page["total"].as_u64().unwrap_or(0);
        if total > 100 {
            page = self
                .get(&format!("{path}?startAt={}&maxResults=100", total - 100))
                .await?;
        }
        let ours = self.config.label.to_ascii_lowercase();
        Ok(page["values"]
            .as_array()
            .into_iter()
            .flatten()
            .rfind(|history| {
                history["items"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|item| {
                        item["field"] == "labels"
                            && labels(item, "toString").contains(&ours)
                            && !labels(item, "fromString").contains(&ours)
                    })
            })
            .map(|history| history["author"].clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: the run marker sent as visible text to Jira, or lost on the way to the
    /// comment property.
    #[test]
    fn markers_are_taken_out_of_the_text() {
        let (found, text) = markers("<!-- forgepool:run:42 -->\nhello <!-- other --> there");
        assert_eq!(found, vec!["forgepool:run:42".to_string()]);
        assert_eq!(text, "\nhello  there");
        assert_eq!(markers("open <!-- never closed").1, "open ");
    }

    /// Catches: an issue key read as the wrong project or number.
    #[test]
    fn issue_keys_split() {
        let issue = split_key("SHOP-12").unwrap();
        assert_eq!((issue.repository.as_str(), issue.number), ("SHOP", 12));
        assert_eq!(key(&issue), "SHOP-12");
        assert!(split_key("SHOP").is_none() && split_key("SHOP-x").is_none());
    }
}
