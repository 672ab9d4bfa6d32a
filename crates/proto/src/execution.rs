//! Which execution of a run is live: the store is the truth (SPEC 11, SPEC 15).
//!
//! Every job the dispatcher publishes carries a [`Publication`] inside its signed body: the
//! run's **epoch** (how many times the dispatcher queued the run: a submission is epoch 0,
//! each resume or requeue adds one) and an **expiry**. Before it executes a job, a worker asks
//! the dispatcher whether that epoch is still the run's live one ([`ExecutionQuery`] on the
//! `{prefix}.execution-questions` queue); the dispatcher answers from its store, signed with the job key
//! ([`ExecutionAnswer`]). A finished run is never live again, so a copied job replayed after
//! its done marker expired runs nothing; a job past its expiry is dead-lettered unread.

use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{JobKey, RunState};

/// What one publication of a job adds to the frozen job, under its signature.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Publication {
    /// How many times the dispatcher had queued the run again when it published this copy.
    pub epoch: u32,
    /// After this time (RFC 3339) no worker starts the job.
    pub expires_at: String,
}

impl Publication {
    /// A publication of epoch `epoch` that expires `ttl` from `now`.
    pub fn new(epoch: u32, now: SystemTime, ttl: Duration) -> Publication {
        Publication {
            epoch,
            expires_at: crate::format_timestamp(now + ttl),
        }
    }

    /// Why a job of this publication may not start at `now`: it expired, or its expiry does
    /// not read. `None` while it is valid.
    pub fn expired(&self, now: SystemTime) -> Option<String> {
        match crate::parse_time(&self.expires_at) {
            Some(expiry) if now <= expiry => None,
            Some(_) => Some(format!(
                "the job expired at {} (FORGEPOOL_JOB_TTL): a copy this old is never run; the ticket can be submitted again",
                self.expires_at
            )),
            None => Some(format!(
                "the job's `publication.expires_at` {:?} is not an RFC 3339 time",
                self.expires_at
            )),
        }
    }
}

/// A worker's question: is epoch `epoch` of run `run_id` still the run's live execution?
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutionQuery {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The run.
    pub run_id: Uuid,
    /// The epoch the worker's job carries.
    pub epoch: u32,
    /// Drawn by the worker for this question; the answer repeats it, so an answer to another
    /// question (replayed by whoever can publish to the reply queue) is refused.
    pub nonce: Uuid,
    /// How many times an execution of the run was lost before this copy (its worker died, or
    /// lost the broker, while it held the job): the store keeps the highest count it was told,
    /// and fails the run at [`MAX_LOST_EXECUTIONS`]. Left out when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost: u32,
}

/// How many times a run's execution may be lost before the dispatcher fails the run with that
/// reason: a job that kills every worker it reaches must stop somewhere, and ten deaths in a
/// row are no longer bad luck. It has nothing to do with the broker's delivery limit, a guard
/// against messages no consumer can settle.
pub const MAX_LOST_EXECUTIONS: u32 = 10;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The dispatcher's answer, signed with the job key over [`answer_signed_bytes`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutionAnswer {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The run asked about.
    pub run_id: Uuid,
    /// The epoch asked about.
    pub epoch: u32,
    /// The question's nonce.
    pub nonce: Uuid,
    /// Whether a worker may execute the job.
    pub live: bool,
    /// Why not, when it is not live.
    pub reason: String,
}

impl ExecutionAnswer {
    /// The answer to `query` about a run the store holds in `state` at epoch `current`, or
    /// does not hold (`None`).
    pub fn to(query: &ExecutionQuery, stored: Option<(RunState, u32)>) -> ExecutionAnswer {
        let reason = match stored {
            None => format!("the dispatcher's store has no run {}", query.run_id),
            Some((state, _)) if state.is_terminal() => {
                format!("the run is {state} in the dispatcher's store; a finished run never runs again")
            }
            Some((RunState::Paused, _)) => {
                "the run is paused in the dispatcher's store; only a resume runs it again".into()
            }
            Some((_, current)) if current != query.epoch => format!(
                "the job's epoch {} is not the run's live epoch {current}: the run was queued again since",
                query.epoch
            ),
            Some(_) => String::new(),
        };
        ExecutionAnswer {
            schema_version: crate::SCHEMA_VERSION,
            run_id: query.run_id,
            epoch: query.epoch,
            nonce: query.nonce,
            live: reason.is_empty(),
            reason,
        }
    }

    /// The answer's signature header value.
    pub fn sign(body: &[u8], key: &JobKey) -> String {
        key.sign(&answer_signed_bytes(body))
    }

    /// Reads an answer to `query`, checking its signature and that it answers this very
    /// question.
    pub fn read(
        body: &[u8],
        signature: Option<&str>,
        key: &JobKey,
        query: &ExecutionQuery,
    ) -> Result<ExecutionAnswer, String> {
        key.verify(&answer_signed_bytes(body), signature)
            .map_err(|reason| {
                format!("an execution answer not signed by the dispatcher: {reason}")
            })?;
        let answer: ExecutionAnswer = crate::decode_message(body, 64 * 1024)?;
        if (answer.run_id, answer.epoch, answer.nonce) != (query.run_id, query.epoch, query.nonce) {
            return Err("an execution answer to another question".into());
        }
        Ok(answer)
    }
}

/// What an answer's signature covers: a domain tag, then the body, so that no signed job
/// could pass for an answer nor an answer for a job.
pub fn answer_signed_bytes(body: &[u8]) -> Vec<u8> {
    let mut bytes = b"forgepool-execution-answer\n".to_vec();
    bytes.extend_from_slice(body);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn query(epoch: u32) -> ExecutionQuery {
        ExecutionQuery {
            schema_version: crate::SCHEMA_VERSION,
            run_id: Uuid::new_v4(),
            epoch,
            nonce: Uuid::new_v4(),
            lost: 0,
        }
    }

    /// Catches: a question that an earlier dispatcher (`deny_unknown_fields`) would refuse
    /// when nothing was lost, and a count lost on the way.
    #[test]
    fn a_lost_count_is_sent_only_when_there_is_one() {
        let mut q = query(1);
        let text = serde_json::to_string(&q).unwrap();
        assert!(!text.contains("lost"), "{text}");
        q.lost = 3;
        let again: ExecutionQuery =
            serde_json::from_str(&serde_json::to_string(&q).unwrap()).unwrap();
        assert_eq!(again.lost, 3);
    }

    #[test]
    fn only_an_unfinished_unpaused_run_at_the_same_epoch_is_live() {
        let q = query(1);
        assert!(ExecutionAnswer::to(&q, Some((RunState::Running, 1))).live);
        assert!(ExecutionAnswer::to(&q, Some((RunState::Queued, 1))).live);
        for (stored, says) in [
            (Some((RunState::Delivered, 1)), "delivered"),
            (Some((RunState::Cancelled, 1)), "cancelled"),
            (Some((RunState::Paused, 1)), "paused"),
            (Some((RunState::Running, 2)), "live epoch 2"),
            (None, "has no run"),
        ] {
            let answer = ExecutionAnswer::to(&q, stored);
            assert!(!answer.live, "{stored:?}");
            assert!(answer.reason.contains(says), "{}", answer.reason);
        }
    }

    #[test]
    fn an_answer_reads_only_when_signed_for_this_question() {
        let key = JobKey::new("0123456789abcdef0123").unwrap();
        let q = query(0);
        let body =
            serde_json::to_vec(&ExecutionAnswer::to(&q, Some((RunState::Queued, 0)))).unwrap();
        let signature = ExecutionAnswer::sign(&body, &key);
        assert!(
            ExecutionAnswer::read(&body, Some(&signature), &key, &q)
                .unwrap()
                .live
        );
        // A plain job signature over the same bytes is not an answer's.
        let as_job = key.sign(&body);
        assert!(ExecutionAnswer::read(&body, Some(&as_job), &key, &q).is_err());
        // Another key, another question.
        let other = JobKey::new("another-key-0123456789").unwrap();
        assert!(ExecutionAnswer::read(
            &body,
            Some(&ExecutionAnswer::sign(&body, &other)),
            &key,
            &q
        )
        .is_err());
        let error = ExecutionAnswer::read(&body, Some(&signature), &key, &query(0)).unwrap_err();
        assert!(error.contains("another question"), "{error}");
    }

    #[test]
    fn a_publication_expires() {
        let now = SystemTime::now();
        let publication = Publication::new(0, now, Duration::from_secs(60));
        assert_eq!(publication.expired(now), None);
        let reason = publication.expired(now + Duration::from_secs(61)).unwrap();
        assert!(reason.contains("expired at"), "{reason}");
        let broken = Publication {
            epoch: 0,
            expires_at: "soon".into(),
        };
        assert!(broken.expired(now).unwrap().contains("expires_at"));
    }
}
