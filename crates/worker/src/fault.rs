//! Fault points: the places where a test build of the worker can die as if it were killed
//! with SIGKILL, one phase boundary at a time (SPEC 11's crash windows).
//!
//! They exist only with the `fault-points` feature, which `scripts/test.sh` enables for the
//! test build; every other build compiles [`point`] to nothing. With the feature, the worker
//! kills itself at the point named by `FORGEPOOL_FAULT_POINT` (`NAME`, or `NAME#N` for its
//! N-th pass in this process): no destructor runs, no message is settled, containers are left
//! running, exactly as a SIGKILL leaves them.
//!
//! The points, in a run's order:
//! - `started`: the execution said `running` and prepared its workspace; no stage ran;
//! - `progress-kept`: the progress after a completed stage was confirmed by the broker;
//! - `before-push`: the branch was read and the delivery commit made; nothing pushed;
//! - `pushed`: the branch was pushed; no final event published;
//! - `ended`: the final events were confirmed; no done marker declared;
//! - `marked-done`: the done marker was declared; the job not acknowledged.
//!
//! And at each step of a job's move to another queue (parked, waiting for a profile's cap,
//! handed over on a drain):
//! - `moving`: the fresh copy is about to be published;
//! - `moved`: the copy was confirmed by the broker; the delivery is not acknowledged.

/// The environment variable that names the fault point to die at.
pub const FAULT_POINT_ENV: &str = "FORGEPOOL_FAULT_POINT";

/// Dies here when this is the point (and pass) `FORGEPOOL_FAULT_POINT` names.
#[cfg(feature = "fault-points")]
pub fn point(name: &str) {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static PASSES: Mutex<Option<HashMap<String, u32>>> = Mutex::new(None);

    let Ok(wanted) = std::env::var(FAULT_POINT_ENV) else {
        return;
    };
    let (wanted, pass) = match wanted.split_once('#') {
        Some((wanted, pass)) => (wanted.to_string(), pass.parse().unwrap_or(1)),
        None => (wanted, 1),
    };
    if wanted != name {
        return;
    }
    let mut passes = PASSES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let seen = passes
        .get_or_insert_with(HashMap::new)
        .entry(name.to_string())
        .or_insert(0);
    *seen += 1;
    if *seen == pass {
        eprintln!("fault point `{name}` (pass {pass}): the worker kills itself");
        let me = rustix::process::getpid();
        let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
        // SIGKILL cannot be caught; nothing after this runs.
        std::process::abort();
    }
}

/// Fault points compile to nothing without the `fault-points` feature.
#[cfg(not(feature = "fault-points"))]
#[inline(always)]
pub fn point(_name: &str) {}
