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

/// Catches: a repository URL carrying a token accepted (it went into the agent's
/// `/forge/input/job.json`, failure reasons, webhook bodies and git's command line on the
/// process list): it is refused before anything is stored or contacted, pointing to the
/// forges file, and the token is printed nowhere.
#[test]
fn a_repository_url_with_credentials_is_refused_before_anything_happens() {
    const TOKEN: &str = "ghp_MARKER0123456789abcdef";
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    for url in [
        format!("https://x-access-token:{TOKEN}@127.0.0.1:{port}/org/repo.git"),
        format!("https://{TOKEN}@127.0.0.1:{port}/org/repo.git"),
        format!("https://127.0.0.1:{port}/org/repo.git?private_token={TOKEN}"),
    ] {
        let outcome = fixture.run_request(&format!(
            "ticket = \"TEST-3\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"{url}\"\n"
        ));
        assert_eq!(outcome.code, 2, "{}", outcome.printed());
        assert!(
            outcome.stderr.contains("repository.url")
                && outcome.stderr.contains("FORGEPOOL_FORGES_FILE"),
            "{}",
            outcome.printed()
        );
        assert!(!outcome.printed().contains(TOKEN), "{}", outcome.printed());
        assert!(
            outcome.run_id.is_none(),
            "a run was stored: {}",
            outcome.printed()
        );
    }
    assert!(
        listener.accept().is_err(),
        "the repository's host was contacted"
    );
}
