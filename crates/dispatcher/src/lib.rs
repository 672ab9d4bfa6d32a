//! The dispatcher: validates and freezes run requests, stores runs and their events.
//!
//! In the data flow it sits between a submitter and the jobs queue: `freeze` turns a
//! [`proto::RunRequest`] into a [`proto::Job`], the [`store`] keeps it and every event a worker
//! publishes about it, and watchers read both back.

pub mod agents;
mod allotments;
pub mod amqp;
pub mod dispatcher;
pub mod follow_up;
pub mod freeze;
pub mod http;
mod job_cache;
pub mod names;
pub mod notifier;
pub mod request;
pub mod resumer;
pub mod retention;
pub mod roster;
pub mod schedule;
pub mod serve;
pub mod service;
pub mod skills;
pub mod store;
pub mod streams;
pub mod trackers;
pub mod webhooks;

use std::path::PathBuf;

pub use agents::AgentBook;
pub use freeze::{Freezer, Frozen};

/// Why a submission was refused. Each variant names the field or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// A field breaks a rule.
    #[error("{field}: {message}")]
    Invalid {
        /// The field, in request notation (`repository.ref`, `commands[0].argv`).
        field: String,
        /// The rule and, where useful, the offending value.
        message: String,
    },
    /// No `SKILL.md` exists for the skill.
    #[error("skill: unknown skill `{skill}`: no SKILL.md in skills/{project}/{skill}/ or skills/default/{skill}/")]
    UnknownSkill {
        /// The requested skill.
        skill: String,
        /// The project key it was looked up for.
        project: String,
    },
    /// A field is over its size limit.
    #[error("{field}: is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// The field (`brief`, `body`).
        field: String,
        /// The limit in bytes.
        limit: usize,
        /// The size found.
        size: usize,
    },
    /// The request text could not be parsed.
    #[error("{field}: {message}")]
    Parse {
        /// The field path where parsing failed, or `body`.
        field: String,
        /// The parser's explanation.
        message: String,
    },
    /// A skills file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

impl SubmitError {
    /// An invalid field with its rule and value.
    pub fn invalid(field: &str, rule: &str, value: &str) -> SubmitError {
        let shown: String = value.chars().take(80).collect();
        SubmitError::Invalid {
            field: field.to_string(),
            message: format!("{rule}; got {shown:?}"),
        }
    }

    /// The field at fault, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            SubmitError::Invalid { field, .. }
            | SubmitError::TooLarge { field, .. }
            | SubmitError::Parse { field, .. } => Some(field),
            SubmitError::UnknownSkill { .. } => Some("skill"),
            SubmitError::Io { .. } => None,
        }
    }

    /// A stable machine-readable code for API errors.
    pub fn code(&self) -> &'static str {
        match self {
            SubmitError::Invalid { .. } => "invalid_field",
            SubmitError::UnknownSkill { .. } => "unknown_skill",
            SubmitError::TooLarge { .. } => "too_large",
            SubmitError::Parse { .. } => "malformed_request",
            SubmitError::Io { .. } => "skills_unreadable",
        }
    }
}
