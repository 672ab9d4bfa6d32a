//! How a run is steered from outside: a user's cancel, a lost claim, a drain.

use tokio_util::sync::CancellationToken;

/// How a run is steered from outside.
#[derive(Debug, Clone, Default)]
pub struct RunControl {
    /// A user's cancel: the run ends `cancelled`.
    pub cancel: CancellationToken,
    /// A drain or a lost claim: the run stops and is handed back without an ending.
    pub interrupt: CancellationToken,
    /// The job was delivered again: an earlier execution may have pushed, so the delivery
    /// branch is read before anything runs.
    pub again: bool,
    /// A drain: the run is handed back at its next stage boundary (with its progress kept),
    /// never in the middle of a stage; a run with only its delivery left is delivered.
    pub handover: CancellationToken,
}

impl RunControl {
    /// A run stopped by `cancel` and `interrupt`, executed for the first time.
    pub fn new(cancel: CancellationToken, interrupt: CancellationToken) -> RunControl {
        RunControl {
            cancel,
            interrupt,
            again: false,
            handover: CancellationToken::new(),
        }
    }
}
