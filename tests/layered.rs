//! Layered workspaces (SPEC 14, `FORGEPOOL_OVERLAY_WORKSPACES`) through `forgepool run`, with
//! a real Docker engine and git: the evidence is on the host (the mount table while the run
//! goes on, the cached checkout, the delivered branch).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::Fixture;

const BRANCH: &str = "forge/test-1";
const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\nAPPROVED when tests.txt exists.\n";
/// A check that fails unless its copy holds round 1's change on top of the base.
const CHECK: &str = "commands = [{ argv = [\"sh\", \"-c\", \"sleep 1; grep -q 'round 1' feature.txt && test -f README.md\"], timeout = 60 }]";

/// The overlay mount points under `dir` (this process shares the worker's mount namespace).
fn overlays_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|line| line.contains(" - overlay "))
        .filter_map(|line| line.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|point| point.starts_with(dir))
        .collect()
}

/// Runs the fixture while sampling the overlays under its folder; returns what was seen.
fn run_watching_mounts(fixture: &Fixture, layers: &str) -> (common::Outcome, BTreeSet<String>) {
    let dir = fixture.dir.path().to_path_buf();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut seen = BTreeSet::new();
            while !stop.load(Ordering::Relaxed) {
                for point in overlays_under(&dir) {
                    let relative = point.strip_prefix(&dir).unwrap().to_path_buf();
                    // `workspaces/{run id}/src` is kept as `src`, `…/review-1` as `review-1`.
                    seen.insert(relative.file_name().unwrap().to_string_lossy().into_owned());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        })
    };
    let mut command = fixture.command();
    command.env("FORGEPOOL_OVERLAY_WORKSPACES", layers);
    let request = format!(
        "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n{CHECK}\n[repository]\nurl = \"file://{}\"\nref = \"main\"\n",
        fixture.bare.display()
    );
    let file = fixture.dir.path().join("request.toml");
    std::fs::write(&file, request).unwrap();
    command.arg("run").arg(&file);
    command
        .arg("--skills")
        .arg(&fixture.skills)
        .arg("--agents")
        .arg(&fixture.agents);
    let outcome = fixture.outcome(command);
    stop.store(true, Ordering::Relaxed);
    (outcome, sampler.join().unwrap())
}

/// The cached checkouts' files (`{cache}/*.trees/*/files`), as paths relative to each.
fn cached_checkouts(fixture: &Fixture) -> Vec<Vec<String>> {
    let cache = fixture.dir.path().join("workspaces").join(".cache");
    let mut found = Vec::new();
    for trees in std::fs::read_dir(&cache).into_iter().flatten().flatten() {
        if !trees.file_name().to_string_lossy().ends_with(".trees") {
            continue;
        }
        for checkout in std::fs::read_dir(trees.path()).unwrap().flatten() {
            let files = checkout.path().join("files");
            if files.is_dir() {
                let mut names: Vec<String> = std::fs::read_dir(&files)
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect();
                names.sort();
                found.push(names);
            }
        }
    }
    found
}

/// Catches: a layered run whose review or verification copy misses the change (the check
/// fails, or the rules reviewer never sees tests.txt), a stage change that reaches the cached
/// checkout, mounts left behind after the run, and a root worker beside its Docker engine
/// that never layers its workspaces.
#[test]
fn a_layered_run_reviews_verifies_and_delivers_the_change_and_leaves_no_mount() {
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["rules"]);
    let (outcome, seen) = run_watching_mounts(&fixture, "auto");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let result = outcome.record().result.as_ref().unwrap();
    assert_eq!(
        result.implementation_rounds, 2,
        "rejected once, then approved"
    );
    for folder in ["src", "verify-1", "review-1", "review-2"] {
        assert!(
            seen.contains(folder),
            "{folder} was never an overlay; saw {seen:?}"
        );
    }
    assert!(
        overlays_under(fixture.dir.path()).is_empty(),
        "mounts left after the run: {:?}",
        overlays_under(fixture.dir.path())
    );
    let files = fixture.branch_files(BRANCH).unwrap();
    for expected in ["README.md", "feature.txt", "nonce.txt", "tests.txt"] {
        assert!(
            files.contains(&expected.to_string()),
            "{expected} not delivered: {files:?}"
        );
    }
    assert!(
        files
            .iter()
            .all(|f| !f.starts_with(".forge") && !f.starts_with(".git")),
        "{files:?}"
    );
    assert_eq!(
        fixture.branch_file(BRANCH, "feature.txt"),
        "round 1\nround 2\n"
    );
    assert_eq!(
        cached_checkouts(&fixture),
        vec![vec!["README.md".to_string()]],
        "the cached checkout holds the base and nothing a stage wrote"
    );
    outcome.assert_no_containers_left();
}

/// Catches: a layered copy that cannot carry an edit of a file of the base (each verify and
/// review stage falling back to a checkout, with a warning), and a copy that lost the edit.
#[test]
fn an_edit_of_a_base_file_is_laid_over_the_cache_without_a_fallback() {
    let fixture = Fixture::new(Some(REVIEW), &["change-base"], &["rules"]);
    let (outcome, seen) = run_watching_mounts(&fixture, "auto");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    for folder in ["verify-1", "review-1", "verify-2", "review-2"] {
        assert!(
            seen.contains(folder),
            "{folder} was never an overlay; saw {seen:?}"
        );
    }
    assert!(
        !outcome.stderr.contains("checking one out") && !outcome.stderr.contains(" WARN "),
        "a copy fell back:\n{}",
        outcome.printed()
    );
    let readme = fixture.branch_file(BRANCH, "README.md");
    assert!(
        readme.ends_with("edited in round 1\nedited in round 2\n"),
        "{readme:?}"
    );
    outcome.assert_no_containers_left();
}

/// Catches: the README's example falling back from the cache's fast path (a copy not laid
/// over the cached checkout, or not linked), colour codes in logs that go to a pipe, or an
/// example that does not deliver, run as `scripts/example.sh` runs it. The
/// warning came from a cached checkout made by the worker and then given to the stage user:
/// its index still named the worker as every file's owner.
#[test]
fn the_readme_example_delivers_with_no_warning() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bare = fixture.dir.path().join("shop.git");
    let seed = fixture.dir.path().join("shop");
    common::git(
        fixture.dir.path(),
        &[
            "init",
            "--quiet",
            "--bare",
            "--initial-branch=main",
            bare.to_str().unwrap(),
        ],
    );
    common::git(
        fixture.dir.path(),
        &[
            "clone",
            "--quiet",
            bare.to_str().unwrap(),
            seed.to_str().unwrap(),
        ],
    );
    let copied = std::process::Command::new("cp")
        .arg("-r")
        .arg(root.join("examples/shop/."))
        .arg(&seed)
        .status()
        .unwrap();
    assert!(copied.success());
    common::git(&seed, &["add", "-A"]);
    common::git(
        &seed,
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "--quiet",
            "-m",
            "The shop",
        ],
    );
    common::git(&seed, &["push", "--quiet", "origin", "HEAD:main"]);
    let request = std::fs::read_to_string(root.join("examples/request.toml"))
        .unwrap()
        .replace("REPOSITORY_URL", &format!("file://{}", bare.display()));
    let file = fixture.dir.path().join("shop-request.toml");
    std::fs::write(&file, request).unwrap();
    // As `scripts/example.sh` has it: the workspace folder inside a folder of `mktemp -d`,
    // closed to the stage user, so the cache's checkout is made by the worker and given to
    // the stage user.
    let workspaces = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        workspaces.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    let mut command = fixture.command();
    command
        .env(
            "FORGEPOOL_WORKSPACE_DIR",
            workspaces.path().join("workspaces"),
        )
        // The fallbacks log at debug level; info shows that logs carry no colour codes.
        .env("FORGEPOOL_LOG", "info,forgepool_worker::engine=debug")
        .arg("run")
        .arg(&file)
        .arg("--skills")
        .arg(root.join("examples/skills"))
        .arg("--agents")
        .arg(root.join("examples/agents.toml"));
    let outcome = fixture.outcome(command);
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    assert!(
        outcome.stdout.contains("Review cycle 2/3: APPROVED"),
        "{}",
        outcome.printed()
    );
    assert!(
        !outcome.stderr.contains("WARN") && !outcome.stderr.contains("checking one out"),
        "the example printed a warning or fell back:\n{}",
        outcome.printed()
    );
    assert!(
        outcome.stderr.contains("INFO") && !outcome.stderr.contains('\u{1b}'),
        "logs redirected to a pipe carry colour codes:\n{}",
        outcome.printed()
    );
    outcome.assert_no_containers_left();
}

/// Catches: `FORGEPOOL_OVERLAY_WORKSPACES=false` not honoured, and a checked-out run that
/// delivers other files than a layered one.
#[test]
fn with_layers_off_the_run_is_checked_out_and_delivers_the_same_files() {
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["rules"]);
    let (outcome, seen) = run_watching_mounts(&fixture, "false");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    assert!(seen.is_empty(), "overlays with layers off: {seen:?}");
    assert!(cached_checkouts(&fixture).is_empty());
    let mut files = fixture.branch_files(BRANCH).unwrap();
    files.retain(|f| !f.starts_with("received_"));
    assert_eq!(
        files,
        ["README.md", "feature.txt", "nonce.txt", "tests.txt"]
    );
}

/// Catches: a bad value taken silently, and `true` on a worker that cannot mount starting
/// anyway.
#[test]
fn a_bad_layers_setting_stops_the_run_naming_it() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let mut command = fixture.command();
    command.env("FORGEPOOL_OVERLAY_WORKSPACES", "sometimes");
    command.args(["run", "nothing.toml"]);
    let output = common::output_within(&mut command, common::COMMAND_LIMIT);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("FORGEPOOL_OVERLAY_WORKSPACES") || stderr.contains("overlay-workspaces"),
        "{stderr}"
    );
    assert!(stderr.contains("sometimes"), "{stderr}");
}

/// Catches: the first implementer (its container made while the repository is cloned) started
/// without the stages' git folder at `/workspace/.git`, and a workspace that is not the
/// overlay inside the container.
#[test]
fn the_first_implementer_of_a_layered_run_gets_its_git_folder() {
    let fixture = Fixture::new(None, &["env-dump"], &["approve"]);
    let (outcome, seen) = run_watching_mounts(&fixture, "auto");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    assert!(
        seen.contains("src"),
        "the work tree was never an overlay: {seen:?}"
    );
    let mounts = fixture.branch_file(BRANCH, "mounts.txt");
    let at = |target: &str| {
        mounts
            .lines()
            .find(|line| line.split(' ').nth(1) == Some(target))
            .unwrap_or_else(|| panic!("nothing mounted at {target}:\n{mounts}"))
            .to_string()
    };
    assert_eq!(
        at("/workspace").split(' ').nth(2),
        Some("overlay"),
        "{mounts}"
    );
    assert!(at("/workspace/.git").contains("rw"), "{mounts}");
}
