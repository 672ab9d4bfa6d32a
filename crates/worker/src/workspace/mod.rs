//! The workspace wing: a run's repository and every copy of it a stage gets. forgepool's own
//! git ([`git`]), the repository cache ([`cache`]) its git folders are linked from, the
//! layered work trees ([`overlay`]), the stages' copies ([`copies`], [`linkcopy`]), and the
//! agent-writable folders read and written without following a link ([`confined`]), and the
//! run folders a killed worker left ([`leftovers`]).

pub mod cache;
pub mod confined;
pub mod copies;
pub mod git;
pub mod leftovers;
pub mod linkcopy;
pub mod overlay;
