//! The ports: the seams between the engine and the world that carries its runs. Each is a
//! trait with an in-process implementation for the embedded mode and the engine's tests; the
//! worker's AMQP wing ([`crate::amqp`]) implements them on the broker.
//!
//! - [`gate`]: whether an agent profile's stage may start (caps and pauses across the pool);
//! - [`ledger`]: the final review's intent and receipt;
//! - [`sink`]: where a running engine sends its events;
//! - [`queue`]: where jobs come from.

pub mod gate;
pub mod ledger;
pub mod queue;
pub mod sink;
