//! The forgepool image that `scripts/build-forgepool-image.sh` builds without a registry: it
//! runs the dispatcher as its non-root user against the real RabbitMQ, and carries git for the
//! workers.

mod common;

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

const IMAGE: &str = "forgepool:dev";

fn docker(args: &[&str]) -> std::process::Output {
    common::output_within(Command::new("docker").args(args), common::COMMAND_LIMIT)
}

fn require_image() {
    common::require_docker();
    if !docker(&["image", "inspect", IMAGE]).status.success() {
        panic!("the image {IMAGE} is missing: build it with `scripts/build-forgepool-image.sh --debug`");
    }
}

#[test]
fn the_image_runs_the_dispatcher_as_a_non_root_user() {
    require_image();
    common::cluster::require_rabbitmq();
    // Readable by the image's user: skills and agents from the examples.
    let config = tempfile::tempdir().unwrap();
    let copy = Command::new("cp")
        .args(["-r", "examples/skills", "examples/agents.toml"])
        .arg(config.path())
        .status()
        .unwrap();
    assert!(copy.success());
    Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(config.path())
        .status()
        .unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let name = format!("fp-image-{}", uuid::Uuid::new_v4().simple());
    let prefix = format!("img{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let mount = format!("{}:/etc/forgepool:ro", config.path().display());
    let listen = format!("FORGEPOOL_LISTEN=127.0.0.1:{port}");
    let amqp_prefix = format!("FORGEPOOL_AMQP_PREFIX={prefix}");
    let started = docker(&[
        "run",
        "-d",
        "--rm",
        "--name",
        &name,
        "--network",
        "host",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--tmpfs",
        "/var/lib/forgepool/data:uid=10001",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "-v",
        &mount,
        "-e",
        &listen,
        "-e",
        &amqp_prefix,
        "-e",
        "FORGEPOOL_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/%2f",
        "-e",
        "FORGEPOOL_SKILLS_DIR=/etc/forgepool/skills",
        "-e",
        "FORGEPOOL_AGENTS_FILE=/etc/forgepool/agents.toml",
        "-e",
        "FORGEPOOL_LOG=info",
        "-e",
        "FORGEPOOL_JOB_KEY=forgepool-image-test-key-0123456789",
        IMAGE,
        "dispatcher",
    ]);
    assert!(
        started.status.success(),
        "{}",
        String::from_utf8_lossy(&started.stderr)
    );
    // Whatever happens below, the container goes.
    let _container = RemoveContainer(name.clone());
    let ready = {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = Command::new("curl")
                .args([
                    "-s",
                    "--max-time",
                    "5",
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                ])
                .arg(format!("http://127.0.0.1:{port}/readyz"))
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            if status == "200" || Instant::now() > deadline {
                break status;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    // The queue gauges are read a moment after start: wait for them, boundedly.
    let depth = format!("forge_queue_depth{{queue_name=\"{prefix}.jobs\"}}");
    let metrics = {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = Command::new("curl")
                .args([
                    "-s",
                    "--max-time",
                    "5",
                    &format!("http://127.0.0.1:{port}/metrics"),
                ])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
                .unwrap_or_default();
            if text.contains(&depth) || Instant::now() > deadline {
                break text;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    };
    let user = docker(&["exec", &name, "id", "-u"]);
    let git = docker(&["exec", &name, "git", "--version"]);
    let logs = docker(&["logs", &name]);
    let stopped = docker(&["stop", "-t", "10", &name]);
    // With the dispatcher stopped, its queues can go without being declared again.
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(common::cluster::delete_prefix_queues(&prefix));
    assert_eq!(
        ready,
        "200",
        "the dispatcher in the image became ready: {}",
        String::from_utf8_lossy(&logs.stderr)
    );
    assert!(metrics.contains(&depth), "{metrics}");
    assert_eq!(String::from_utf8_lossy(&user.stdout).trim(), "10001");
    assert!(String::from_utf8_lossy(&git.stdout).starts_with("git version"));
    assert!(stopped.status.success());
    let logs = String::from_utf8_lossy(&logs.stderr);
    assert!(logs.contains("dispatcher listening"), "{logs}");
}

/// Removes a container when dropped (a failed assertion included), within 30 s.
struct RemoveContainer(String);

impl Drop for RemoveContainer {
    fn drop(&mut self) {
        let _ = Command::new("timeout")
            .args(["30", "docker", "rm", "-f", &self.0])
            .output();
    }
}
