//! Benchmark: each real agent kind through `forgepool run` (the release binary), against the
//! test suite's fake model server, the same flow as `tests/agents.rs`: implementer, verify,
//! a rejection, the second round, an approval, delivery. For each kind it prints:
//! - the image's size;
//! - **start-up**: from the implementer's `stage_started` event (its container is created and
//!   started) to the first request the fake model got: the CLI's own boot inside the stage;
//! - the whole run's wall time;
//! - the peak resident memory of the `forgepool run` process (the worker side of a running
//!   stage: its output reader, transcript and log caps), against the same flow with the
//!   `command` kind's busybox test agent as the baseline.
//!
//! Run: `scripts/services.sh && scripts/build-images.sh && scripts/build-agent-images.sh &&
//! scripts/build-forgepool-image.sh && cargo bench --bench agent_kinds`
//! (`RUNS=3` runs per kind, the default; `KINDS=claude-code,codex` picks kinds).

#[path = "../tests/common/mod.rs"]
mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::kinds::{fixture, key, key_variable, CONTENT, FILE};
use common::model::{FakeModel, Script};
use common::Fixture;
use proto::{AgentKind, EventKind, Stage};

/// What one run measured.
struct Sample {
    startup: Option<Duration>,
    wall: Duration,
    peak_rss_kb: u64,
    events: Vec<proto::Event>,
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::var("RUNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let kinds: Vec<AgentKind> = match std::env::var("KINDS") {
        Ok(list) => list
            .split(',')
            .map(|k| AgentKind::parse(k.trim()).unwrap_or_else(|| panic!("unknown kind {k}")))
            .collect(),
        Err(_) => AgentKind::ALL
            .into_iter()
            .filter(|k| k.default_image().is_some())
            .collect(),
    };

    let mut baseline = Vec::new();
    for _ in 0..runs {
        let fixture = Fixture::new(None, &["change"], &["approve"]);
        baseline.push(
            tokio::task::spawn_blocking(move || measure(&fixture, &[], None))
                .await
                .unwrap(),
        );
    }
    println!("kind            image MB  start-up p50 ms (min..max)  run p50 s  peak RSS p50 MB (vs command)");
    let base_rss = median(baseline.iter().map(|s| s.peak_rss_kb as f64).collect());
    println!(
        "{:<15} {:>8}  {:>22}  {:>14.1}   {:>6.1}",
        "command",
        image_mb(common::TEST_IMAGE),
        "-",
        median(baseline.iter().map(|s| s.wall.as_secs_f64()).collect()),
        base_rss / 1024.0
    );
    for kind in kinds {
        let mut samples = Vec::new();
        for _ in 0..runs {
            let model = FakeModel::start(Script::writing(FILE, CONTENT, 0)).await;
            let fixture = fixture(kind, &model);
            let key = key(kind);
            let (_fixture, mut sample) = tokio::task::spawn_blocking(move || {
                let sample = measure(&fixture, &[(key_variable(kind), key.as_str())], Some(kind));
                (fixture, sample)
            })
            .await
            .unwrap();
            let first = model.requests().first().map(|r| r.at);
            let started = implementer_started(&sample.events);
            sample.startup = match (started, first) {
                (Some(started), Some(first)) => first.duration_since(started).ok(),
                _ => None,
            };
            model.stop();
            samples.push(sample);
        }
        let startups: Vec<f64> = samples
            .iter()
            .filter_map(|s| s.startup.map(|d| d.as_secs_f64() * 1000.0))
            .collect();
        let rss = median(samples.iter().map(|s| s.peak_rss_kb as f64).collect());
        println!(
            "{:<15} {:>8}  {:>8.0} ({:.0}..{:.0})  {:>14.1}   {:>6.1} ({:+.1})",
            kind.as_str(),
            image_mb(&kind.default_image().unwrap()),
            median(startups.clone()),
            startups.iter().cloned().fold(f64::INFINITY, f64::min),
            startups.iter().cloned().fold(0.0, f64::max),
            median(samples.iter().map(|s| s.wall.as_secs_f64()).collect()),
            rss / 1024.0,
            (rss - base_rss) / 1024.0,
        );
    }
}

/// Runs the fixture's flow with `forgepool run`, sampling its resident memory every 20 ms.
fn measure(fixture: &Fixture, env: &[(&str, &str)], kind: Option<AgentKind>) -> Sample {
    let file = fixture.dir.path().join("request.toml");
    std::fs::write(
        &file,
        format!(
            "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n[repository]\nurl = \"file://{}\"\nref = \"main\"\n",
            fixture.bare.display()
        ),
    )
    .unwrap();
    let began = Instant::now();
    let mut child = fixture
        .command()
        .arg("run")
        .arg(&file)
        .arg("--skills")
        .arg(&fixture.skills)
        .arg("--agents")
        .arg(&fixture.agents)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("forgepool runs");
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak = 0;
    let limit = began + Duration::from_secs(300);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if let Some(kb) = std::fs::read_to_string(&status_file)
            .ok()
            .and_then(|s| vm_kb(&s, "VmHWM:"))
        {
            peak = peak.max(kb);
        }
        if Instant::now() > limit {
            let _ = child.kill();
            panic!("forgepool run of {kind:?} took over 300 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let wall = began.elapsed();
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    assert!(
        status.success(),
        "the run of {kind:?} did not deliver:\n{stdout}"
    );
    let outcome = fixture.read_back(0, stdout, String::new());
    Sample {
        startup: None,
        wall,
        peak_rss_kb: peak,
        events: outcome.events,
    }
}

/// When the first implementer stage started.
fn implementer_started(events: &[proto::Event]) -> Option<SystemTime> {
    events.iter().find_map(|event| match event.kind {
        EventKind::StageStarted {
            stage: Stage::Implement,
            ..
        } => proto::parse_time(&event.time),
        _ => None,
    })
}

fn vm_kb(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn image_mb(image: &str) -> u64 {
    let output = Command::new("docker")
        .args(["image", "inspect", "-f", "{{.Size}}", image])
        .output()
        .expect("docker runs");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse::<u64>()
        .unwrap_or_else(|_| panic!("the image {image} is missing: scripts/build-agent-images.sh"))
        / 1_000_000
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
