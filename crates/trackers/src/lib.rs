//! Trackers (SPEC 17): tickets taken from GitHub and GitLab issues and Jira, progress
//! written back as one comment per run. This crate knows the trackers; the dispatcher's
//! `trackers` module decides what to do with what they say (claims, runs, the live comment).
//!
//! - `config.rs`: the trackers file, validated whole, secrets read from the environment.
//! - `signature.rs`: each kind's webhook signature, checked over the raw body in constant time.
//! - `text.rs`: ticket text made safe to become a brief (nothing hidden, bounded).
//! - `client.rs`: the bounded HTTP client every tracker call goes through (timeouts, answer
//!   size, rate limits honoured, the token never in an error).
//! - `github.rs`: GitHub's events and REST calls; `gitlab.rs`: GitLab's; `jira.rs`: Jira
//!   Cloud's, with `adf.rs` turning its rich text into Markdown and forgepool's comment
//!   into rich text.
//!
//! Every kind implements [`Tracker`]; [`AnyTracker`] holds one of each kind built.

pub mod adf;
pub mod client;
pub mod config;
pub mod github;
pub mod gitlab;
pub mod jira;
pub mod signature;
pub mod text;

use std::future::Future;

pub use client::TrackerError;
pub use config::{Kind, Secret, TrackerConfig};

/// The most bytes of a webhook body the route reads.
pub const MAX_EVENT_BYTES: usize = 1 << 20;
/// The most bytes of a brief made from a ticket (title, body and comments).
pub const MAX_BRIEF_BYTES: usize = 60_000;

/// The headers of a delivery the trackers read, lower-cased names.
pub type Headers = Vec<(String, String)>;

/// The value of header `name` (lower-case) in `headers`.
pub fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.as_str())
}

/// A delivery id from header `name`: at most 100 characters, `None` when missing or blank (a
/// blank id would make every later blank one a repeat).
pub fn delivery_id(headers: &Headers, name: &str) -> Option<String> {
    header(headers, name)
        .map(str::trim)
        .filter(|id| !id.is_empty())
        .map(|id| id.chars().take(100).collect())
}

/// An issue (or pull request) of a tracker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssueRef {
    /// GitHub: `owner/name`.
    pub repository: String,
    /// The issue's number.
    pub number: u64,
}

impl IssueRef {
    /// `owner/name#number`, as claims and logs name it.
    pub fn key(&self) -> String {
        format!("{}#{}", self.repository, self.number)
    }
}

/// Who made an event happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// Their login.
    pub login: String,
    /// Whether the tracker says it is a bot or an app (never asked again: always ignored).
    pub bot: bool,
}

/// A comment that mentioned the handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mention {
    /// The comment's id.
    pub id: u64,
    /// Its text, as written (cleaned before it is used).
    pub body: String,
    /// What kind of comment (for its reaction's address).
    pub place: CommentPlace,
    /// For a comment on a line of a change: the file, the line and the hunk, as Markdown.
    pub context: Option<String>,
}

/// Where a comment was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommentPlace {
    /// On an issue (or a pull request's conversation).
    Issue,
    /// On a line of a pull request's change.
    ReviewLine,
    /// A review's body.
    Review,
}

/// What an event asks, once parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// The label was added to an open issue: start a run.
    Start,
    /// A comment mentioned the handle: start a run, or follow up on one.
    Mention(Mention),
    /// `@forgepool stop`, the issue closed or the label removed: cancel the running run.
    Stop(String),
}

/// An event that may concern forgepool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Happening {
    /// The issue it is about.
    pub issue: IssueRef,
    /// Whether the issue is a pull request.
    pub pull_request: bool,
    /// Who did it.
    pub actor: Actor,
    /// What it asks.
    pub ask: Ask,
    /// The repository's clone URL (GitHub `repository.clone_url`).
    pub clone_url: String,
    /// The repository's default branch.
    pub default_branch: String,
    /// For an event on a pull request: its head branch, when the event names it.
    pub head_ref: Option<String>,
}

/// What a delivery turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// Something to act on.
    Happening(Box<Happening>),
    /// Nothing for forgepool: why (an unwatched event, another label, no mention).
    Ignored(String),
}

/// An issue as the tracker's API tells it: what the brief is made of.
#[derive(Debug, Clone, Default)]
pub struct Issue {
    /// Its title.
    pub title: String,
    /// Its body.
    pub body: String,
    /// Its address for people.
    pub html_url: String,
    /// Whether it is open.
    pub open: bool,
}

/// A comment on an issue, as listed.
#[derive(Debug, Clone)]
pub struct Comment {
    /// Its id.
    pub id: u64,
    /// Who wrote it.
    pub author: Actor,
    /// Its text.
    pub body: String,
}

/// A tracker: one file of this crate per kind.
pub trait Tracker: Send + Sync {
    /// The entry this tracker was made from.
    fn config(&self) -> &TrackerConfig;
    /// Checks a delivery's signature over its raw body, before anything is parsed.
    fn verify(&self, headers: &Headers, body: &[u8]) -> Result<(), String>;
    /// The delivery's id, for de-duplication.
    fn delivery_id(&self, headers: &Headers) -> Option<String>;
    /// What a verified delivery asks.
    fn parse(&self, headers: &Headers, body: &[u8]) -> Result<Parsed, String>;
    /// Whether `login` may start runs on `issue`'s repository, as the tracker's API says now.
    fn permitted(
        &self,
        issue: &IssueRef,
        login: &str,
    ) -> impl Future<Output = Result<bool, TrackerError>> + Send;
    /// The login of the account the token belongs to.
    fn own_login(&self) -> impl Future<Output = Result<String, TrackerError>> + Send;
    /// The issue's title, body and state.
    fn issue(&self, issue: &IssueRef) -> impl Future<Output = Result<Issue, TrackerError>> + Send;
    /// The issue's comments, oldest first (at most the first 100).
    fn comments(
        &self,
        issue: &IssueRef,
    ) -> impl Future<Output = Result<Vec<Comment>, TrackerError>> + Send;
    /// Writes a comment on the issue; its id.
    fn comment(
        &self,
        issue: &IssueRef,
        body: &str,
    ) -> impl Future<Output = Result<u64, TrackerError>> + Send;
    /// Replaces a comment's text.
    fn edit_comment(
        &self,
        issue: &IssueRef,
        id: u64,
        body: &str,
    ) -> impl Future<Output = Result<(), TrackerError>> + Send;
    /// The open issues of `repository` carrying the tracker's label (not pull requests), at
    /// most the first 100, each as the reconciling poll's happening: the person who last
    /// added the label, the repository's clone URL and default branch.
    fn labelled(
        &self,
        repository: &str,
    ) -> impl Future<Output = Result<Vec<Happening>, TrackerError>> + Send;
    /// A pull request's head branch.
    fn pull_head(
        &self,
        issue: &IssueRef,
    ) -> impl Future<Output = Result<String, TrackerError>> + Send;
    /// Whether [`Tracker::react`] does anything (Jira's comments take no reactions).
    fn reacts(&self) -> bool {
        true
    }
    /// Marks a comment as seen (GitHub: 👀).
    fn react(
        &self,
        issue: &IssueRef,
        mention: &Mention,
    ) -> impl Future<Output = Result<(), TrackerError>> + Send;
}

/// One tracker of any kind.
#[derive(Debug)]
pub enum AnyTracker {
    /// A GitHub tracker.
    Github(github::Github),
    /// A GitLab tracker.
    Gitlab(gitlab::Gitlab),
    /// A Jira tracker.
    Jira(jira::Jira),
}

/// Calls the same method on whichever kind the tracker is.
macro_rules! each {
    ($self:ident, $t:ident => $call:expr) => {
        match $self {
            AnyTracker::Github($t) => $call,
            AnyTracker::Gitlab($t) => $call,
            AnyTracker::Jira($t) => $call,
        }
    };
}

impl AnyTracker {
    /// The tracker of an entry.
    pub fn new(config: TrackerConfig) -> Result<AnyTracker, String> {
        Ok(match config.kind {
            Kind::Github => AnyTracker::Github(github::Github::new(config)?),
            Kind::Gitlab => AnyTracker::Gitlab(gitlab::Gitlab::new(config)?),
            Kind::Jira => AnyTracker::Jira(jira::Jira::new(config)?),
        })
    }

    /// The tracker itself.
    pub fn get(&self) -> &AnyTracker {
        self
    }

    /// What is wrong with the tracker's token and repositories, each naming the entry and
    /// the setting (`forgepool trackers check`).
    pub async fn check(&self) -> Vec<String> {
        each!(self, t => t.check().await)
    }

    /// Tells `observer` the status of each of its API's answers.
    pub fn observe(&self, observer: client::Observer) {
        each!(self, t => t.client().observe(observer))
    }
}

impl Tracker for AnyTracker {
    fn config(&self) -> &TrackerConfig {
        each!(self, t => t.config())
    }
    fn verify(&self, headers: &Headers, body: &[u8]) -> Result<(), String> {
        each!(self, t => t.verify(headers, body))
    }
    fn delivery_id(&self, headers: &Headers) -> Option<String> {
        each!(self, t => t.delivery_id(headers))
    }
    fn parse(&self, headers: &Headers, body: &[u8]) -> Result<Parsed, String> {
        each!(self, t => t.parse(headers, body))
    }
    async fn permitted(&self, issue: &IssueRef, login: &str) -> Result<bool, TrackerError> {
        each!(self, t => t.permitted(issue, login).await)
    }
    async fn own_login(&self) -> Result<String, TrackerError> {
        each!(self, t => t.own_login().await)
    }
    async fn issue(&self, issue: &IssueRef) -> Result<Issue, TrackerError> {
        each!(self, t => t.issue(issue).await)
    }
    async fn comments(&self, issue: &IssueRef) -> Result<Vec<Comment>, TrackerError> {
        each!(self, t => t.comments(issue).await)
    }
    async fn comment(&self, issue: &IssueRef, body: &str) -> Result<u64, TrackerError> {
        each!(self, t => t.comment(issue, body).await)
    }
    async fn edit_comment(
        &self,
        issue: &IssueRef,
        id: u64,
        body: &str,
    ) -> Result<(), TrackerError> {
        each!(self, t => t.edit_comment(issue, id, body).await)
    }
    async fn labelled(&self, repository: &str) -> Result<Vec<Happening>, TrackerError> {
        each!(self, t => t.labelled(repository).await)
    }
    async fn pull_head(&self, issue: &IssueRef) -> Result<String, TrackerError> {
        each!(self, t => t.pull_head(issue).await)
    }
    fn reacts(&self) -> bool {
        each!(self, t => t.reacts())
    }
    async fn react(&self, issue: &IssueRef, mention: &Mention) -> Result<(), TrackerError> {
        each!(self, t => t.react(issue, mention).await)
    }
}

/// The ticket key of a GitHub or GitLab issue: `{PREFIX}-{number}`, the prefix the
/// repository's name in upper case with other characters as `_`, or the entry's own; a
/// Jira issue's own key (`SHOP-12`).
pub fn ticket_key(config: &TrackerConfig, issue: &IssueRef) -> String {
    if config.kind == Kind::Jira {
        return format!("{}-{}", issue.repository, issue.number);
    }
    let prefix = config.ticket_prefix.clone().unwrap_or_else(|| {
        issue
            .repository
            .rsplit('/')
            .next()
            .unwrap_or("ISSUE")
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_uppercase()
                } else {
                    '_'
                }
            })
            .collect()
    });
    format!("{prefix}-{}", issue.number)
}

/// Whether `text` mentions `handle` as a word (`@forgepool`, not `@forgepools` or
/// `me@forgepool.example`).
pub fn mentions(text: &str, handle: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    let handle = handle.to_ascii_lowercase();
    lower.match_indices(&handle).any(|(at, _)| {
        let before = lower[..at].chars().next_back();
        let after = lower[at + handle.len()..].chars().next();
        before.is_none_or(|c| !c.is_alphanumeric() && c != '@' && c != '.' && c != '_')
            && after.is_none_or(|c| !c.is_alphanumeric() && c != '-' && c != '_')
    })
}

/// Whether `text` is a stop order: the handle followed by `stop`.
pub fn is_stop(text: &str, handle: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    let order = format!("{} stop", handle.to_ascii_lowercase());
    lower.lines().any(|line| {
        line.trim()
            .strip_prefix(&order)
            .is_some_and(|rest| rest.trim().is_empty() || rest.starts_with(char::is_whitespace))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a mention taken from an email address or a longer handle; a stop missed.
    #[test]
    fn mentions_are_words() {
        assert!(mentions("hey @forgepool please fix", "@forgepool"));
        assert!(mentions("@ForgePool, fix", "@forgepool"));
        assert!(!mentions("@forgepools fix", "@forgepool"));
        assert!(!mentions("mail me@forgepool.example", "@forgepool"));
        assert!(!mentions("no one", "@forgepool"));
        assert!(is_stop("@forgepool stop", "@forgepool"));
        assert!(is_stop("thanks\n  @forgepool stop  now", "@forgepool"));
        assert!(!is_stop("@forgepool stopwatch is broken", "@forgepool"));
    }

    /// Catches: a blank delivery id kept, so that every later delivery without one is taken
    /// for a repeat and dropped.
    #[test]
    fn blank_delivery_ids_are_none() {
        let headers = |v: &str| vec![("x-github-delivery".to_string(), v.to_string())];
        assert_eq!(delivery_id(&headers(""), "x-github-delivery"), None);
        assert_eq!(delivery_id(&headers("  "), "x-github-delivery"), None);
        assert_eq!(delivery_id(&Vec::new(), "x-github-delivery"), None);
        assert_eq!(
            delivery_id(&headers("72d3162e"), "x-github-delivery").as_deref(),
            Some("72d3162e")
        );
    }
}
