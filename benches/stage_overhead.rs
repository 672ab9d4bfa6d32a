//! Benchmark: what forgepool adds to a stage container.
//!
//! Runs the same trivial container (`/bin/true` in the test agent image, with exactly the same
//! container configuration, hardening included) two ways, interleaved: straight through the Docker Engine API (create, start,
//! wait, remove) and through forgepool's `DockerRuntime::run_stage` (which also checks the
//! image, streams the output, and enforces the time limit). Prints medians, spread and ratio.
//!
//! Run: `scripts/services.sh && scripts/build-images.sh && cargo bench --bench stage_overhead`
//! (`STAGES=50` sets the number of stages per side; default 30).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::query_parameters::{
    CreateContainerOptions, RemoveContainerOptions, WaitContainerOptions,
};
use bollard::Docker;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use worker::docker::{DockerRuntime, Identity};
use worker::runtime::{ContainerRuntime, StageSpec};

const IMAGE: &str = "forgepool-test-agent:dev";

#[tokio::main]
async fn main() {
    let stages: usize = std::env::var("STAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let docker = Docker::connect_with_local_defaults()
        .expect("docker client")
        .negotiate_version()
        .await
        .expect("the Docker engine is not reachable: run scripts/services.sh");
    docker
        .inspect_image(IMAGE)
        .await
        .expect("the test image is missing: run scripts/build-images.sh");
    let runtime = DockerRuntime::connect(Identity::for_worker("bench"))
        .await
        .expect("runtime");

    // Warm up both paths once.
    raw_stage(&docker, &runtime, 0).await;
    forgepool_stage(&runtime, 0).await;

    let mut raw = Vec::with_capacity(stages);
    let mut ours = Vec::with_capacity(stages);
    // Alternate which side goes first, so that neither pays for the other's clean-up.
    for i in 1..=stages {
        if i % 2 == 0 {
            raw.push(raw_stage(&docker, &runtime, i).await);
            ours.push(forgepool_stage(&runtime, i).await);
        } else {
            ours.push(forgepool_stage(&runtime, i).await);
            raw.push(raw_stage(&docker, &runtime, i).await);
        }
    }
    let (raw_p50, ours_p50) = (percentile(&mut raw, 50), percentile(&mut ours, 50));
    println!("stages per side: {stages}");
    println!(
        "{:<28} {:>9} {:>9} {:>9} {:>9}",
        "path", "p10 ms", "p50 ms", "p90 ms", "max ms"
    );
    for (name, samples) in [
        ("docker API straight", &mut raw),
        ("forgepool run_stage", &mut ours),
    ] {
        println!(
            "{:<28} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            name,
            ms(percentile(samples, 10)),
            ms(percentile(samples, 50)),
            ms(percentile(samples, 90)),
            ms(percentile(samples, 100))
        );
    }
    println!(
        "ratio of medians (forgepool / straight): {:.3}",
        ours_p50.as_secs_f64() / raw_p50.as_secs_f64()
    );
}

async fn raw_stage(docker: &Docker, runtime: &DockerRuntime, i: usize) -> Duration {
    let name = format!("forgepool-bench-raw-{}-{i}", std::process::id());
    let config = runtime.container_config(&spec(name.clone()));
    let started = Instant::now();
    let created = docker
        .create_container(
            Some(CreateContainerOptions {
                name: Some(name),
                platform: String::new(),
            }),
            config,
        )
        .await
        .expect("create");
    docker
        .start_container(&created.id, None)
        .await
        .expect("start");
    let mut wait = docker.wait_container(
        &created.id,
        Some(WaitContainerOptions {
            condition: "not-running".to_string(),
        }),
    );
    let _ = wait.next().await;
    docker
        .remove_container(
            &created.id,
            Some(RemoveContainerOptions {
                force: true,
                v: true,
                ..Default::default()
            }),
        )
        .await
        .expect("remove");
    started.elapsed()
}

async fn forgepool_stage(runtime: &DockerRuntime, i: usize) -> Duration {
    let spec = spec(format!("forgepool-bench-ours-{}-{i}", std::process::id()));
    let (logs, mut receiver) = tokio::sync::mpsc::channel(64);
    let drain = tokio::spawn(async move { while receiver.recv().await.is_some() {} });
    let started = Instant::now();
    let output = runtime
        .run_stage(spec, logs, CancellationToken::new())
        .await
        .expect("stage");
    let elapsed = started.elapsed();
    assert_eq!(output.exit, worker::runtime::StageExit::Exited(0));
    let _ = drain.await;
    elapsed
}

/// The stage both sides run.
fn spec(name: String) -> StageSpec {
    StageSpec {
        name,
        image: IMAGE.to_string(),
        command: vec!["/bin/true".to_string()],
        env: vec![],
        mounts: vec![],
        network: proto::Network::None,
        egress: vec![],
        gateway: false,
        memory_bytes: 128 << 20,
        cpus: 0.5,
        pids_limit: 512,
        read_only_root: true,
        disk_bytes: proto::DEFAULT_DISK_BYTES,
        user: Some("65534:65534".into()),
        workdir: None,
        timeout: Duration::from_secs(60),
        labels: HashMap::new(),
        redact: vec![],
        agent: None,
    }
}

fn percentile(samples: &mut [Duration], p: usize) -> Duration {
    samples.sort();
    let index = ((samples.len() - 1) * p) / 100;
    samples[index]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
