//! `network = "egress"` (SPEC 5, 15): a stage reaches its profile's hosts through the worker's
//! egress proxy, and nothing else: not the worker's host (RabbitMQ, a decoy service), not a
//! private address, not the cloud metadata address, neither through the proxy nor around it.
//! Judged on the host side: the decoy service records every connection it gets.
//! Needs Docker, the test images and the forgepool image (the proxies run it):
//! `scripts/services.sh && scripts/build-images.sh && scripts/build-forgepool-image.sh --debug`.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::Fixture;

const BRANCH: &str = "forge/test-1";

/// A host service that answers `hello-egress` and counts the connections it gets.
fn host_service(answer: bool) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&hits);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            counted.fetch_add(1, Ordering::SeqCst);
            if answer {
                let mut buffer = [0u8; 2048];
                let _ = stream.read(&mut buffer);
                let _ = stream.write_all(
                    b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 12\r\n\r\nhello-egress",
                );
            }
        }
    });
    (port, hits)
}

#[test]
fn an_egress_stage_reaches_its_allowed_host_and_nothing_else() {
    let image = common::output_within(
        Command::new("docker").args(["image", "inspect", "forgepool:dev"]),
        common::COMMAND_LIMIT,
    );
    assert!(
        image.status.success(),
        "the forgepool image (the egress proxy) is missing: build it with `scripts/build-forgepool-image.sh --debug`"
    );
    let gateway = common::bridge_gateway();
    let (allowed, allowed_hits) = host_service(true);
    let (decoy, decoy_hits) = host_service(false);
    let fixture = Fixture::new(
        None,
        &[
            "egress-probe",
            &gateway,
            &allowed.to_string(),
            &decoy.to_string(),
        ],
        &["approve"],
    );
    let agents = std::fs::read_to_string(&fixture.agents).unwrap().replace(
        "[agents.impl]\n",
        &format!("[agents.impl]\nnetwork = \"egress\"\negress = [\"{gateway}:{allowed}\"]\n"),
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let results = fixture.branch_file(BRANCH, "egress-results.txt");
    let logs: String = outcome
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            proto::EventKind::Log { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let results = format!("{results}\nthe stage's log:\n{logs}");
    // Evidence on the host first: the decoy was never reached, the allowed service was.
    assert_eq!(decoy_hits.load(Ordering::SeqCst), 0, "{results}");
    assert!(allowed_hits.load(Ordering::SeqCst) >= 1, "{results}");
    assert!(results.contains("proxy set: yes"), "{results}");
    assert!(results.contains("allowed: hello-egress"), "{results}");
    for target in [
        format!("proxy {gateway}:{decoy}"),
        format!("proxy {gateway}:5672"),
        "proxy 169.254.169.254:80".to_string(),
        "proxy 10.0.0.1:80".to_string(),
        format!("direct {gateway} {decoy}"),
        format!("direct {gateway} 5672"),
        "direct 169.254.169.254 80".to_string(),
        "direct 10.0.0.1 80".to_string(),
    ] {
        assert!(
            results.contains(&format!("{target}: refused")),
            "{target} was reached:\n{results}"
        );
    }
    // The proxy's token never reaches the stored record.
    let everything = serde_json::to_string(&outcome.events).unwrap();
    assert!(!everything.contains("forgepool:") || !everything.contains("@forgepool-egress"));
    outcome.assert_no_containers_left();
}

#[test]
fn an_egress_profile_without_hosts_is_refused() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let agents = std::fs::read_to_string(&fixture.agents)
        .unwrap()
        .replace("[agents.impl]\n", "[agents.impl]\nnetwork = \"egress\"\n");
    std::fs::write(&fixture.agents, agents).unwrap();
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 2, "{}", outcome.printed());
    assert!(
        outcome.stderr.contains("agents.impl.egress"),
        "{}",
        outcome.printed()
    );
}
