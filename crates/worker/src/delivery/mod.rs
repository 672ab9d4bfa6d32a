//! The delivery wing: what leaves the worker for the repository's forge. The forges file and
//! its credentials ([`forges`]), pull requests and commit statuses ([`pulls`]), and the run's
//! Markdown report, the pull request's body ([`report`]). The push itself is [`crate::workspace::git`]'s.

pub mod forges;
pub mod pulls;
pub mod report;
