//! Benchmark: from a cycle file's rename in the workspace to its `cycle` event.
//!
//! Runs one real run through the engine (real Docker, real git): the implementer renames
//! `CYCLES` cycle files into `.forge/{step}/` at irregular intervals while it runs. For each
//! `cycle` event the benchmark reads the file's ctime (set by the kernel at the rename, in
//! nanoseconds, on the same clock) and records the time until the event reached the sink.
//!
//! Run: `scripts/services.sh && scripts/build-images.sh && cargo bench --bench cycle_latency`
//! (`CYCLES=40` sets the number of files; default 30).

use std::os::unix::fs::MetadataExt;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proto::EventKind;
use worker::docker::{DockerRuntime, Identity};
use worker::ports::ledger::MemoryLedger;
use worker::ports::sink::ChannelSink;
use worker::{Engine, EngineConfig};

const IMAGE: &str = "forgepool-test-agent:dev";
const STEP: &str = "implement_task";

fn git(dir: &std::path::Path, args: &[&str]) {
    let status = Command::new("git")
        .args(["-c", "user.name=b", "-c", "user.email=b@b"])
        .args(args)
        .current_dir(dir)
        .status()
        .expect("git runs");
    assert!(status.success(), "git {args:?}");
}

#[tokio::main]
async fn main() {
    let cycles: u32 = std::env::var("CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let dir = tempfile::tempdir().expect("a temp dir");
    let bare = dir.path().join("repo.git");
    git(
        dir.path(),
        &["init", "-q", "--bare", "-b", "main", bare.to_str().unwrap()],
    );
    let seed = dir.path().join("seed");
    git(
        dir.path(),
        &[
            "clone",
            "-q",
            bare.to_str().unwrap(),
            seed.to_str().unwrap(),
        ],
    );
    std::fs::write(seed.join("README.md"), "# bench\n").unwrap();
    git(&seed, &["add", "-A"]);
    git(&seed, &["commit", "-qm", "start"]);
    git(&seed, &["push", "-q", "origin", "HEAD:main"]);

    // Sleeps of 130..370 ms, so renames fall at every phase of the 100 ms poll.
    let script = format!(
        "mkdir -p .forge/{STEP}; i=1; while [ $i -le {cycles} ]; do \
           sleep 0.$(( 13 + (i * 7) % 25 )); \
           printf '{{\"cycle\": %d, \"max_cycles\": {cycles}, \"verdict\": \"rejected\", \"feedback\": \"f\"}}' $i > .forge/{STEP}/.tmp; \
           mv .forge/{STEP}/.tmp .forge/{STEP}/review_cycle_$i.json; i=$((i + 1)); \
         done; sleep 1; echo done > bench.txt"
    );
    let job: proto::Job = serde_json::from_value(serde_json::json!({
        "schema_version": 1, "run_id": uuid::Uuid::new_v4(), "ticket": "BENCH-1", "project": "bench",
        "skill": "implement-task", "step": STEP, "brief": "bench",
        "repository": {"url": format!("file://{}", bare.display()), "ref": "main"},
        "commands": [], "skill_md": "bench", "review": null, "repair_budget": 0,
        "implementer": {"name": "bench", "image": IMAGE, "command": ["/bin/sh", "-c", script],
                        "env": [], "network": "none", "memory_bytes": 134217728u64, "cpus": 0.5,
                        "timeout_seconds": 600, "user": null},
        "reviewer": null, "final_reviewer": null, "warnings": [], "submitted_at": "2026-12-02T00:00:00Z"
    }))
    .expect("a valid job");
    let runtime = DockerRuntime::connect(Identity::for_worker("bench"))
        .await
        .expect("the Docker engine is not reachable: run scripts/services.sh");
    let workspaces = dir.path().join("workspaces");
    let engine = Engine::new(
        Arc::new(runtime),
        EngineConfig::for_process(workspaces.clone()),
    );
    let (sink, mut events) = ChannelSink::new(1024);
    let run_dir = workspaces.join(job.run_id.to_string()).join("src");
    let run = tokio::spawn(async move {
        engine
            .execute(
                &job,
                &sink,
                &MemoryLedger::default(),
                worker::RunControl::default(),
            )
            .await
    });
    let mut latencies = Vec::new();
    while let Some(event) = events.recv().await {
        if let EventKind::Cycle { cycle } = &event.kind {
            let arrived = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
            let path = run_dir.join(".forge").join(&cycle.step).join(&cycle.file);
            let meta = std::fs::metadata(&path).expect("the cycle file is still there");
            let renamed = Duration::new(meta.ctime() as u64, meta.ctime_nsec() as u32);
            latencies.push(arrived.saturating_sub(renamed));
        }
    }
    let result = run.await.expect("the run task").expect("events delivered");
    assert!(result.is_some(), "the run ended");
    assert_eq!(latencies.len(), cycles as usize, "one event per file");
    latencies.sort();
    let pick = |p: usize| latencies[(latencies.len() - 1) * p / 100].as_secs_f64() * 1000.0;
    println!("cycle files: {}", latencies.len());
    println!(
        "rename to event, ms: p10 {:.1}  p50 {:.1}  p90 {:.1}  max {:.1}",
        pick(10),
        pick(50),
        pick(90),
        pick(100)
    );
}
