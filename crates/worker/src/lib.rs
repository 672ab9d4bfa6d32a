//! The worker: takes jobs, runs their stages in containers, and publishes what happens.
//!
//! In the data flow it sits between the jobs queue and the events stream. The [`engine`] drives
//! the run loop ([`machine`]) through the container runtime seam ([`runtime`], implemented by
//! [`docker`]), collects cycle files ([`collector`]), reads verdicts ([`verdict`]), delivers
//! with [`git`], and reports through the event seam ([`sink`]).

pub mod agents;
pub mod amqp;
pub mod cache;
pub mod collector;
pub mod config;
pub mod confined;
pub mod copies;
pub mod docker;
pub mod egress;
pub mod engine;
#[cfg(test)]
pub(crate) mod fake;
pub mod fault;
pub mod final_review;
pub mod forges;
pub mod gate;
pub mod git;
pub mod ledger;
pub mod linkcopy;
pub mod machine;
pub mod overlay;
pub mod pulls;
pub mod queue;
pub mod report;
pub mod runtime;
pub mod service;
pub mod sink;
pub mod verdict;

pub use engine::{Engine, EngineConfig, RunControl};
