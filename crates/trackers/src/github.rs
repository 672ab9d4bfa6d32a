//! GitHub: the events of `issues`, `issue_comment`, `pull_request_review_comment` and
//! `pull_request_review` (as `@octokit/webhooks-examples` shows them), and the REST calls
//! forgepool makes (as `@octokit/openapi` describes them): the collaborator permission, the
//! token's own account, an issue and its comments, a comment written and edited, an 👀
//! reaction.
//!
//! Who may start a run is asked of the API at event time (`GET
//! /repos/{owner}/{repo}/collaborators/{login}/permission`), never read from the payload's
//! `author_association`; a sender whose `type` is not `User`, or whose login ends in `[bot]`,
//! is a bot and is ignored before any call.

use reqwest::Method;
use serde_json::{json, Value};

use crate::client::{path_part, Client};
use crate::signature::check_hmac;
use crate::{
    header, is_stop, mentions, Actor, Ask, Comment, CommentPlace, Happening, Headers, Issue,
    IssueRef, Mention, Parsed, Tracker, TrackerConfig, TrackerError,
};

/// The signature header.
pub const SIGNATURE: &str = "x-hub-signature-256";
/// The delivery id header.
pub const DELIVERY: &str = "x-github-delivery";
/// The event name header.
pub const EVENT: &str = "x-github-event";

/// A GitHub tracker.
#[derive(Debug)]
pub struct Github {
    config: TrackerConfig,
    client: Client,
    own: tokio::sync::OnceCell<String>,
}

impl Github {
    /// The tracker of a `kind = "github"` entry.
    pub fn new(config: TrackerConfig) -> Result<Github, String> {
        let client = Client::new(
            &config.api_url,
            format!("Bearer {}", config.token.expose()),
            vec![
                ("accept", "application/vnd.github+json"),
                ("x-github-api-version", "2022-11-28"),
            ],
        )?;
        Ok(Github {
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
}

/// The sender of an event: a bot when GitHub says so or its login says `[bot]`.
fn actor(value: &Value) -> Actor {
    let login = value["login"].as_str().unwrap_or("").to_string();
    let bot = value["type"].as_str() != Some("User") || login.ends_with("[bot]");
    Actor { login, bot }
}

/// The rank of a GitHub permission (`role_name` first: it tells `maintain` and `triage`).
fn rank(permission: &str) -> u8 {
    match permission {
        "admin" => 5,
        "maintain" => 4,
        "write" | "push" => 3,
        "triage" => 2,
        "read" | "pull" => 1,
        _ => 0,
    }
}

impl Tracker for Github {
    fn config(&self) -> &TrackerConfig {
        &self.config
    }

    fn verify(&self, headers: &Headers, body: &[u8]) -> Result<(), String> {
        check_hmac(headers, SIGNATURE, body, &self.config.secret)
    }

    fn delivery_id(&self, headers: &Headers) -> Option<String> {
        crate::delivery_id(headers, DELIVERY)
    }

    fn parse(&self, headers: &Headers, body: &[u8]) -> Result<Parsed, String> {
        let event = header(headers, EVENT).ok_or("no `X-GitHub-Event` header")?;
        let payload: Value =
            serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
        let action = payload["action"].as_str().unwrap_or("");
        let config = &self.config;
        let (subject, pull_request) = match event {
            "issues" | "issue_comment" => {
                let issue = &payload["issue"];
                (issue, !issue["pull_request"].is_null())
            }
            "pull_request_review_comment" | "pull_request_review" => {
                (&payload["pull_request"], true)
            }
            other => return Ok(Parsed::Ignored(format!("`{other}` events are not watched"))),
        };
        let ask = match (event, action) {
            ("issues", "labeled") => {
                let name = payload["label"]["name"].as_str().unwrap_or("");
                if !name.eq_ignore_ascii_case(&config.label) {
                    return Ok(Parsed::Ignored(format!(
                        "the label {name:?} is not {:?}",
                        config.label
                    )));
                }
                if subject["state"].as_str() != Some("open") {
                    return Ok(Parsed::Ignored("the issue is not open".into()));
                }
                Ask::Start
            }
            ("issues", "unlabeled") => {
                let name = payload["label"]["name"].as_str().unwrap_or("");
                if !name.eq_ignore_ascii_case(&config.label) {
                    return Ok(Parsed::Ignored(format!(
                        "the label {name:?} is not {:?}",
                        config.label
                    )));
                }
                Ask::Stop("the label was removed".into())
            }
            ("issues", "closed") => Ask::Stop("the issue was closed".into()),
            ("issue_comment", "created") => {
                self.mention(&payload["comment"], CommentPlace::Issue)?
            }
            ("pull_request_review_comment", "created") => {
                self.mention(&payload["comment"], CommentPlace::ReviewLine)?
            }
            ("pull_request_review", "submitted") => {
                self.mention(&payload["review"], CommentPlace::Review)?
            }
            (event, action) => {
                return Ok(Parsed::Ignored(format!(
                    "`{event}` `{action}` starts nothing"
                )))
            }
        };
        let ask = match ask {
            Ask::Mention(m) if m.body.is_empty() => {
                return Ok(Parsed::Ignored(format!(
                    "the comment does not mention {}",
                    config.mention
                )))
            }
            ask => ask,
        };
        let repository = &payload["repository"];
        let full_name = repository["full_name"].as_str().unwrap_or("").to_string();
        let number = subject["number"]
            .as_u64()
            .ok_or("the event names no issue number")?;
        Ok(Parsed::Happening(Box::new(Happening {
            issue: IssueRef {
                repository: full_name,
                number,
            },
            pull_request,
            actor: actor(&payload["sender"]),
            ask,
            clone_url: repository["clone_url"].as_str().unwrap_or("").to_string(),
            default_branch: repository["default_branch"]
                .as_str()
                .unwrap_or("main")
                .to_string(),
            head_ref: subject["head"]["ref"].as_str().map(String::from),
        })))
    }

    async fn permitted(&self, issue: &IssueRef, login: &str) -> Result<bool, TrackerError> {
        let answer = self
            .get(&format!(
                "/repos/{}/collaborators/{}/permission",
                issue.repository,
                path_part(login)
            ))
            .await;
        let answer = match answer {
            // Not a collaborator at all.
            Err(TrackerError::Status { status: 404, .. }) => return Ok(false),
            other => other?,
        };
        let role = answer["role_name"]
            .as_str()
            .or(answer["permission"].as_str())
            .unwrap_or("");
        Ok(rank(role) >= rank(&self.config.min_permission))
    }

    async fn own_login(&self) -> Result<String, TrackerError> {
        self.own
            .get_or_try_init(|| async {
                let answer = self.get("/user").await?;
                answer["login"]
                    .as_str()
                    .map(String::from)
                    .ok_or_else(|| TrackerError::Answer("`GET /user` named no login".into()))
            })
            .await
            .cloned()
    }

    async fn issue(&self, issue: &IssueRef) -> Result<Issue, TrackerError> {
        let answer = self
            .get(&format!(
                "/repos/{}/issues/{}",
                issue.repository, issue.number
            ))
            .await?;
        Ok(Issue {
            title: answer["title"].as_str().unwrap_or("").to_string(),
            body: answer["body"].as_str().unwrap_or("").to_string(),
            html_url: answer["html_url"].as_str().unwrap_or("").to_string(),
            open: answer["state"].as_str() == Some("open"),
        })
    }

    async fn comments(&self, issue: &IssueRef) -> Result<Vec<Comment>, TrackerError> {
        let answer = self
            .get(&format!(
                "/repos/{}/issues/{}/comments?per_page=100",
                issue.repository, issue.number
            ))
            .await?;
        Ok(answer
            .as_array()
            .map(|list| {
                list.iter()
                    .map(|c| Comment {
                        id: c["id"].as_u64().unwrap_or(0),
                        author: actor(&c["user"]),
                        body: c["body"].as_str().unwrap_or("").to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    async fn comment(&self, issue: &IssueRef, body: &str) -> Result<u64, TrackerError> {
        let answer = self
            .client
            .call(
                Method::POST,
                &format!(
                    "/repos/{}/issues/{}/comments",
                    issue.repository, issue.number
                ),
                Some(&json!({ "body": body })),
            )
            .await?;
        answer["id"]
            .as_u64()
            .ok_or_else(|| TrackerError::Answer("the new comment has no id".into()))
    }

    async fn edit_comment(
        &self,
        issue: &IssueRef,
        id: u64,
        body: &str,
    ) -> Result<(), TrackerError> {
        self.client
            .call(
                Method::PATCH,
                &format!("/repos/{}/issues/comments/{id}", issue.repository),
                Some(&json!({ "body": body })),
            )
            .await
            .map(|_| ())
    }

    async fn labelled(&self, repository: &str) -> Result<Vec<Happening>, TrackerError> {
        let label = &self.config.label;
        let repo = self.get(&format!("/repos/{repository}")).await?;
        let clone_url = repo["clone_url"].as_str().unwrap_or("").to_string();
        let default_branch = repo["default_branch"]
            .as_str()
            .unwrap_or("main")
            .to_string();
        let issues = self
            .get(&format!(
                "/repos/{repository}/issues?state=open&per_page=100&labels={}",
                path_part(label)
            ))
            .await?;
        let mut found = Vec::new();
        for issue in issues.as_array().into_iter().flatten() {
            let Some(number) = issue["number"].as_u64() else {
                continue;
            };
            if !issue["pull_request"].is_null() {
                continue;
            }
            let issue_ref = IssueRef {
                repository: repository.to_string(),
                number,
            };
            // Who added the label last: the person whose permission decides.
            let events = self
                .get(&format!(
                    "/repos/{repository}/issues/{number}/events?per_page=100"
                ))
                .await?;
            let labeller = events
                .as_array()
                .into_iter()
                .flatten()
                .rfind(|e| {
                    e["event"] == "labeled"
                        && e["label"]["name"]
                            .as_str()
                            .is_some_and(|n| n.eq_ignore_ascii_case(label))
                })
                .map(|e| actor(&e["actor"]));
            let Some(actor) = labeller else {
                continue;
            };
            found.push(Happening {
                issue: issue_ref,
                pull_request: false,
                actor,
                ask: Ask::Start,
                clone_url: clone_url.clone(),
                default_branch: default_branch.clone(),
                head_ref: None,
            });
        }
        Ok(found)
    }

    async fn pull_head(&self, issue: &IssueRef) -> Result<String, TrackerError> {
        let answer = self
            .get(&format!(
                "/repos/{}/pulls/{}",
                issue.repository, issue.number
            ))
            .await?;
        answer["head"]["ref"]
            .as_str()
            .map(String::from)
            .ok_or_else(|| TrackerError::Answer("the pull request names no head branch".into()))
    }

    async fn react(&self, issue: &IssueRef, mention: &Mention) -> Result<(), TrackerError> {
        let path = match mention.place {
            CommentPlace::Issue => format!(
                "/repos/{}/issues/comments/{}/reactions",
                issue.repository, mention.id
            ),
            CommentPlace::ReviewLine => {
                format!(
                    "/repos/{}/pulls/comments/{}/reactions",
                    issue.repository, mention.id
                )
            }
            // A review's body takes no reaction.
            CommentPlace::Review => return Ok(()),
        };
        self.client
            .call(Method::POST, &path, Some(&json!({ "content": "eyes" })))
            .await
            .map(|_| ())
    }
}

impl Github {
    /// What `forgepool trackers check` finds wrong: the token refused (`GET /user`), a
    /// repository the token cannot see, or one where it cannot write comments.
    pub async fn check(&self) -> Vec<String> {
        let name = &self.config.name;
        let mut problems = Vec::new();
        match self.get("/user").await {
            Ok(user) if user["login"].is_string() => {}
            Ok(_) => problems.push(format!("tracker \"{name}\", `api_url`: `GET /user` did not name an account; is {} GitHub's API?", self.config.api_url)),
            Err(TrackerError::Status { status: 401, message }) => problems.push(format!(
                "tracker \"{name}\", `token_env`: the token in {} was refused by GitHub (401: {message})",
                self.config.token_env
            )),
            Err(error) => {
                problems.push(format!("tracker \"{name}\", `api_url`: {error}"));
                return problems;
            }
        }
        if !problems.is_empty() {
            return problems;
        }
        for repository in self.config.repositories.iter().filter(|r| !r.contains('*')) {
            match self.get(&format!("/repos/{repository}")).await {
                Ok(answer) => {
                    let may = &answer["permissions"];
                    if may.is_object() && may["triage"] != true && may["push"] != true && may["admin"] != true {
                        problems.push(format!("tracker \"{name}\", `repositories`: {repository}: the token's account may read it but not write comments or reactions (it needs triage or write)"));
                    }
                }
                Err(TrackerError::Status { status: 404, .. }) => problems.push(format!(
                    "tracker \"{name}\", `repositories`: {repository}: GitHub knows no such repository, or the token in {} cannot see it",
                    self.config.token_env
                )),
                Err(error) => problems.push(format!("tracker \"{name}\", `repositories`: {repository}: {error}")),
            }
        }
        problems
    }

    /// A comment's ask: a stop order, a mention (its body empty when there is none).
    fn mention(&self, comment: &Value, place: CommentPlace) -> Result<Ask, String> {
        let body = comment["body"].as_str().unwrap_or("");
        let id = comment["id"].as_u64().ok_or("the comment has no id")?;
        if is_stop(body, &self.config.mention) {
            return Ok(Ask::Stop(format!("{} stop", self.config.mention)));
        }
        let body = if mentions(body, &self.config.mention) {
            body.to_string()
        } else {
            String::new()
        };
        let context = (place == CommentPlace::ReviewLine).then(|| {
            let line = comment["line"]
                .as_u64()
                .or(comment["original_line"].as_u64());
            format!(
                "File: `{}`{}\n\n```diff\n{}\n```",
                comment["path"].as_str().unwrap_or("?"),
                line.map(|l| format!(", line {l}")).unwrap_or_default(),
                comment["diff_hunk"].as_str().unwrap_or("").trim_end()
            )
        });
        Ok(Ask::Mention(Mention {
            id,
            body,
            place,
            context,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker() -> Github {
        let env = |name: &str| match name {
            "T" => Some("ghp_x".to_string()),
            "S" => Some("a-webhook-secret-of-32-characters".to_string()),
            _ => None,
        };
        let config = crate::config::parse(
            "[[tracker]]\nname = \"gh\"\nkind = \"github\"\napi_url = \"https://api.github.com\"\ntoken_env = \"T\"\nsecret_env = \"S\"\nrepositories = [\"acme/*\"]\nskill = \"s\"\n",
            &env,
        )
        .unwrap();
        Github::new(config.trackers.into_iter().next().unwrap()).unwrap()
    }

    fn parse(event: &str, payload: Value) -> Parsed {
        let headers = vec![(EVENT.to_string(), event.to_string())];
        tracker()
            .parse(&headers, payload.to_string().as_bytes())
            .unwrap()
    }

    fn repo() -> Value {
        json!({"full_name": "acme/shop", "clone_url": "https://github.com/acme/shop.git", "default_branch": "main"})
    }

    /// Catches: another label, a closed issue or an unmentioned comment taken as a trigger;
    /// a bot sender not marked; a stop order taken for a start.
    #[test]
    fn only_the_label_and_the_mention_ask_anything() {
        let user = json!({"login": "octo", "type": "User"});
        let labeled = |label: &str, state: &str| {
            parse(
                "issues",
                json!({"action": "labeled", "label": {"name": label}, "issue": {"number": 7, "state": state}, "repository": repo(), "sender": user}),
            )
        };
        let Parsed::Happening(start) = labeled("forgepool", "open") else {
            panic!()
        };
        assert_eq!(
            (start.ask.clone(), start.issue.key()),
            (Ask::Start, "acme/shop#7".to_string())
        );
        assert!(!start.actor.bot);
        assert!(matches!(labeled("bug", "open"), Parsed::Ignored(_)));
        assert!(matches!(labeled("forgepool", "closed"), Parsed::Ignored(_)));
        let comment = |body: &str, sender: Value| {
            parse(
                "issue_comment",
                json!({"action": "created", "comment": {"id": 5, "body": body}, "issue": {"number": 7}, "repository": repo(), "sender": sender}),
            )
        };
        assert!(matches!(
            comment("looks fine", user.clone()),
            Parsed::Ignored(_)
        ));
        let Parsed::Happening(mention) = comment("@forgepool fix it", user.clone()) else {
            panic!()
        };
        assert!(matches!(mention.ask, Ask::Mention(ref m) if m.id == 5));
        let Parsed::Happening(stop) = comment("@forgepool stop", user) else {
            panic!()
        };
        assert!(matches!(stop.ask, Ask::Stop(_)));
        let Parsed::Happening(bot) =
            comment("@forgepool fix", json!({"login": "ci[bot]", "type": "Bot"}))
        else {
            panic!()
        };
        assert!(bot.actor.bot);
        assert!(matches!(
            parse("ping", json!({"zen": "x"})),
            Parsed::Ignored(_)
        ));
    }
}
