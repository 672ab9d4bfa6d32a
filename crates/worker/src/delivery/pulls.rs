//! Pull requests and commit statuses on the forge a repository lives on (SPEC 9), through its
//! REST API with the forges file's token: find the open pull request from `forge/{ticket}` to
//! the base ref and update it, or open one, then set a commit status on the delivered commit.
//! GitHub (REST v3: pull requests, `draft` when opened, changed later through GraphQL), GitLab (v4: merge requests, a draft
//! is a `Draft: ` title, so updates change it too) and Gitea or Forgejo (v1: pull requests, a
//! draft is a `WIP: ` title).
//!
//! The forge is an outside service: every request has a time limit, a rate limit's
//! `Retry-After` is honoured (up to a minute), a 5xx is tried again, and any other refusal
//! ends this step with a reason that names the host and the status. The branch stays
//! delivered whatever happens here.
//!
//! One `Api` serves the three, its authorization and headers following the forge's kind. A run
//! `delivered_with_warnings` gets a draft. `crate::engine` calls this once the run is delivered,
//! and puts the address in the result, a `pull_request` event and the report.

use std::time::Duration;

use serde::Deserialize;
use serde_json::json;
use tracing::warn;

use crate::delivery::forges::{Forge, ForgeKind};

/// How long one API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// The most attempts per request (rate limits and server errors).
const ATTEMPTS: u32 = 3;
/// The longest wait a rate limit may ask for.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
/// GitHub refuses longer pull request bodies.
const MAX_BODY_CHARS: usize = 65_000;

/// What the delivery asks of the forge.
#[derive(Debug)]
pub struct PullRequestSpec<'a> {
    /// The repository URL the branch was pushed to.
    pub repository: &'a str,
    /// The delivered branch, `forge/{ticket}`.
    pub branch: &'a str,
    /// The base ref; the repository's default branch when the request named none.
    pub base: Option<&'a str>,
    /// The pull request's title.
    pub title: String,
    /// Its body: the run's report.
    pub body: &'a str,
    /// A draft (the run ended `delivered_with_warnings`).
    pub draft: bool,
    /// The delivered commit, for its status.
    pub commit: &'a str,
    /// The status's description (at most 140 characters are sent).
    pub status: &'a str,
    /// The status's link to the run, when the forges file gives one.
    pub link: Option<String>,
}

/// What became of the pull request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullRequest {
    /// Its address for people.
    pub url: String,
    /// `opened` or `updated`.
    pub action: &'static str,
}

#[derive(Deserialize)]
struct Pull {
    number: u64,
    html_url: String,
    #[serde(default)]
    node_id: String,
    #[serde(default)]
    draft: Option<bool>,
}

#[derive(Deserialize)]
struct Repository {
    default_branch: String,
}

/// Opens or updates the pull request of a delivered branch, and sets its commit's status.
pub async fn open_or_update(
    forge: &Forge,
    spec: &PullRequestSpec<'_>,
) -> Result<Option<PullRequest>, String> {
    let pull = match forge.kind {
        ForgeKind::Github => github(forge, spec).await?,
        ForgeKind::Gitlab => gitlab(forge, spec).await?,
        ForgeKind::Gitea => gitea(forge, spec).await?,
    };
    Ok(Some(pull))
}

async fn github(forge: &Forge, spec: &PullRequestSpec<'_>) -> Result<PullRequest, String> {
    let api = Api::new(forge)?;
    let (owner, repo) = owner_and_repo(spec.repository).ok_or_else(|| {
        format!(
            "{}: the repository URL does not name an owner and a repository ({})",
            forge.host, spec.repository
        )
    })?;
    let base = match spec.base {
        Some(base) => base.to_string(),
        None => {
            let found: Repository = api
                .call("GET", &format!("/repos/{owner}/{repo}"), None)
                .await?;
            found.default_branch
        }
    };
    let body = cut(spec.body, MAX_BODY_CHARS);
    let query = format!(
        "/repos/{owner}/{repo}/pulls?state=open&head={owner}:{}&base={}",
        spec.branch, base
    );
    let open: Vec<Pull> = api.call("GET", &query, None).await?;
    let pull = match open.into_iter().next() {
        Some(existing) => {
            let update = json!({"title": spec.title, "body": body});
            let path = format!("/repos/{owner}/{repo}/pulls/{}", existing.number);
            let updated: Pull = api.call("PATCH", &path, Some(update)).await?;
            // REST cannot change a pull request's draft state; GraphQL can.
            if existing.draft.is_some_and(|draft| draft != spec.draft) {
                if let Err(error) = api.set_draft(&existing.node_id, spec.draft).await {
                    warn!(%error, "cannot change the pull request's draft state");
                }
            }
            PullRequest {
                url: updated.html_url,
                action: "updated",
            }
        }
        None => {
            let create = json!({"title": spec.title, "head": spec.branch, "base": base,
                "body": body, "draft": spec.draft});
            let path = format!("/repos/{owner}/{repo}/pulls");
            let created: Pull = api.call("POST", &path, Some(create)).await?;
            PullRequest {
                url: created.html_url,
                action: "opened",
            }
        }
    };
    let status = json!({
        "state": if spec.draft { "failure" } else { "success" },
        "description": cut(spec.status, 140),
        "context": "forgepool",
    });
    let path = format!("/repos/{owner}/{repo}/statuses/{}", spec.commit);
    api.set_status(&path, status, spec).await;
    Ok(pull)
}

#[derive(Deserialize)]
struct MergeRequest {
    iid: u64,
    web_url: String,
}

#[derive(Deserialize)]
struct Project {
    default_branch: Option<String>,
}

/// GitLab (REST v4): the merge request from the branch, and a commit status.
async fn gitlab(forge: &Forge, spec: &PullRequestSpec<'_>) -> Result<PullRequest, String> {
    let api = Api::new(forge)?;
    let project = project_path(spec.repository).ok_or_else(|| {
        format!(
            "{}: the repository URL does not name a project ({})",
            forge.host, spec.repository
        )
    })?;
    let id = encode(&project);
    let base = match spec.base {
        Some(base) => base.to_string(),
        None => {
            let found: Project = api.call("GET", &format!("/projects/{id}"), None).await?;
            found.default_branch.ok_or_else(|| {
                format!(
                    "{}: the project {project} has no default branch",
                    forge.host
                )
            })?
        }
    };
    let title = marked(&spec.title, spec.draft, "Draft: ");
    let description = cut(spec.body, MAX_BODY_CHARS);
    let query = format!(
        "/projects/{id}/merge_requests?state=opened&source_branch={}&target_branch={}",
        encode(spec.branch),
        encode(&base)
    );
    let open: Vec<MergeRequest> = api.call("GET", &query, None).await?;
    let pull = match open.into_iter().next() {
        Some(existing) => {
            let path = format!("/projects/{id}/merge_requests/{}", existing.iid);
            let update = json!({"title": title, "description": description});
            let updated: MergeRequest = api.call("PUT", &path, Some(update)).await?;
            PullRequest {
                url: updated.web_url,
                action: "updated",
            }
        }
        None => {
            let create = json!({"source_branch": spec.branch, "target_branch": base,
                "title": title, "description": description});
            let path = format!("/projects/{id}/merge_requests");
            let created: MergeRequest = api.call("POST", &path, Some(create)).await?;
            PullRequest {
                url: created.web_url,
                action: "opened",
            }
        }
    };
    let status = json!({
        "state": if spec.draft { "failed" } else { "success" },
        "description": cut(spec.status, 140),
        "name": "forgepool",
    });
    let path = format!("/projects/{id}/statuses/{}", spec.commit);
    api.set_status(&path, status, spec).await;
    Ok(pull)
}

#[derive(Deserialize)]
struct GiteaPull {
    number: u64,
    html_url: String,
    head: GiteaRef,
    base: GiteaRef,
}

#[derive(Deserialize)]
struct GiteaRef {
    #[serde(rename = "ref")]
    name: String,
}

/// The most open pull requests of a Gitea repository looked through for the branch's.
const GITEA_PAGE: u32 = 50;

/// Gitea and Forgejo (REST v1): the pull request from the branch, and a commit status.
async fn gitea(forge: &Forge, spec: &PullRequestSpec<'_>) -> Result<PullRequest, String> {
    let api = Api::new(forge)?;
    let (owner, repo) = owner_and_repo(spec.repository).ok_or_else(|| {
        format!(
            "{}: the repository URL does not name an owner and a repository ({})",
            forge.host, spec.repository
        )
    })?;
    let base = match spec.base {
        Some(base) => base.to_string(),
        None => {
            let found: Repository = api
                .call("GET", &format!("/repos/{owner}/{repo}"), None)
                .await?;
            found.default_branch
        }
    };
    let title = marked(&spec.title, spec.draft, "WIP: ");
    let body = cut(spec.body, MAX_BODY_CHARS);
    let query = format!("/repos/{owner}/{repo}/pulls?state=open&limit={GITEA_PAGE}");
    let open: Vec<GiteaPull> = api.call("GET", &query, None).await?;
    let existing = open
        .into_iter()
        .find(|p| p.head.name == spec.branch && p.base.name == base);
    let pull = match existing {
        Some(existing) => {
            let path = format!("/repos/{owner}/{repo}/pulls/{}", existing.number);
            let update = json!({"title": title, "body": body});
            let updated: GiteaPull = api.call("PATCH", &path, Some(update)).await?;
            PullRequest {
                url: updated.html_url,
                action: "updated",
            }
        }
        None => {
            let create = json!({"head": spec.branch, "base": base, "title": title, "body": body});
            let path = format!("/repos/{owner}/{repo}/pulls");
            let created: GiteaPull = api.call("POST", &path, Some(create)).await?;
            PullRequest {
                url: created.html_url,
                action: "opened",
            }
        }
    };
    let status = json!({
        "state": if spec.draft { "failure" } else { "success" },
        "description": cut(spec.status, 140),
        "context": "forgepool",
    });
    let path = format!("/repos/{owner}/{repo}/statuses/{}", spec.commit);
    api.set_status(&path, status, spec).await;
    Ok(pull)
}

/// `title`, with `mark` in front for a draft (how GitLab and Gitea mark one).
fn marked(title: &str, draft: bool, mark: &str) -> String {
    if draft {
        format!("{mark}{title}")
    } else {
        title.to_string()
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters (a GitLab project path as
/// its id, a branch name in a query).
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The forge's API with the token of its forges file entry.
struct Api<'a> {
    forge: &'a Forge,
    token: String,
    client: reqwest::Client,
}

impl<'a> Api<'a> {
    fn new(forge: &'a Forge) -> Result<Api<'a>, String> {
        let variable = forge.token_env.as_deref().ok_or_else(|| {
            format!(
                "{}: the forges file entry has no token_env, which pull requests need",
                forge.host
            )
        })?;
        let token = std::env::var(variable).map_err(|_| {
            format!(
                "{}: {variable} is not set in the worker's environment",
                forge.host
            )
        })?;
        let mut client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("forgepool/", env!("CARGO_PKG_VERSION")));
        if let Some(ca) = &forge.ca_file {
            let pem = std::fs::read(ca).map_err(|e| format!("{}: ca_file: {e}", forge.host))?;
            let certificate = reqwest::Certificate::from_pem(&pem)
                .map_err(|e| format!("{}: ca_file is not a PEM certificate: {e}", forge.host))?;
            client = client.add_root_certificate(certificate);
        }
        let client = client
            .build()
            .map_err(|e| format!("{}: cannot build the API client: {e}", forge.host))?;
        Ok(Api {
            forge,
            token,
            client,
        })
    }

    /// Sets a commit status (with the link to the run); a refusal is logged, not an error (the pull request stands).
    async fn set_status(
        &self,
        path: &str,
        mut status: serde_json::Value,
        spec: &PullRequestSpec<'_>,
    ) {
        if let Some(link) = &spec.link {
            status["target_url"] = link.as_str().into();
        }
        if let Err(error) = self
            .call::<serde_json::Value>("POST", path, Some(status))
            .await
        {
            warn!(%error, "cannot set the commit's status");
        }
    }

    /// Turns a GitHub pull request (its GraphQL node id) into a draft, or marks it ready.
    async fn set_draft(&self, node_id: &str, draft: bool) -> Result<(), String> {
        let mutation = if draft {
            "convertPullRequestToDraft"
        } else {
            "markPullRequestReadyForReview"
        };
        let query = format!(
            "mutation($id: ID!) {{ {mutation}(input: {{pullRequestId: $id}}) {{ pullRequest {{ isDraft }} }} }}"
        );
        let body = json!({"query": query, "variables": {"id": node_id}});
        let answer: serde_json::Value =
            self.call("POST", &self.forge.graphql(), Some(body)).await?;
        match answer.get("errors") {
            Some(errors) => Err(format!(
                "{} GraphQL {mutation}: {}",
                self.forge.host,
                errors.to_string().chars().take(300).collect::<String>()
            )),
            None => Ok(()),
        }
    }

    /// One API call, tried again after a rate limit (its `Retry-After`) or a server error.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<T, String> {
        // A path of the REST API, or a whole address (GraphQL's).
        let url = if path.starts_with("http://") || path.starts_with("https://") {
            path.to_string()
        } else {
            format!("{}{path}", self.forge.api_url.trim_end_matches('/'))
        };
        let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        let what = format!("{} {method} {path}", self.forge.host);
        let mut wait = Duration::from_secs(1);
        for attempt in 1..=ATTEMPTS {
            let request = self.client.request(method.clone(), &url);
            let mut request = match self.forge.kind {
                ForgeKind::Github => request
                    .bearer_auth(&self.token)
                    .header(reqwest::header::ACCEPT, "application/vnd.github+json")
                    .header("X-GitHub-Api-Version", "2022-11-28"),
                // A personal, project or group access token, as an OAuth bearer.
                ForgeKind::Gitlab => request.bearer_auth(&self.token),
                ForgeKind::Gitea => request
                    .header(
                        reqwest::header::AUTHORIZATION,
                        format!("token {}", self.token),
                    )
                    .header(reqwest::header::ACCEPT, "application/json"),
            };
            if let Some(body) = &body {
                request = request.json(body);
            }
            let response = match request.send().await {
                Ok(response) => response,
                Err(error) if attempt < ATTEMPTS => {
                    warn!(%what, error = %error.without_url(), "the forge did not answer; trying again");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    continue;
                }
                Err(error) => return Err(format!("{what}: {}", error.without_url())),
            };
            let status = response.status();
            if status.is_success() {
                return response.json::<T>().await.map_err(|e| {
                    format!(
                        "{what}: an answer forgepool cannot read: {}",
                        e.without_url()
                    )
                });
            }
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(|s| Duration::from_secs(s).min(MAX_RETRY_AFTER));
            let limited =
                status.as_u16() == 429 || (status.as_u16() == 403 && retry_after.is_some());
            let text: String = response
                .text()
                .await
                .unwrap_or_default()
                .chars()
                .take(300)
                .collect();
            if (limited || status.is_server_error()) && attempt < ATTEMPTS {
                warn!(%what, %status, "the forge asks to wait; trying again");
                tokio::time::sleep(retry_after.unwrap_or(wait)).await;
                wait *= 2;
                continue;
            }
            let hint = match status.as_u16() {
                401 => " (the token in the forges file's token_env is not valid)",
                403 => {
                    " (the token lacks a permission: contents and pull requests, read and write)"
                }
                404 => " (no such repository for this token)",
                422 => " (the forge refused the request's content)",
                _ => "",
            };
            return Err(format!("{what} answered {status}{hint}: {}", text.trim()));
        }
        Err(format!("{what}: no answer after {ATTEMPTS} attempts"))
    }
}

/// `owner` and `repo` of `https://host/owner/repo(.git)` or `ssh://…/owner/repo.git`.
fn owner_and_repo(url: &str) -> Option<(String, String)> {
    let path = match url.split_once("://") {
        Some((_, rest)) => rest.split_once('/')?.1,
        None => url.split_once(':')?.1,
    };
    let mut parts = path.trim_matches('/').split('/');
    let (owner, repo) = (parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let repo = repo.strip_suffix(".git").unwrap_or(repo);
    let fine = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    (fine(owner) && fine(repo)).then(|| (owner.to_string(), repo.to_string()))
}

/// The project path of `https://host/group/sub/project(.git)` or `git@host:group/project.git`
/// (GitLab's groups nest).
fn project_path(url: &str) -> Option<String> {
    let path = match url.split_once("://") {
        Some((_, rest)) => rest.split_once('/')?.1,
        None => url.split_once(':')?.1,
    };
    let path = path.trim_matches('/');
    let path = path.strip_suffix(".git").unwrap_or(path);
    let segments: Vec<&str> = path.split('/').collect();
    let fine = |s: &&str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    (segments.len() >= 2 && segments.iter().all(fine)).then(|| segments.join("/"))
}

/// `text` cut to `limit` characters, saying so.
fn cut(text: &str, limit: usize) -> String {
    if text.chars().count() <= limit {
        return text.to_string();
    }
    let kept: String = text.chars().take(limit.saturating_sub(40)).collect();
    format!("{kept}\n\n… (cut; the whole report is in the run)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a pull request opened against a wrong repository parsed from the URL.
    #[test]
    fn owner_and_repo_come_from_the_url() {
        assert_eq!(
            owner_and_repo("https://github.com/acme/shop.git"),
            Some(("acme".into(), "shop".into()))
        );
        assert_eq!(
            owner_and_repo("git@github.com:acme/shop.git"),
            Some(("acme".into(), "shop".into()))
        );
        assert_eq!(owner_and_repo("https://github.com/acme"), None);
        assert_eq!(owner_and_repo("https://gitlab.com/group/sub/shop"), None);
        assert_eq!(owner_and_repo("https://github.com/ac me/shop"), None);
    }

    /// Catches: a GitLab merge request asked of a wrong project (nested groups cut, a path
    /// sent unencoded as the project id, a `..` segment let through).
    #[test]
    fn gitlab_project_paths_keep_their_groups_and_are_encoded_as_ids() {
        assert_eq!(
            project_path("https://gitlab.com/group/sub/shop.git").as_deref(),
            Some("group/sub/shop")
        );
        assert_eq!(
            project_path("git@gitlab.com:group/shop.git").as_deref(),
            Some("group/shop")
        );
        assert_eq!(project_path("https://gitlab.com/shop"), None);
        assert_eq!(project_path("https://gitlab.com/group/../shop"), None);
        assert_eq!(encode("group/sub/shop"), "group%2Fsub%2Fshop");
        assert_eq!(encode("forge/pr-1"), "forge%2Fpr-1");
    }

    /// Catches: a draft GitLab or Gitea pull request that is not marked as one.
    #[test]
    fn drafts_are_marked_in_the_title() {
        assert_eq!(marked("T-1: x", true, "Draft: "), "Draft: T-1: x");
        assert_eq!(marked("T-1: x", false, "WIP: "), "T-1: x");
    }
}
