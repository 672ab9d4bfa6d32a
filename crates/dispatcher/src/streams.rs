//! The event streams open on each run, capped.
//!
//! At most `MAX_STREAMS_PER_RUN` (16) per run; the next is refused with a 429.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

/// How many event streams are open on each run.
#[derive(Debug, Default)]
pub struct StreamCounts(Mutex<HashMap<Uuid, usize>>);

/// One open event stream of a run; it frees its place when it is dropped.
#[derive(Debug)]
pub struct StreamSlot {
    counts: Arc<StreamCounts>,
    run_id: Uuid,
}

impl StreamSlot {
    /// A place for one more stream of `run_id`; `None` when `max` are open already.
    pub fn take(counts: &Arc<StreamCounts>, run_id: Uuid, max: usize) -> Option<StreamSlot> {
        let mut open = counts.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(run_id).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(StreamSlot {
            counts: Arc::clone(counts),
            run_id,
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.run_id) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.run_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_per_run_and_freed_on_drop() {
        let counts = Arc::new(StreamCounts::default());
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        let first = StreamSlot::take(&counts, a, 2).expect("first");
        let second = StreamSlot::take(&counts, a, 2).expect("second");
        assert!(
            StreamSlot::take(&counts, a, 2).is_none(),
            "a third stream of one run"
        );
        assert!(
            StreamSlot::take(&counts, b, 2).is_some(),
            "another run is not limited"
        );
        drop(first);
        let third = StreamSlot::take(&counts, a, 2);
        assert!(third.is_some(), "a dropped stream frees its place");
        drop((second, third));
        assert!(
            counts.0.lock().unwrap().is_empty(),
            "no run is left with a count of 0"
        );
    }
}
