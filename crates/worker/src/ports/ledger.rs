//! The final review's ledger: an intent written before the reviewer's container starts, and a
//! receipt written after its report is validated (SPEC 7.3, "recovery without blind repeats").
//!
//! A final review is an expensive call whose outcome matters. An execution that finds an
//! intent without a receipt knows an earlier execution died in the middle of the review: the
//! outcome is unknown, and the review is not repeated automatically. A receipt for the same
//! tree is reused instead of reviewing again. Any other known outcome (refused, paused,
//! cancelled, failed) clears the intent.
//!
//! [`MemoryLedger`] serves the embedded mode (one process, no redelivery); the worker keeps its
//! ledger on the broker (`amqp::AmqpLedger`), where every worker of the cluster sees it.
//!
//! An unknown outcome ends the run `blocked`, not in a state of its own: SPEC 10's states are a
//! contract clients switch on. The reason starts with "unknown outcome" and says what to do; the
//! result's `review` is `unknown`.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

use proto::Checkpoint;

/// A failed ledger operation.
#[derive(Debug, thiserror::Error)]
#[error("final review ledger: {0}")]
pub struct LedgerError(pub String);

/// A validated report, kept with the tree it reviewed.
pub use proto::ReviewReceipt as Receipt;

/// What the ledger holds for a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entry {
    /// The tree of a final review that started and whose outcome was never recorded.
    pub intent: Option<String>,
    /// The last validated report, if any.
    pub receipt: Option<Receipt>,
}

impl Entry {
    /// The tree whose final review has an unknown outcome: an intent that no receipt for the
    /// same tree settled.
    pub fn unknown_outcome(&self) -> Option<&str> {
        let tree = self.intent.as_deref()?;
        match &self.receipt {
            Some(receipt) if receipt.tree == tree => None,
            _ => Some(tree),
        }
    }

    /// The receipt for `tree`, if one was recorded.
    pub fn receipt_for(&self, tree: &str) -> Option<&Receipt> {
        self.receipt.as_ref().filter(|r| r.tree == tree)
    }
}

/// Where intents and receipts are kept.
pub trait ReviewLedger: Send + Sync {
    /// What is recorded for `run_id`.
    fn lookup(&self, run_id: &str) -> impl Future<Output = Result<Entry, LedgerError>> + Send;
    /// Records that the final review of `tree` is about to start. Durable before it returns.
    fn intent(
        &self,
        run_id: &str,
        tree: &str,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send;
    /// Records a validated report, then clears the intent.
    fn receipt(
        &self,
        run_id: &str,
        receipt: &Receipt,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send;
    /// Clears the intent: the review ended with a known outcome and no report to keep.
    fn clear(&self, run_id: &str) -> impl Future<Output = Result<(), LedgerError>> + Send;
    /// The progress an earlier execution of the run kept, if any.
    fn progress(
        &self,
        run_id: &str,
    ) -> impl Future<Output = Result<Option<Checkpoint>, LedgerError>> + Send;
    /// Keeps `checkpoint` as the run's progress, replacing the one before.
    fn keep_progress(
        &self,
        run_id: &str,
        checkpoint: &Checkpoint,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send;
    /// Forgets the run's progress: it ended, or paused with a checkpoint of its own.
    fn clear_progress(&self, run_id: &str) -> impl Future<Output = Result<(), LedgerError>> + Send;
    /// Whether another run has not finished: a worker executes it, or it keeps progress (it
    /// may have pushed, and its final events are not in yet).
    fn run_unfinished(
        &self,
        run_id: &str,
    ) -> impl Future<Output = Result<bool, LedgerError>> + Send;
}

/// An in-process ledger.
#[derive(Debug, Default)]
pub struct MemoryLedger {
    entries: Mutex<HashMap<String, Entry>>,
    progress: Mutex<HashMap<String, Checkpoint>>,
}

impl MemoryLedger {
    fn with<T>(
        &self,
        work: impl FnOnce(&mut HashMap<String, Entry>) -> T,
    ) -> Result<T, LedgerError> {
        let mut entries = self
            .entries
            .lock()
            .map_err(|e| LedgerError(e.to_string()))?;
        Ok(work(&mut entries))
    }
}

impl ReviewLedger for MemoryLedger {
    async fn lookup(&self, run_id: &str) -> Result<Entry, LedgerError> {
        self.with(|e| e.get(run_id).cloned().unwrap_or_default())
    }

    async fn intent(&self, run_id: &str, tree: &str) -> Result<(), LedgerError> {
        self.with(|e| e.entry(run_id.to_string()).or_default().intent = Some(tree.to_string()))
    }

    async fn receipt(&self, run_id: &str, receipt: &Receipt) -> Result<(), LedgerError> {
        self.with(|e| {
            *e.entry(run_id.to_string()).or_default() = Entry {
                intent: None,
                receipt: Some(receipt.clone()),
            }
        })
    }

    async fn clear(&self, run_id: &str) -> Result<(), LedgerError> {
        self.with(|e| {
            if let Some(entry) = e.get_mut(run_id) {
                entry.intent = None;
            }
        })
    }

    async fn progress(&self, run_id: &str) -> Result<Option<Checkpoint>, LedgerError> {
        Ok(self.kept()?.get(run_id).cloned())
    }

    async fn keep_progress(
        &self,
        run_id: &str,
        checkpoint: &Checkpoint,
    ) -> Result<(), LedgerError> {
        self.kept()?.insert(run_id.to_string(), checkpoint.clone());
        Ok(())
    }

    async fn clear_progress(&self, run_id: &str) -> Result<(), LedgerError> {
        self.kept()?.remove(run_id);
        Ok(())
    }

    async fn run_unfinished(&self, run_id: &str) -> Result<bool, LedgerError> {
        Ok(self.kept()?.contains_key(run_id))
    }
}

impl MemoryLedger {
    fn kept(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, Checkpoint>>, LedgerError> {
        self.progress.lock().map_err(|e| LedgerError(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_intent_stays_until_a_receipt_or_a_known_outcome() {
        let ledger = MemoryLedger::default();
        assert_eq!(ledger.lookup("r").await.unwrap(), Entry::default());
        ledger.intent("r", "t").await.unwrap();
        assert_eq!(
            ledger.lookup("r").await.unwrap().unknown_outcome(),
            Some("t")
        );
        let receipt = Receipt {
            schema_version: proto::SCHEMA_VERSION,
            tree: "t".into(),
            report: proto::FinalReport {
                approved: true,
                summary: "ok".into(),
                findings: Vec::new(),
            },
        };
        ledger.receipt("r", &receipt).await.unwrap();
        let entry = ledger.lookup("r").await.unwrap();
        assert_eq!(entry.unknown_outcome(), None);
        assert_eq!(entry.receipt_for("t"), Some(&receipt));
        assert_eq!(entry.receipt_for("other"), None);
        ledger.intent("r", "t2").await.unwrap();
        assert_eq!(
            ledger.lookup("r").await.unwrap().unknown_outcome(),
            Some("t2"),
            "a receipt for another tree does not settle a new intent"
        );
        ledger.clear("r").await.unwrap();
        assert_eq!(ledger.lookup("r").await.unwrap().unknown_outcome(), None);
    }
}
