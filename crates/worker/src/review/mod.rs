//! The review wing: reading what reviewers leave, strictly. Review cycle files in `.forge/`
//! ([`collector`]), a reviewer's verdict on its stdout ([`verdict`]), and the independent
//! final reviewer's `review.json` ([`final_report`]). The engine's stages that run reviewers
//! are in [`crate::engine`].

pub mod collector;
pub mod final_report;
pub mod verdict;
