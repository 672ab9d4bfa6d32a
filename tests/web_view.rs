//! The web view in a real browser: Debian's Chromium driven by Playwright
//! (`tests/browser/view.js`, installed by `scripts/browser-tools.sh`) against a dispatcher and
//! a worker running real stages. Each phase's checks are in the script; this test starts the
//! pool, submits the runs, and checks what only the host can see: the run's stored state,
//! its containers, and that nothing ever fetched the image a hostile reviewer linked.

mod common;

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::browser::{browse, browser_tools};
use common::cluster::{container_count, Cluster};
use common::{output_within, Fixture, TEST_IMAGE};

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\nAPPROVED when tests.txt exists.\n";
const TOKEN: &str = "web-view-token-0123456789";
const LIMIT: Duration = Duration::from_secs(120);

/// Counts the connections made to a local address, the image a hostile reviewer links to.
fn tracker() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/pixel.png", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            counted.fetch_add(1, Ordering::SeqCst);
            if let Ok(mut stream) = stream {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
                let _ = stream.read(&mut [0; 1024]);
            }
        }
    });
    (url, hits)
}

/// Adds agent profiles to the fixture's agents file.
fn add_profiles(fixture: &Fixture, tracker_url: &str) {
    let mut agents = std::fs::read_to_string(&fixture.agents).unwrap();
    for (name, script, args, timeout) in [
        ("slow", "implementer.sh", "\"sleep\", \"6\"", 120),
        ("forever", "implementer.sh", "\"sleep\", \"600\"", 900),
        ("approver", "reviewer.sh", "\"approve\"", 60),
    ] {
        agents.push_str(&format!(
            "\n[agents.{name}]\nimage = \"{TEST_IMAGE}\"\ncommand = [\"/bin/sh\", \"/agents/{script}\", {args}]\nmemory = \"128m\"\ntimeout_seconds = {timeout}\n"
        ));
    }
    agents.push_str(&format!(
        "\n[agents.hostile]\nimage = \"{TEST_IMAGE}\"\ncommand = [\"/bin/sh\", \"/agents/reviewer.sh\", \"hostile\", \"{tracker_url}\"]\nmemory = \"128m\"\ntimeout_seconds = 60\n"
    ));
    std::fs::write(&fixture.agents, agents).unwrap();
}

/// Catches: a run page that misses a verdict, the feedback, the repair round's failing check,
/// the branch, the change or the report; a list without the run or its counts; a token that
/// is not asked for, or ends up in an address; agent feedback that runs as script or loads an
/// image (the tracker on the host counts any fetch); a running run's page that does not move
/// on by itself; and a cancel button that does not stop the run (its state and containers
/// are read back here).
#[tokio::test(flavor = "multi_thread")]
async fn the_web_view_shows_runs_live_keeps_agent_text_inert_and_cancels() {
    let tools = browser_tools();
    assert!(tools.exists());
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["rules"]);
    let (tracker_url, tracker_hits) = tracker();
    add_profiles(&fixture, &tracker_url);
    let cluster = Cluster::start(fixture, 1, 2, Some(TOKEN)).await;

    // Rejected once, approved after, with a check that fails in the first round.
    let approved = cluster
        .submit_with(
            "WEB-1",
            serde_json::json!({"commands": [{"argv": ["test", "-f", "fixed.txt"], "timeout": 30}]}),
        )
        .await;
    let hostile = cluster
        .submit_with(
            "WEB-2",
            serde_json::json!({"agents": {"reviewer": "hostile"}}),
        )
        .await;
    let views = cluster
        .wait_terminal(&[approved.clone(), hostile.clone()], LIMIT)
        .await;
    assert_eq!(views[0]["state"], "delivered", "{}", views[0]);
    assert_eq!(views[0]["cycles"].as_array().unwrap().len(), 2);
    assert_eq!(views[1]["state"], "delivered", "{}", views[1]);
    let printed = browse(
        &cluster,
        TOKEN,
        "finished",
        &[("RUN_APPROVED", &approved), ("RUN_HOSTILE", &hostile)],
    )
    .await;
    assert!(
        printed.contains("ok: no script of the feedback ran"),
        "{printed}"
    );
    assert_eq!(
        tracker_hits.load(Ordering::SeqCst),
        0,
        "something fetched the image the reviewer linked"
    );

    // Live: the page of a running run follows it to its next stage.
    let slow = cluster
        .submit_with(
            "WEB-3",
            serde_json::json!({"agents": {"implementer": "slow", "reviewer": "approver"}}),
        )
        .await;
    cluster.wait_running(&slow).await;
    browse(&cluster, TOKEN, "live", &[("RUN", &slow)]).await;

    // Cancel from the page: the run ends cancelled and its container is gone.
    let forever = cluster
        .submit_with(
            "WEB-4",
            serde_json::json!({"agents": {"implementer": "forever"}}),
        )
        .await;
    cluster.wait_running(&forever).await;
    browse(&cluster, TOKEN, "cancel", &[("RUN", &forever)]).await;
    let (view, _) = cluster.wait_one(&forever, LIMIT).await;
    assert_eq!(view["state"], "cancelled", "{view}");
    let started = Instant::now();
    while container_count(&forever) > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the cancelled run's container is still there"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(tracker_hits.load(Ordering::SeqCst), 0);
}

/// Catches: a Markdown renderer that makes an element or attribute it should not (a script,
/// an image, an event handler), links to a `javascript:`, `data:` or relative address, loses
/// agent text, or mangles names with underscores. Node.js alone, with a minimal document.
#[test]
fn agent_markdown_becomes_known_elements_and_text_only() {
    let mut command = Command::new("node");
    command.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/markdown.js"));
    let output = output_within(&mut command, Duration::from_secs(120));
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(printed.contains("ok: script tags stay text"), "{printed}");
}
