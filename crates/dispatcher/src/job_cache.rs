//! The frozen jobs of the runs whose events are arriving, kept so that storing an event does
//! not read its run from the store: a job never changes once frozen (a resumed run keeps its
//! own), so a cached one is never stale. Bounded: past [`CAPACITY`] runs the oldest entry
//! goes first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use proto::Job;
use uuid::Uuid;

/// The most jobs kept (a few KB each: a fleet's running runs several times over).
pub const CAPACITY: usize = 4096;

/// The cache.
#[derive(Debug, Default)]
pub struct JobCache {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    jobs: HashMap<Uuid, Arc<Job>>,
    order: VecDeque<Uuid>,
}

impl JobCache {
    /// The job of `run_id`, when kept.
    pub fn get(&self, run_id: Uuid) -> Option<Arc<Job>> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.jobs.get(&run_id).cloned()
    }

    /// Keeps `job`, letting the oldest go when full.
    pub fn put(&self, job: Arc<Job>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.jobs.insert(job.run_id, Arc::clone(&job)).is_some() {
            return;
        }
        inner.order.push_back(job.run_id);
        while inner.order.len() > CAPACITY {
            if let Some(old) = inner.order.pop_front() {
                inner.jobs.remove(&old);
            }
        }
    }

    /// How many jobs are kept.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .jobs
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(run_id: Uuid) -> Arc<Job> {
        let mut job: Job = serde_json::from_value(serde_json::json!({
            "schema_version": 1, "run_id": run_id, "ticket": "T-1", "project": "p",
            "skill": "s", "step": "s", "brief": "b",
            "repository": {"url": "https://example.com/r.git", "ref": "main"},
            "commands": [], "skill_md": "", "review": null, "repair_budget": 0,
            "implementer": {"name": "i", "image": "x", "command": ["true"], "env": [],
                            "network": "none", "memory_bytes": 1, "cpus": 1.0,
                            "timeout_seconds": 1, "user": null},
            "reviewer": null, "final_reviewer": null, "warnings": [],
            "submitted_at": "2026-12-07T00:00:00Z"
        }))
        .expect("a job");
        job.run_id = run_id;
        Arc::new(job)
    }

    /// Catches: a cache that grows with every run ever seen, or loses a job it just kept.
    #[test]
    fn the_cache_is_bounded_and_keeps_the_newest() {
        let cache = JobCache::default();
        let ids: Vec<Uuid> = (0..CAPACITY + 10).map(|_| Uuid::new_v4()).collect();
        for id in &ids {
            cache.put(job(*id));
            cache.put(job(*id));
        }
        assert_eq!(cache.len(), CAPACITY);
        assert!(cache.get(ids[0]).is_none(), "the oldest went first");
        let last = *ids.last().unwrap();
        assert_eq!(cache.get(last).map(|j| j.run_id), Some(last));
    }
}
