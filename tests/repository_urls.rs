//! What a repository URL may name (SPEC 15): a pool refuses local repositories unless its
//! operator allows `file`, and no worker ever reads its own folders (its workspaces, its
//! repository cache), whatever is allowed. Judged on the host: the answer, the runs stored,
//! the refs of the repository that must not change.

mod common;

use std::path::{Path, PathBuf};

use common::cluster::{Cluster, Options};
use common::Fixture;

/// Every ref of a repository and what it points at.
fn refs(repository: &Path) -> String {
    common::git(
        repository,
        &["for-each-ref", "--format=%(refname) %(objectname)"],
    )
}

/// Catches: a pool whose default lets a submission name any repository on a worker's host
/// (`file://`), which the dispatcher accepted and a worker cloned and pushed into.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_refuses_a_local_repository_by_default() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let before = refs(&fixture.bare);
    let options = Options {
        // The harness allows `file` for the other tests; this one keeps the default.
        env: vec![("FORGEPOOL_ALLOWED_URL_SCHEMES".into(), String::new())],
        ..Options::default()
    };
    let cluster = Cluster::start_with(fixture, 1, 1, None, options).await;
    let response = cluster
        .request(reqwest::Method::POST, "/v1/runs")
        .json(&cluster.request_body("LOCAL-1", serde_json::json!({})))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let problem: serde_json::Value = response.json().await.unwrap();
    assert_eq!(status, 422, "{problem}");
    assert_eq!(problem["field"], "repository.url", "{problem}");
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("`file`") && detail.contains("FORGEPOOL_ALLOWED_URL_SCHEMES"),
        "{problem}"
    );
    let runs: serde_json::Value = cluster
        .request(reqwest::Method::GET, "/v1/runs")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(runs["runs"].as_array().map(Vec::len), Some(0), "{runs}");
    assert_eq!(refs(&cluster.fixture.bare), before);
}

/// The cache's mirror of the fixture's repository, once a run made it.
fn mirror(fixture: &Fixture) -> PathBuf {
    let cache = fixture.dir.path().join("workspaces").join(".cache");
    std::fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "git"))
        .unwrap_or_else(|| panic!("no mirror in {}", cache.display()))
}

/// Catches: a worker that clones a repository URL naming its own repository cache (a mirror
/// of another, maybe private, repository) or workspaces, and pushes `forge/*` into it, when
/// `file` is allowed (as `forgepool run` allows it).
#[test]
fn a_worker_never_reads_its_own_folders() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let first = fixture.run("");
    assert_eq!(first.code, 0, "{}", first.printed());
    let mirror = mirror(&fixture);
    let before = refs(&mirror);
    // Named directly, and through a symbolic link from outside the worker's folders.
    let link = fixture.dir.path().join("innocent.git");
    std::os::unix::fs::symlink(&mirror, &link).unwrap();
    for url in [mirror.display().to_string(), link.display().to_string()] {
        let outcome = fixture.run_request(&format!(
            "ticket = \"TEST-2\"\nskill = \"implement-task\"\nbrief = \"Read the mirror\"\n[repository]\nurl = \"file://{url}\"\nref = \"main\"\n"
        ));
        assert_ne!(outcome.code, 0, "{}", outcome.printed());
        assert!(
            outcome.printed().contains("names a folder of this worker"),
            "{}",
            outcome.printed()
        );
        assert!(
            !outcome
                .events
                .iter()
                .any(|e| matches!(e.kind, proto::EventKind::StageStarted { .. })),
            "a stage ran: {}",
            outcome.printed()
        );
        assert_eq!(refs(&mirror), before, "the mirror changed");
        outcome.assert_no_containers_left();
    }
}
