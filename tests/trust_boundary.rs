//! The trust boundary (SPEC 15), tried as an attacker would from inside a stage container.
//!
//! Every test is judged by evidence on the host side: a marker file that must not appear, a
//! host repository or folder that must not change, a decoy whose text must not appear in the
//! events, the store, the report or the printed output, the worker's peak memory. A run that
//! fails with a clear reason and touches nothing on the host is a right outcome too.
//! Start the engine and build the images with `scripts/services.sh && scripts/build-images.sh`.

mod common;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Fixture, Outcome};
use proto::{EventKind, RunState, Stage};

const BRANCH: &str = "forge/test-1";
const SECRET: &str = "sk-test-0123456789abcdef";
const DECOY: &str = "HOST-DECOY-7f3a9c-never-leaves-the-host";

fn review(max_retries: u32) -> String {
    format!("---\nmax_retries: {max_retries}\n---\n# Check\nAPPROVED when tests.txt exists.\n")
}

/// Everything a user could read about the run: events, the stored record (cycles, result,
/// report) and what the command printed.
fn everything(outcome: &Outcome) -> String {
    let mut text = serde_json::to_string(&outcome.events).unwrap();
    if let Some(record) = &outcome.record {
        text.push_str(&serde_json::to_string(&record.cycles).unwrap());
        text.push_str(&serde_json::to_string(&record.result).unwrap());
    }
    text.push_str(&outcome.stdout);
    text.push_str(&outcome.stderr);
    text
}

/// Every file below `dir` with its size and content digest: a host folder's fingerprint.
fn fingerprint(dir: &Path) -> BTreeMap<PathBuf, (u64, u64)> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        let Ok(metadata) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if metadata.is_dir() {
            for entry in std::fs::read_dir(&path).unwrap().flatten() {
                pending.push(entry.path());
            }
        } else {
            let bytes = std::fs::read(&path).unwrap_or_default();
            let digest = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            found.insert(
                path.strip_prefix(dir).unwrap().to_path_buf(),
                (metadata.len(), digest),
            );
        }
    }
    found
}

/// A repository on the host, outside every workspace, with one commit.
fn host_repository(dir: &Path) -> PathBuf {
    let repo = dir.join("host-repo");
    std::fs::create_dir_all(&repo).unwrap();
    common::git(&repo, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(repo.join("private.txt"), format!("{DECOY}\n")).unwrap();
    common::git(&repo, &["add", "-A"]);
    common::git(
        &repo,
        &[
            "-c",
            "user.name=h",
            "-c",
            "user.email=h@h",
            "commit",
            "--quiet",
            "-m",
            "host",
        ],
    );
    repo
}

#[test]
fn git_configuration_an_agent_writes_never_runs_on_the_host() {
    let fixture = Fixture::new(Some(&review(3)), &["change"], &["approve"]);
    let markers = fixture.dir.path().join("markers");
    std::fs::create_dir_all(&markers).unwrap();
    let marker = markers.join("ran");
    let decoy_tree = fixture.dir.path().join("decoy-tree");
    std::fs::create_dir_all(&decoy_tree).unwrap();
    std::fs::write(decoy_tree.join("host-secret.txt"), DECOY).unwrap();
    rewrite_implementer(
        &fixture,
        &[
            "attack",
            "git-config",
            marker.to_str().unwrap(),
            decoy_tree.to_str().unwrap(),
        ],
    );
    let outcome = fixture.run("");
    // Evidence on the host first: no program of the agent's configuration ran.
    let ran: Vec<_> = std::fs::read_dir(&markers)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        ran.is_empty(),
        "the host ran the agent's git configuration: {ran:?}"
    );
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    // core.worktree was not honoured: the branch carries the workspace, not the host folder.
    let files = fixture.branch_files(BRANCH).unwrap();
    assert!(files.contains(&"feature.txt".to_string()), "{files:?}");
    assert!(!files.contains(&"host-secret.txt".to_string()), "{files:?}");
    assert!(!everything(&outcome).contains(DECOY));
    // The clean filter would also have changed the content; what was delivered is verbatim.
    assert_eq!(fixture.branch_file(BRANCH, "feature.txt"), "round 1\n");
}

/// Catches: forgepool's git following a gitfile the agent made of `/workspace/.git` (a
/// checked-out workspace), or a `commondir` it wrote into the stages' git folder (a layered
/// one, where `.git` is a mount the agent cannot replace), into a host repository.
#[test]
fn a_gitfile_naming_a_host_repository_leaves_it_untouched() {
    for layers in ["false", "auto"] {
        let fixture = Fixture::new(Some(&review(3)), &["change"], &["approve"]);
        let host = host_repository(fixture.dir.path());
        let before = fingerprint(&host);
        rewrite_implementer(&fixture, &["attack", "gitfile", host.to_str().unwrap()]);
        let outcome = fixture.run_with("", &[("FORGEPOOL_OVERLAY_WORKSPACES", layers)]);
        assert_eq!(
            fingerprint(&host),
            before,
            "the host repository changed ({layers})"
        );
        assert_eq!(outcome.code, 0, "{layers}: {}", outcome.printed());
        let files = fixture.branch_files(BRANCH).unwrap();
        assert!(!files.contains(&"private.txt".to_string()), "{files:?}");
        assert!(!everything(&outcome).contains(DECOY));
    }
}

/// An agent delivers a copy of every object its git folder holds. A blob only another branch
/// of the repository reaches (a private branch an earlier run on this worker fetched into the
/// cache) is not among them, read back on the host from the delivered branch; a blob of its own
/// base is, so the copy did work. Catches: a run's git folder linked from a cache mirror that
/// holds every object ever fetched for the repository URL (issue 26, item 5).
#[test]
fn a_run_cannot_read_objects_only_another_branch_reaches() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let work = fixture.dir.path().join("private-seed");
    let git = |dir: &Path, args: &[&str]| {
        let output = Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@t"])
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        assert!(output.status.success(), "git {args:?}: {output:?}");
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    let bare = fixture.bare.to_str().unwrap();
    git(
        fixture.dir.path(),
        &["clone", "--quiet", bare, work.to_str().unwrap()],
    );
    git(&work, &["checkout", "--quiet", "-b", "private"]);
    std::fs::write(work.join("private.txt"), format!("{DECOY}\n")).unwrap();
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "--quiet", "-m", "private"]);
    git(&work, &["push", "--quiet", "origin", "private"]);
    let secret = git(&work, &["rev-parse", "HEAD:private.txt"]);
    let readme = git(&work, &["rev-parse", "main:README.md"]);
    // A run of the private branch fetches it into this worker's cache.
    let private = fixture.run_request(&format!(
        "ticket = \"TEST-0\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"file://{bare}\"\nref = \"private\"\n"
    ));
    assert_eq!(private.code, 0, "{}", private.printed());
    rewrite_implementer(&fixture, &["attack", "steal-objects"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    // The delivered copy, read with the host's git.
    let stolen = fixture.dir.path().join("stolen");
    std::fs::create_dir_all(&stolen).unwrap();
    let archive = Command::new("git")
        .args([
            "--git-dir",
            bare,
            "archive",
            "--format=tar",
            BRANCH,
            "stolen-objects",
        ])
        .output()
        .unwrap();
    assert!(archive.status.success(), "{archive:?}");
    let mut tar = Command::new("tar")
        .args(["-x", "-C", stolen.to_str().unwrap()])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(tar.stdin.as_mut().unwrap(), &archive.stdout).unwrap();
    assert!(tar.wait().unwrap().success());
    let probe = fixture.dir.path().join("probe.git");
    git(
        fixture.dir.path(),
        &["init", "--quiet", "--bare", probe.to_str().unwrap()],
    );
    let holds = |object: &str| {
        Command::new("git")
            .args([
                "--git-dir",
                probe.to_str().unwrap(),
                "cat-file",
                "-e",
                object,
            ])
            .env("GIT_OBJECT_DIRECTORY", stolen.join("stolen-objects"))
            .status()
            .unwrap()
            .success()
    };
    assert!(holds(&readme), "the copy of the objects works");
    assert!(!holds(&secret), "the agent read the private branch's blob");
    assert!(!everything(&outcome).contains(DECOY));
}

#[test]
fn a_nested_gitfile_is_refused_and_its_repository_stays_untouched() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let host = host_repository(fixture.dir.path());
    let before = fingerprint(&host);
    rewrite_implementer(&fixture, &["attack", "nested-repo", host.to_str().unwrap()]);
    let outcome = fixture.run("");
    assert_eq!(fingerprint(&host), before, "the host repository changed");
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    assert!(
        outcome
            .stdout
            .contains("nested git repository at `vendor/lib`"),
        "{}",
        outcome.printed()
    );
    assert!(
        fixture.branch_files(BRANCH).is_none(),
        "nothing was delivered"
    );
}

#[test]
fn a_symlinked_forge_folder_neither_writes_nor_reads_on_the_host() {
    for kind in ["forge-link", "step-link"] {
        let fixture = Fixture::new(Some(&review(3)), &["change"], &["rules"]);
        let host = fixture.dir.path().join("host-folder");
        std::fs::create_dir_all(host.join("implement_task")).unwrap();
        std::fs::create_dir_all(host.join("history")).unwrap();
        let decoy_cycle =
            format!(r#"{{"cycle": 9, "verdict": "approved", "feedback": "{DECOY}"}}"#);
        std::fs::write(
            host.join("implement_task/review_cycle_9.json"),
            &decoy_cycle,
        )
        .unwrap();
        std::fs::write(host.join("review_cycle_9.json"), &decoy_cycle).unwrap();
        let before = fingerprint(&host);
        rewrite_implementer(&fixture, &["attack", kind, host.to_str().unwrap()]);
        let outcome = fixture.run("");
        assert_eq!(
            fingerprint(&host),
            before,
            "{kind}: the host folder changed"
        );
        assert!(
            !everything(&outcome).contains(DECOY),
            "{kind}: the decoy leaked"
        );
        // forgepool could not write the workspace's cycle or history file: the run ends with
        // that reason, and nothing is delivered.
        assert_eq!(outcome.code, 1, "{kind}: {}", outcome.printed());
        assert!(
            outcome.stdout.contains("symlink"),
            "{kind}: {}",
            outcome.printed()
        );
        assert!(fixture.branch_files(BRANCH).is_none());
    }
}

#[test]
fn a_fifo_or_a_symlink_posing_as_a_cycle_file_neither_blocks_nor_leaks() {
    let fixture = Fixture::new(Some(&review(3)), &["change"], &["approve"]);
    let decoy = fixture.dir.path().join("host-decoy.json");
    std::fs::write(
        &decoy,
        format!(r#"{{"cycle": 6, "verdict": "approved", "feedback": "{DECOY}"}}"#),
    )
    .unwrap();
    rewrite_implementer(&fixture, &["attack", "traps", decoy.to_str().unwrap()]);
    // A FIFO read without O_NONBLOCK would hold the scan, and the run, for ever: the harness
    // fails the test after its limit.
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    assert!(!everything(&outcome).contains(DECOY));
    let record = outcome.record();
    let files: Vec<&str> = record.cycles.iter().map(|c| c.file.as_str()).collect();
    assert_eq!(files, ["review_cycle_1.json"], "only forgepool's own cycle");
}

#[test]
fn a_later_round_cannot_rewrite_an_earlier_review() {
    let fixture = Fixture::new(Some(&review(3)), &["change"], &["rules"]);
    rewrite_implementer(&fixture, &["attack", "tamper"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let record = outcome.record();
    let verdicts: Vec<(&str, &str)> = record
        .cycles
        .iter()
        .map(|c| (c.file.as_str(), c.verdict.as_str()))
        .collect();
    assert_eq!(
        verdicts,
        [
            ("review_cycle_1.json", "rejected"),
            ("review_cycle_2.json", "approved")
        ]
    );
    assert_eq!(record.cycles[0].origin, proto::CycleOrigin::Forgepool);
    let report = &record.result.as_ref().unwrap().report;
    assert!(
        !everything(&outcome).contains("forged approval"),
        "{report}"
    );
}

#[test]
fn secrets_in_agent_files_are_redacted_everywhere() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    rewrite_implementer(&fixture, &["attack", "cycle-secret"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let text = everything(&outcome);
    assert!(!text.contains(SECRET), "a secret leaked");
    let record = outcome.record();
    assert_eq!(record.cycles.len(), 1, "the container's own cycle is kept");
    assert_eq!(record.cycles[0].feedback, "the key is [REDACTED]");
    assert_eq!(record.cycles[0].origin, proto::CycleOrigin::Container);
}

#[test]
fn a_secret_in_a_git_error_is_redacted() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    // git names the repository it cannot read; that name holds the profile's secret.
    let outcome = fixture.run_request(&format!(
        "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"file://{}/{SECRET}.git\"\n",
        fixture.dir.path().display()
    ));
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    let text = everything(&outcome);
    assert!(text.contains("[REDACTED].git"), "{}", outcome.printed());
    assert!(
        !text.contains(SECRET),
        "a secret leaked through git's error"
    );
}

#[test]
fn a_reviewer_printing_without_newlines_keeps_the_worker_small() {
    let fixture = Fixture::new(Some(&review(1)), &["change"], &["flood-line"]);
    let (outcome, peak_kib) = run_measured(&fixture);
    assert!(
        peak_kib < 150 * 1024,
        "forgepool grew to {} MiB while a reviewer printed 200 MB without a newline",
        peak_kib / 1024
    );
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let stored = review_log_bytes(&outcome);
    assert!(stored <= (1 << 20) + 4096, "{stored} bytes of log stored");
    assert!(everything(&outcome).contains("were not stored"));
    assert_eq!(
        outcome.record().cycles[0].feedback,
        "Verdict could not be parsed"
    );
}

#[test]
fn a_reviewer_printing_millions_of_lines_stores_a_bounded_log() {
    let fixture = Fixture::new(Some(&review(1)), &["change"], &["flood-lines"]);
    let (outcome, peak_kib) = run_measured(&fixture);
    assert!(peak_kib < 150 * 1024, "grew to {} MiB", peak_kib / 1024);
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let log_events = outcome
        .events
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::Log {
                    stage: Stage::Review,
                    ..
                }
            )
        })
        .count();
    assert!(log_events <= 10_001, "{log_events} log events stored");
    assert!(review_log_bytes(&outcome) <= (1 << 20) + 4096);
    let summary = outcome.events.iter().any(|e| {
        matches!(&e.kind, EventKind::Log { stage: Stage::Review, text, .. } if text.contains("were not stored"))
    });
    assert!(summary, "the dropped output is summarised in one event");
    // The verdict comes from the captured stdout, which kept its first MiB: no marker there.
    assert_eq!(outcome.record().state, RunState::DeliveredWithWarnings);
}

#[test]
fn a_run_whose_reviewer_floods_its_output_can_be_cancelled() {
    let fixture = Fixture::new(Some(&review(1)), &["change"], &["flood-forever"]);
    let mut child = spawn_run(&fixture);
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    // Once the reviewer floods (well past the stored cap), a SIGTERM cancels the run.
    let watched = fixture.dir.path().to_string_lossy().to_string();
    let started = Instant::now();
    loop {
        let seen = inspect_stage_containers_once(&watched);
        if seen.contains_key("review") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the review stage never started"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(3));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            stopped.elapsed() < Duration::from_secs(60),
            "a flooding run did not end within 60 s of its cancel"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let outcome = fixture.read_back(
        status.code().unwrap_or(-1),
        reader.join().unwrap(),
        String::new(),
    );
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    assert_eq!(outcome.record().state, RunState::Cancelled);
    assert!(review_log_bytes(&outcome) <= (1 << 20) + 4096);
    outcome.assert_no_containers_left();
}

#[test]
fn a_stage_writing_past_its_disk_limit_is_stopped() {
    let fixture = Fixture::new(None, &["disk-hog"], &["approve"]);
    let agents = std::fs::read_to_string(&fixture.agents)
        .unwrap()
        .replace("[agents.impl]\n", "[agents.impl]\ndisk = \"10m\"\n");
    std::fs::write(&fixture.agents, agents).unwrap();
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    assert!(
        outcome
            .stdout
            .contains("over the profile's disk limit of 10 MiB"),
        "{}",
        outcome.printed()
    );
    assert!(
        fixture.branch_files(BRANCH).is_none(),
        "nothing was delivered"
    );
    outcome.assert_no_containers_left();
}

#[test]
fn disallowed_repository_schemes_are_refused_before_anything_runs() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let marker = fixture.dir.path().join("ext-ran");
    for url in [
        format!("ext::sh -c touch% {}", marker.display()),
        "fd::3".to_string(),
        "http://127.0.0.1:9/repo.git".to_string(),
    ] {
        let outcome = fixture.run_request(&format!(
            "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"{url}\"\n"
        ));
        assert_eq!(outcome.code, 2, "{url}: {}", outcome.printed());
        assert!(
            outcome.stderr.contains("repository.url") && outcome.stderr.contains("not allowed"),
            "{url}: {}",
            outcome.printed()
        );
    }
    assert!(!marker.exists());
    // An operator may allow http explicitly; ext:: can never be allowed.
    let mut command = fixture.command();
    command.env("FORGEPOOL_ALLOWED_URL_SCHEMES", "https,ext");
    command.args(["run", "x.toml"]);
    let outcome = fixture.outcome(command);
    assert_eq!(outcome.code, 2, "{}", outcome.printed());
    assert!(
        outcome.stderr.contains("FORGEPOOL_ALLOWED_URL_SCHEMES"),
        "{}",
        outcome.printed()
    );
}

#[test]
fn a_bridge_network_needs_the_operators_permission() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let agents = std::fs::read_to_string(&fixture.agents)
        .unwrap()
        .replace("[agents.impl]\n", "[agents.impl]\nnetwork = \"bridge\"\n");
    std::fs::write(&fixture.agents, agents).unwrap();
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    assert!(
        outcome.stdout.contains("FORGEPOOL_ALLOW_BRIDGE_NETWORK"),
        "{}",
        outcome.printed()
    );
    assert!(outcome
        .events
        .iter()
        .all(|e| !matches!(e.kind, EventKind::StageStarted { .. })));
}

#[test]
fn root_users_and_forgepools_own_variables_are_refused_in_agents_files() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let original = std::fs::read_to_string(&fixture.agents).unwrap();
    for (change, named) in [
        ("[agents.impl]\nuser = \"0:0\"\n", "agents.impl.user"),
        ("[agents.impl]\nuser = \"root\"\n", "agents.impl.user"),
        (
            "[agents.impl]\nenv = [\"FORGEPOOL_JOB_KEY\"]\n",
            "agents.impl.env",
        ),
    ] {
        let agents = original
            .replace("env = [\"AGENT_SECRET\"]\n", "")
            .replace("[agents.impl]\n", change);
        std::fs::write(&fixture.agents, agents).unwrap();
        let outcome = fixture.run("");
        assert_eq!(outcome.code, 2, "{change}: {}", outcome.printed());
        assert!(
            outcome.stderr.contains(named),
            "{change}: {}",
            outcome.printed()
        );
    }
}

#[test]
fn help_never_prints_a_secret_from_the_environment() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    for command in [
        ["run", "--help"],
        ["dispatcher", "--help"],
        ["worker", "--help"],
    ] {
        let output = common::output_within(
            fixture
                .command()
                .args(command)
                .env(
                    "FORGEPOOL_DATABASE_URL",
                    "postgres://u:hunter2-db-password@h/db",
                )
                .env("FORGEPOOL_JOB_KEY", "hunter2-job-key-0123456789")
                .env("FORGEPOOL_API_TOKEN", "hunter2-api-token-0123456789")
                .env("FORGEPOOL_AMQP_URL", "amqp://u:hunter2-amqp@h/%2f"),
            common::COMMAND_LIMIT,
        );
        let text = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{command:?}");
        assert!(
            !text.contains("hunter2"),
            "{command:?} printed a secret:\n{text}"
        );
    }
}

#[test]
fn every_stage_container_is_hardened() {
    let fixture = Fixture::new(Some(&review(1)), &["sleep", "3"], &["sleep", "3"])
        .with_final_reviewer("slow-approve");
    let watched = fixture.dir.path().to_string_lossy().to_string();
    let watcher = std::thread::spawn(move || inspect_stage_containers(&watched));
    let outcome = fixture.run(
        "commands = [{ argv = [\"sleep\", \"3\"], timeout = 60 }]\n[assurance]\nreview_agent = \"final\"",
    );
    let seen = watcher.join().unwrap();
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    for stage in ["implement", "verify", "review", "final_review"] {
        let Some(config) = seen.get(stage) else {
            panic!("no {stage} container was seen; saw {:?}", seen.keys());
        };
        let host = &config["HostConfig"];
        assert_eq!(host["CapDrop"], serde_json::json!(["ALL"]), "{stage}");
        assert!(host["CapAdd"].is_null(), "{stage}");
        assert_eq!(
            host["SecurityOpt"],
            serde_json::json!(["no-new-privileges"]),
            "{stage}"
        );
        assert_eq!(host["Privileged"], false, "{stage}");
        assert_eq!(host["ReadonlyRootfs"], true, "{stage}");
        assert!(
            host["Tmpfs"]["/tmp"]
                .as_str()
                .is_some_and(|o| o.contains("size=")),
            "{stage}: {}",
            host["Tmpfs"]
        );
        assert!(host["PidsLimit"].as_i64().is_some_and(|p| p > 0), "{stage}");
        assert!(host["Memory"].as_i64().is_some_and(|m| m > 0), "{stage}");
        assert!(host["NanoCpus"].as_i64().is_some_and(|c| c > 0), "{stage}");
        let ulimits: Vec<&str> = host["Ulimits"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|u| u["Name"].as_str())
            .collect();
        for name in ["nofile", "nproc", "fsize", "core"] {
            assert!(ulimits.contains(&name), "{stage}: {ulimits:?}");
        }
        assert_eq!(host["NetworkMode"], "none", "{stage}");
        let user = config["Config"]["User"].as_str().unwrap();
        assert!(
            !user.is_empty() && !user.starts_with("0") && !user.starts_with("root"),
            "{stage}: {user}"
        );
        // Only the run's own folders, never the Docker socket or another host path.
        for mount in config["Mounts"].as_array().unwrap() {
            let source = mount["Source"].as_str().unwrap();
            if mount["Type"] == "tmpfs" {
                continue;
            }
            assert!(
                source.starts_with(fixture.dir.path().to_str().unwrap()),
                "{stage}: {source}"
            );
            assert!(!source.contains("docker.sock"), "{stage}: {source}");
            assert!(
                !source.ends_with("repo.git"),
                "{stage}: the private git folder is mounted"
            );
        }
        let env: Vec<&str> = config["Config"]["Env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e.as_str())
            .collect();
        assert!(
            env.iter().all(|e| !e.starts_with("FORGEPOOL_")),
            "{stage}: {env:?}"
        );
        if stage != "implement" {
            assert!(
                env.iter().all(|e| !e.contains(SECRET)),
                "{stage}: a secret it was not given"
            );
        }
        let labels = &config["Config"]["Labels"];
        assert_eq!(labels["forgepool.stage"], stage);
        assert!(labels["forgepool.run_id"].is_string() && labels["forgepool.worker"].is_string());
    }
    // The implementer's workspace is writable, the reviewers' copies are not.
    let workspace = |stage: &str| {
        seen[stage]["Mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["Destination"] == "/workspace")
            .map(|m| m["RW"].as_bool().unwrap())
            .unwrap()
    };
    assert!(workspace("implement") && workspace("verify"));
    assert!(!workspace("review") && !workspace("final_review"));
}

/// Replaces the implementer's arguments in the fixture's agents file.
fn rewrite_implementer(fixture: &Fixture, args: &[&str]) {
    let text = std::fs::read_to_string(&fixture.agents).unwrap();
    let quoted: Vec<String> = args.iter().map(|a| format!("{a:?}")).collect();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    for line in &mut lines {
        if line.starts_with("command = [\"/bin/sh\", \"/agents/implementer.sh\"") {
            *line = format!(
                "command = [\"/bin/sh\", \"/agents/implementer.sh\", {}]",
                quoted.join(", ")
            );
        }
    }
    std::fs::write(&fixture.agents, lines.join("\n") + "\n").unwrap();
}

/// The log bytes the review stage stored.
fn review_log_bytes(outcome: &Outcome) -> usize {
    outcome
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Log {
                stage: Stage::Review,
                text,
                ..
            } => Some(text.len()),
            _ => None,
        })
        .sum()
}

/// Starts `forgepool run` on the fixture's default request with its output piped.
fn spawn_run(fixture: &Fixture) -> std::process::Child {
    let file = fixture.dir.path().join("request.toml");
    std::fs::write(
        &file,
        format!(
            "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n[repository]\nurl = \"file://{}\"\nref = \"main\"\n",
            fixture.bare.display()
        ),
    )
    .unwrap();
    let mut command = fixture.command();
    command
        .arg("run")
        .arg(&file)
        .arg("--skills")
        .arg(&fixture.skills)
        .arg("--agents")
        .arg(&fixture.agents)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command.spawn().unwrap()
}

/// Runs the fixture's default request and returns what the user sees and forgepool's peak
/// resident memory in KiB (`VmHWM`, read while it runs).
fn run_measured(fixture: &Fixture) -> (Outcome, u64) {
    let mut child = spawn_run(fixture);
    let status_file = format!("/proc/{}/status", child.id());
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let mut peak = 0;
    let started = Instant::now();
    let status = loop {
        if let Ok(text) = std::fs::read_to_string(&status_file) {
            if let Some(kib) = text
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            {
                peak = peak.max(kib);
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!("the run did not finish within 300 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let outcome = fixture.read_back(
        status.code().unwrap_or(-1),
        out.join().unwrap(),
        err.join().unwrap(),
    );
    (outcome, peak)
}

/// The forgepool containers running now whose mounts lie under `dir`, by stage.
fn inspect_stage_containers_once(dir: &str) -> BTreeMap<String, serde_json::Value> {
    let mut seen = BTreeMap::new();
    collect_stage_containers(dir, &mut seen);
    seen
}

/// Inspects every forgepool container whose mounts lie under `dir` while a run goes on, and
/// returns the first configuration seen of each stage.
fn inspect_stage_containers(dir: &str) -> BTreeMap<String, serde_json::Value> {
    let mut seen = BTreeMap::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(200) {
        collect_stage_containers(dir, &mut seen);
        if seen.len() == 4 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    seen
}

/// Adds the configuration of each running forgepool container under `dir` not seen yet.
fn collect_stage_containers(dir: &str, seen: &mut BTreeMap<String, serde_json::Value>) {
    let listed = common::output_within(
        Command::new("docker").args(["ps", "-q", "--filter", "label=forgepool.managed=true"]),
        common::COMMAND_LIMIT,
    );
    let ids: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .split_whitespace()
        .map(String::from)
        .collect();
    for id in ids {
        let inspected = common::output_within(
            Command::new("docker").args(["inspect", &id]),
            common::COMMAND_LIMIT,
        );
        let Ok(mut configs) = serde_json::from_slice::<Vec<serde_json::Value>>(&inspected.stdout)
        else {
            continue;
        };
        let Some(config) = configs.pop() else {
            continue;
        };
        let ours = config["Mounts"].as_array().is_some_and(|mounts| {
            mounts
                .iter()
                .any(|m| m["Source"].as_str().is_some_and(|s| s.starts_with(dir)))
        });
        if !ours {
            continue;
        }
        if let Some(stage) = config["Config"]["Labels"]["forgepool.stage"].as_str() {
            seen.entry(stage.to_string()).or_insert(config);
        }
    }
}
