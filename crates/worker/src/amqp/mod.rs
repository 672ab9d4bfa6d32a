//! The worker's AMQP wing: everything the worker says to and hears from RabbitMQ. lapin
//! appears in these modules and nowhere else in the worker.
//!
//! - [`consumer`]: the jobs queue, the checks on every job message, one run's life from its
//!   delivery to its settlement;
//! - [`execution`]: whether a job's execution is still live, asked of the dispatcher;
//! - [`lease`]: leases, done markers, presence, and the sweep of dead workers' containers;
//! - [`ledger`]: the final review's intent and receipt;
//! - [`control`]: cancel requests;
//! - [`sink`]: the run's events and heartbeats;
//! - [`roster`]: this process's beacon, which says it is alive and on which host.

pub mod allotment;
pub mod consumer;
pub mod control;
pub mod execution;
pub mod gate;
pub mod lease;
pub mod ledger;
pub mod roster;
pub mod sink;

pub use consumer::{check_job, decode_job, trusted_job, JobFeed, Jobs};
pub use control::Cancels;
pub use gate::{AmqpGate, PauseBook};
pub use lease::{sweep, InFlight, Leases};
pub use ledger::AmqpLedger;
pub use sink::{AmqpSink, ObservedSink};
