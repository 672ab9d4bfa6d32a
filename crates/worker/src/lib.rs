//! The worker: takes jobs, runs their stages in containers, and publishes what happens.
//!
//! In the data flow it sits between the jobs queue and the events stream. The [`engine`] drives
//! the run loop ([`engine::machine`]) through the container runtime seam ([`runtime`],
//! implemented by [`docker`]) with the agent kinds of [`agents`], works on the run's repository
//! and its copies ([`workspace`]), reads what reviewers leave ([`review`]), delivers to the
//! forge ([`delivery`]), and reports through the seams of [`ports`], which the broker wing
//! ([`amqp`]) implements in a pool.

pub mod agents;
pub mod amqp;
pub mod config;
pub mod delivery;
pub mod docker;
pub mod engine;
pub mod fault;
pub mod model_gateway;
pub mod ports;
pub mod review;
pub mod runtime;
pub mod service;
pub mod workspace;

pub use engine::{Engine, EngineConfig, RunControl};
