//! End-to-end runs of `forgepool run` against a real Docker engine and real git repositories.
//! Start the engine and build the images with `scripts/services.sh && scripts/build-images.sh`.

mod common;

use common::Fixture;
use proto::{EventKind, RunState};

const BRANCH: &str = "forge/test-1";

fn review(max_retries: u32, extra: &str) -> String {
    format!(
        "---\nmax_retries: {max_retries}\n{extra}---\n# Check\nAPPROVED when tests.txt exists.\n"
    )
}

#[test]
fn approved_at_once_is_delivered() {
    let fixture = Fixture::new(Some(&review(3, "")), &["change"], &["approve"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Delivered);
    assert!(
        outcome.stdout.contains("Review cycle 1/3: APPROVED\n"),
        "{}",
        outcome.printed()
    );
    assert_eq!(record.cycles.len(), 1);
    assert_eq!(record.cycles[0].verdict, "approved");
    let result = record.result.as_ref().unwrap();
    assert_eq!(result.branch.as_deref(), Some(BRANCH));
    let commit = common::git(&fixture.bare, &["rev-parse", BRANCH]);
    assert_eq!(Some(commit.trim()), result.commit.as_deref());
    assert_eq!(fixture.branch_file(BRANCH, "feature.txt"), "round 1\n");
    assert_eq!(result.review, "not_requested");
    let states: Vec<RunState> = record.states.iter().map(|s| s.0).collect();
    assert_eq!(
        states,
        [RunState::Queued, RunState::Running, RunState::Delivered]
    );
    outcome.assert_no_containers_left();
}

#[test]
fn rejected_then_approved_feeds_back_feedback_and_history() {
    let fixture = Fixture::new(Some(&review(3, "")), &["change"], &["rules"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    assert!(
        outcome.stdout.contains(
            "Review cycle 1/3: REJECTED - Missing tests for the feature: add tests.txt...\n"
        ),
        "{}",
        outcome.printed()
    );
    assert!(
        outcome.stdout.contains("Review cycle 2/3: APPROVED\n"),
        "{}",
        outcome.printed()
    );
    let record = outcome.record();
    assert_eq!(record.state, RunState::Delivered);
    let verdicts: Vec<&str> = record.cycles.iter().map(|c| c.verdict.as_str()).collect();
    assert_eq!(verdicts, ["rejected", "approved"]);
    // The second round's implementer received the feedback in its prompt and its history.
    let prompt = fixture.branch_file(BRANCH, "received_prompt.md");
    assert!(
        prompt.contains("## Reviewer Feedback\n\nMissing tests for the feature: add tests.txt"),
        "{prompt}"
    );
    let history: serde_json::Value =
        serde_json::from_str(&fixture.branch_file(BRANCH, "received_history.json")).unwrap();
    assert_eq!(history[0]["verdict"], "rejected");
    assert_eq!(
        history[0]["feedback"],
        "Missing tests for the feature: add tests.txt"
    );
    assert_eq!(
        fixture.branch_file(BRANCH, "tests.txt"),
        "tests for the feature\n"
    );
    // The cycle file holds the SPEC 8 fields.
    let first = &record.cycles[0].content;
    for key in [
        "cycle",
        "max_cycles",
        "verdict",
        "feedback",
        "skill",
        "elapsed_seconds",
        "timestamp",
        "run_id",
        "ticket",
        "step",
    ] {
        assert!(first.get(key).is_some(), "cycle file lacks {key}: {first}");
    }
    assert_eq!(first["step"], "implement_task");
    let result = record.result.as_ref().unwrap();
    assert_eq!(result.implementation_rounds, 2);
    // Round 2 wrote into .forge/implement_task/, which the root worker had created for cycle 1:
    // root-owned leftovers did not block it, and none of .forge/ was delivered.
    let files = fixture.branch_files(BRANCH).unwrap();
    assert!(files.iter().all(|f| !f.starts_with(".forge")), "{files:?}");
    outcome.assert_no_containers_left();
}

#[test]
fn exhausted_review_without_blocking_delivers_with_warnings() {
    let fixture = Fixture::new(
        Some(&review(2, "block_on_failure: false\n")),
        &["change"],
        &["reject"],
    );
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::DeliveredWithWarnings);
    assert_eq!(record.cycles.len(), 2);
    assert!(
        outcome
            .stdout
            .contains("Review cycle 2/2: REJECTED - Cycle 2: error handling still missing..."),
        "{}",
        outcome.printed()
    );
    let result = record.result.as_ref().unwrap();
    assert!(
        result.report.contains("## Auto-Review Notes"),
        "{}",
        result.report
    );
    assert!(
        result
            .report
            .contains("Cycle 2: error handling still missing"),
        "{}",
        result.report
    );
    assert!(
        result.warnings.iter().any(|w| w.contains("exhausted")),
        "{:?}",
        result.warnings
    );
    assert!(
        fixture.branch_files(BRANCH).is_some(),
        "the branch was pushed"
    );
    outcome.assert_no_containers_left();
}

#[test]
fn exhausted_review_with_block_on_failure_blocks_and_pushes_nothing() {
    let fixture = Fixture::new(
        Some(&review(2, "block_on_failure: true\n")),
        &["change"],
        &["reject"],
    );
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Blocked);
    assert_eq!(record.cycles.len(), 2);
    assert!(
        fixture.branch_files(BRANCH).is_none(),
        "nothing may be pushed for a blocked run"
    );
    let reason = &record.states.last().unwrap().1;
    assert!(reason.contains("block_on_failure"), "{reason}");
    outcome.assert_no_containers_left();
}

#[test]
fn reviewer_without_marker_is_rejected_as_unparsed() {
    let fixture = Fixture::new(Some(&review(1, "")), &["change"], &["nomarker"]);
    let outcome = fixture.run("");
    let record = outcome.record();
    assert_eq!(record.cycles.len(), 1, "{}", outcome.printed());
    assert_eq!(record.cycles[0].verdict, "rejected");
    assert_eq!(record.cycles[0].feedback, "Verdict could not be parsed");
    assert!(
        outcome
            .stdout
            .contains("Review cycle 1/1: REJECTED - Verdict could not be parsed..."),
        "{}",
        outcome.printed()
    );
    assert_eq!(record.state, RunState::DeliveredWithWarnings);
}

#[test]
fn reviewer_timeout_is_a_rejection_that_says_so() {
    let fixture = Fixture::new(
        Some(&review(1, "timeout_seconds: 2\n")),
        &["change"],
        &["sleep", "40"],
    );
    let started = std::time::Instant::now();
    let outcome = fixture.run("");
    let record = outcome.record();
    assert_eq!(record.cycles.len(), 1, "{}", outcome.printed());
    assert_eq!(record.cycles[0].verdict, "rejected");
    assert!(
        record.cycles[0]
            .feedback
            .contains("timed out after 2 seconds"),
        "{}",
        record.cycles[0].feedback
    );
    assert!(
        started.elapsed().as_secs() < 40,
        "the reviewer was not stopped at its limit"
    );
    let finished = outcome.events.iter().find_map(|e| match &e.kind {
        EventKind::StageFinished {
            stage: proto::Stage::Review,
            outcome,
            ..
        } => Some(*outcome),
        _ => None,
    });
    assert_eq!(finished, Some(proto::StageOutcome::TimedOut));
    outcome.assert_no_containers_left();
}

#[test]
fn implementer_exiting_non_zero_fails_the_run() {
    let fixture = Fixture::new(Some(&review(3, "")), &["fail"], &["approve"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Failed);
    let reason = &record.states.last().unwrap().1;
    assert!(reason.contains("exited with code 3"), "{reason}");
    assert!(
        reason.contains("something broke in the implementer"),
        "{reason}"
    );
    assert!(record.cycles.is_empty());
    assert!(fixture.branch_files(BRANCH).is_none());
    outcome.assert_no_containers_left();
}

#[test]
fn missing_image_gives_a_clear_error() {
    let fixture = Fixture::with_image(
        None,
        &["change"],
        &["approve"],
        "forgepool-no-such-image:missing",
    );
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Failed);
    let reason = &record.states.last().unwrap().1;
    assert!(
        reason.contains("image `forgepool-no-such-image:missing` is not on the Docker engine"),
        "{reason}"
    );
    assert!(
        reason.contains("docker build -t forgepool-no-such-image:missing"),
        "{reason}"
    );
    assert!(
        outcome.stdout.contains("forgepool-no-such-image:missing"),
        "{}",
        outcome.printed()
    );
}

#[test]
fn own_cycle_files_are_collected_even_the_one_written_just_before_exit() {
    let fixture = Fixture::new(None, &["own-cycles"], &["approve"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let record = outcome.record();
    let cycles: Vec<(u32, &str)> = record
        .cycles
        .iter()
        .map(|c| (c.cycle, c.verdict.as_str()))
        .collect();
    assert_eq!(
        cycles,
        [(1, "rejected"), (2, "approved")],
        "{}",
        outcome.printed()
    );
    assert_eq!(record.cycles[1].feedback, "own loop: done");
    assert!(
        outcome
            .stdout
            .contains("Review cycle 1/2: REJECTED - own loop: first try..."),
        "{}",
        outcome.printed()
    );
    assert!(
        outcome.stdout.contains("Review cycle 2/2: APPROVED"),
        "{}",
        outcome.printed()
    );
    let cycle_events = outcome
        .events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Cycle { .. }))
        .count();
    assert_eq!(cycle_events, 2, "each cycle file is published once");
}

#[test]
fn delivered_commits_never_contain_forge_files() {
    let fixture = Fixture::new(Some(&review(3, "")), &["own-cycles"], &["approve"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let files = fixture.branch_files(BRANCH).expect("the branch was pushed");
    assert!(files.contains(&"feature.txt".to_string()), "{files:?}");
    assert!(
        files.iter().all(|f| !f.starts_with(".forge")),
        "delivered files include .forge: {files:?}"
    );
    // The workspace did hold cycle files and the history, written by the container and the worker.
    assert_eq!(outcome.record().cycles.len(), 2);
}

#[test]
fn secrets_never_reach_events_or_the_store() {
    let fixture = Fixture::new(None, &["secret"], &["approve"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let everything = serde_json::to_string(&outcome.events).unwrap();
    assert!(
        !everything.contains("sk-test-0123456789abcdef"),
        "a secret leaked into events"
    );
    assert!(
        everything.contains("my key is [REDACTED]"),
        "the log line was not captured: {everything}"
    );
    assert!(
        !outcome.stdout.contains("sk-test-0123456789abcdef")
            && !outcome.stderr.contains("sk-test-0123456789abcdef")
    );
    let job = serde_json::to_string(&outcome.record().job).unwrap();
    assert!(job.contains("AGENT_SECRET") && !job.contains("sk-test-0123456789abcdef"));
}

#[test]
fn bad_input_is_refused_with_the_field_named() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let outcome = fixture.run_request("ticket = \"not a ticket\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"file:///x\"\n");
    assert_eq!(outcome.code, 2, "{}", outcome.printed());
    assert!(
        outcome
            .stderr
            .contains("ticket: must match ^[A-Za-z][A-Za-z0-9_]*-[0-9]+$"),
        "{}",
        outcome.printed()
    );
    let outcome = fixture.run_request(
        "ticket = \"A-1\"\nskill = \"nope\"\nbrief = \"b\"\n[repository]\nurl = \"file:///x\"\n",
    );
    assert_eq!(outcome.code, 2, "{}", outcome.printed());
    assert!(
        outcome.stderr.contains("unknown skill `nope`"),
        "{}",
        outcome.printed()
    );
}

/// A check that fails (with a timestamp in its output) until `fixed.txt` exists.
const NEEDS_FIX: &str = "[[commands]]\nargv = [\"sh\", \"-c\", \"test -f fixed.txt || { echo \\\"fixed.txt missing at $(date +%s%N)\\\"; exit 4; }\"]\ntimeout = 30\n";

#[test]
fn failed_checks_start_a_repair_round_with_the_failures() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let outcome = fixture.run(&format!("repair_attempts = 1\n{NEEDS_FIX}"));
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let prompt = fixture.branch_file(BRANCH, "received_prompt.md");
    assert!(prompt.contains("## Failed Checks"), "{prompt}");
    assert!(
        prompt.contains("exited with code 4") && prompt.contains("fixed.txt missing"),
        "{prompt}"
    );
    let result = outcome.record().result.clone().unwrap();
    assert_eq!((result.repair_budget, result.implementation_rounds), (1, 2));
    assert_eq!(result.repair_history[0].failing[0].1, Some(4));
    assert!(result.repair_history[1].failing.is_empty());
    assert!(
        outcome.stdout.contains("exit 4") && outcome.stdout.contains("exit 0"),
        "{}",
        outcome.printed()
    );
}

#[test]
fn repair_budget_zero_blocks_after_the_first_failure() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let outcome = fixture.run(&format!("repair_attempts = 0\n{NEEDS_FIX}"));
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Blocked);
    assert!(
        record
            .states
            .last()
            .unwrap()
            .1
            .contains("repair budget of 0"),
        "{:?}",
        record.states
    );
    assert_eq!(record.result.as_ref().unwrap().implementation_rounds, 1);
    assert!(fixture.branch_files(BRANCH).is_none());
}

#[test]
fn no_progress_guard_stops_the_same_tree_failing_the_same_way() {
    let fixture = Fixture::new(None, &["same"], &["approve"]);
    let outcome = fixture.run(&format!("repair_attempts = 3\n{NEEDS_FIX}"));
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    assert!(
        record.states.last().unwrap().1.contains("no progress"),
        "{:?}",
        record.states
    );
    let result = record.result.as_ref().unwrap();
    assert_eq!(
        result.implementation_rounds, 2,
        "the guard trips after two identical rounds, not after the budget"
    );
    assert_eq!(result.repair_history[0].tree, result.repair_history[1].tree);
    outcome.assert_no_containers_left();
}

/// A check that passes once feature.txt has `n` lines (one per implementation round), with a
/// timestamp in its failure output.
fn needs_rounds(n: u32) -> String {
    format!("[[commands]]\nargv = [\"sh\", \"-c\", \"test $(wc -l < feature.txt) -ge {n} || {{ echo \\\"too few rounds at $(date +%s%N)\\\"; exit 5; }}\"]\ntimeout = 30\n")
}

#[test]
fn repair_budget_three_allows_three_repairs() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let outcome = fixture.run(&format!("repair_attempts = 3\n{}", needs_rounds(4)));
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let result = outcome.record().result.clone().unwrap();
    assert_eq!((result.repair_budget, result.implementation_rounds), (3, 4));
    let reasons: Vec<&str> = result
        .repair_history
        .iter()
        .map(|r| r.reason.as_str())
        .collect();
    assert_eq!(reasons, ["initial", "repair", "repair", "repair"]);
    assert!(
        result.repair_history[3].failing.is_empty(),
        "the fourth round passes"
    );
    assert_eq!(
        fixture.branch_file(BRANCH, "feature.txt").lines().count(),
        4
    );
}

#[test]
fn a_changing_tree_does_not_trip_the_guard_and_budget_three_is_spent() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let outcome = fixture.run(&format!("repair_attempts = 3\n{}", needs_rounds(9)));
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    let reason = &record.states.last().unwrap().1;
    assert!(reason.contains("repair budget of 3 is spent"), "{reason}");
    let result = record.result.as_ref().unwrap();
    assert_eq!(
        result.implementation_rounds, 4,
        "one round plus three repairs"
    );
    let trees: std::collections::HashSet<&str> = result
        .repair_history
        .iter()
        .map(|r| r.tree.as_str())
        .collect();
    assert_eq!(
        trees.len(),
        4,
        "every round left a new tree, so the guard never tripped"
    );
    assert!(result.repair_history.iter().all(|r| r.failing
        == [(
            vec![
                "sh".to_string(),
                "-c".to_string(),
                result.repair_history[0].failing[0].0[2].clone()
            ],
            Some(5)
        )]));
    assert!(fixture.branch_files(BRANCH).is_none());
}

#[test]
fn containers_left_by_a_killed_run_are_removed_on_start() {
    common::require_docker();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string();
    let orphan_run = uuid::Uuid::new_v4().to_string();
    // A container as a killed `forgepool run` leaves it: our labels, a process that is gone.
    let started = common::output_within(
        std::process::Command::new("docker")
            .args([
                "run",
                "-d",
                "--label",
                "forgepool.managed=true",
                "--label",
                "forgepool.worker=embedded",
            ])
            .args([
                "--label",
                "forgepool.instance=dead-instance",
                "--label",
                "forgepool.pid=4194303",
            ])
            .args([
                "--label",
                &format!("forgepool.host={host}"),
                "--label",
                &format!("forgepool.run_id={orphan_run}"),
            ])
            .args([common::TEST_IMAGE, "sleep", "600"]),
        common::COMMAND_LIMIT,
    );
    assert!(
        started.status.success(),
        "{}",
        String::from_utf8_lossy(&started.stderr)
    );
    // A container of another worker must be left alone.
    let foreign_run = uuid::Uuid::new_v4().to_string();
    let foreign = common::output_within(
        std::process::Command::new("docker")
            .args([
                "run",
                "-d",
                "--label",
                "forgepool.managed=true",
                "--label",
                "forgepool.worker=someone-else",
            ])
            .args([
                "--label",
                &format!("forgepool.run_id={foreign_run}"),
                common::TEST_IMAGE,
                "sleep",
                "600",
            ]),
        common::COMMAND_LIMIT,
    );
    let foreign_id = String::from_utf8_lossy(&foreign.stdout).trim().to_string();
    // Whatever happens below, the foreign container goes.
    struct Remove(String);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::process::Command::new("docker")
                .args(["rm", "-f", &self.0])
                .output();
        }
    }
    let _foreign = Remove(foreign_id.clone());

    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let outcome = fixture.run("");
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let list = |run: &str| {
        let output = common::output_within(
            std::process::Command::new("docker").args([
                "ps",
                "-aq",
                "--filter",
                &format!("label=forgepool.run_id={run}"),
            ]),
            common::COMMAND_LIMIT,
        );
        String::from_utf8_lossy(&output.stdout).trim().to_string()
    };
    let orphan_left = list(&orphan_run);
    let foreign_left = list(&foreign_run);
    assert!(
        orphan_left.is_empty(),
        "the orphan of a killed run was not removed"
    );
    assert!(
        !foreign_left.is_empty(),
        "another worker's container was removed"
    );
}

#[test]
fn unreachable_docker_engine_says_what_to_do() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let request = fixture.dir.path().join("request.toml");
    std::fs::write(
        &request,
        format!(
            "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"file://{}\"\n",
            fixture.bare.display()
        ),
    )
    .unwrap();
    let output = common::output_within(
        std::process::Command::new(env!("CARGO_BIN_EXE_forgepool"))
            .arg("run")
            .arg(&request)
            .arg("--skills")
            .arg(&fixture.skills)
            .arg("--agents")
            .arg(&fixture.agents)
            .arg("--database")
            .arg(fixture.dir.path().join("runs.db"))
            .env("DOCKER_HOST", "unix:///nonexistent/docker.sock"),
        common::COMMAND_LIMIT,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot reach the Docker engine at unix:///nonexistent/docker.sock"),
        "{stderr}"
    );
    assert!(stderr.contains("start it"), "{stderr}");
}

/// Request lines that ask for the independent final review by the profile `final`.
const FINAL_REVIEW: &str = "[assurance]\nreview_agent = \"final\"\n";

#[test]
fn final_review_approved_is_delivered_and_recorded() {
    let fixture = Fixture::new(None, &["change"], &["approve"]).with_final_reviewer("approve");
    let outcome = fixture.run(FINAL_REVIEW);
    assert_eq!(outcome.code, 0, "{}", outcome.printed());
    let result = outcome.record().result.clone().unwrap();
    assert_eq!(result.review, "approved");
    assert!(
        result.report.contains("Verdict: **approved**"),
        "{}",
        result.report
    );
    assert!(fixture.branch_files(BRANCH).is_some());
    outcome.assert_no_containers_left();
}

#[test]
fn final_review_changes_required_blocks_without_another_repair() {
    let fixture = Fixture::new(None, &["change"], &["approve"]).with_final_reviewer("changes");
    let outcome = fixture.run(&format!("repair_attempts = 3\n{FINAL_REVIEW}"));
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Blocked);
    let result = record.result.as_ref().unwrap();
    assert_eq!(result.review, "changes_required");
    assert_eq!(
        result.implementation_rounds, 1,
        "changes_required starts no repair round"
    );
    assert!(
        result.report.contains("`feature.txt:1`"),
        "{}",
        result.report
    );
    assert!(
        fixture.branch_files(BRANCH).is_none(),
        "nothing is delivered"
    );
}

#[test]
fn final_review_with_a_fabricated_path_is_refused() {
    assert_final_review_refused("fabricated", "src/invented.py");
}

#[test]
fn final_review_output_folder_must_hold_only_review_json() {
    assert_final_review_refused("extra-file", "also holds: notes.txt");
}

/// Runs a final reviewer in `mode` and checks its report is refused for `cause`: the run ends
/// blocked with the cause in its reason, the review is recorded as refused, nothing is pushed.
fn assert_final_review_refused(mode: &str, cause: &str) {
    let fixture = Fixture::new(None, &["change"], &["approve"]).with_final_reviewer(mode);
    let outcome = fixture.run(FINAL_REVIEW);
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    assert_eq!(record.state, RunState::Blocked);
    let reason = &record.states.last().unwrap().1;
    assert!(
        reason.contains("report was refused") && reason.contains(cause),
        "{mode}: expected the reason to name {cause:?}: {reason}"
    );
    let result = record.result.as_ref().unwrap();
    assert_eq!(result.review, "refused");
    assert_eq!(result.implementation_rounds, 1, "no repair round follows");
    assert!(
        fixture.branch_files(BRANCH).is_none(),
        "nothing is delivered"
    );
    outcome.assert_no_containers_left();
}

#[test]
fn final_review_citing_a_line_that_does_not_exist_is_refused() {
    assert_final_review_refused("no-line", "line 99");
}

#[test]
fn final_review_with_evidence_not_in_the_file_is_refused() {
    assert_final_review_refused("no-evidence", "evidence");
}

#[test]
fn final_review_approving_with_a_high_finding_is_refused() {
    assert_final_review_refused("approved-high", "high");
}

#[test]
fn final_review_requiring_changes_without_findings_is_refused() {
    assert_final_review_refused("no-findings", "no finding");
}

#[test]
fn final_review_with_more_than_30_findings_is_refused() {
    assert_final_review_refused("too-many", "31 findings");
}

#[test]
fn an_oversized_final_review_report_is_refused() {
    assert_final_review_refused("oversized", "over the limit of 262144");
}

#[test]
fn a_symlink_in_the_final_review_output_is_refused() {
    assert_final_review_refused("symlink", "feature-link");
}

#[test]
fn a_final_review_report_with_credential_like_content_is_refused() {
    assert_final_review_refused("credential", "credential-like");
}

#[test]
fn a_final_review_whose_source_copy_changed_is_refused() {
    // The copy is mounted read-only, so the reviewer itself cannot change it; here another
    // process on the host does, while the reviewer runs. The report must not be trusted.
    let fixture = Fixture::new(None, &["change"], &["approve"]).with_final_reviewer("slow-approve");
    let workspaces = fixture.dir.path().join("workspaces");
    let tamper = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while std::time::Instant::now() < deadline {
            let copies = std::fs::read_dir(&workspaces)
                .into_iter()
                .flatten()
                .flatten()
                .map(|run| run.path().join("final-review/feature.txt"))
                .filter(|file| file.exists())
                .collect::<Vec<_>>();
            if let Some(file) = copies.first() {
                std::thread::sleep(std::time::Duration::from_millis(500));
                let mut text = std::fs::read_to_string(file).unwrap();
                text.push_str("tampered\n");
                std::fs::write(file, text).unwrap();
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        false
    });
    let outcome = fixture.run(FINAL_REVIEW);
    assert!(
        tamper.join().unwrap(),
        "the final review copy never appeared"
    );
    assert_eq!(outcome.code, 3, "{}", outcome.printed());
    let record = outcome.record();
    let reason = &record.states.last().unwrap().1;
    assert!(
        reason.contains("report was refused") && reason.contains("source copy"),
        "{reason}"
    );
    assert_eq!(record.result.as_ref().unwrap().review, "refused");
    assert!(fixture.branch_files(BRANCH).is_none());
}

/// Lets the implementer profile see `PROVIDER_READY`, the switch of the `pause-at` agent.
fn pass_provider_switch(fixture: &Fixture) {
    let agents = std::fs::read_to_string(&fixture.agents).unwrap();
    let agents = agents.replacen(
        "env = [\"AGENT_SECRET\"]",
        "env = [\"AGENT_SECRET\", \"PROVIDER_READY\"]",
        1,
    );
    std::fs::write(&fixture.agents, agents).unwrap();
}

#[test]
fn a_paused_run_resumes_where_it_stopped_with_its_frozen_budget() {
    // Round 1 is implemented and rejected; the provider pauses round 2.
    let fixture = Fixture::new(Some(&review(2, "")), &["pause-at", "2"], &["rules"]);
    pass_provider_switch(&fixture);
    let paused = fixture.run("repair_attempts = 1\n");
    assert_eq!(paused.code, 75, "{}", paused.printed());
    let record = paused.record();
    assert_eq!(record.state, RunState::Paused);
    let reason = &record.states.last().unwrap().1;
    assert!(
        reason.contains("429 rate limited") && reason.contains("forgepool resume"),
        "the reason says what happened and what to do: {reason}"
    );
    let result = record.result.as_ref().unwrap();
    assert_eq!(
        result.implementation_rounds, 1,
        "the paused round was not spent"
    );
    assert!(paused
        .events
        .iter()
        .any(|e| matches!(e.kind, proto::EventKind::Checkpoint { .. })));
    assert!(
        paused.stdout.contains("Progress saved (checkpoint 1"),
        "{}",
        paused.printed()
    );

    // The provider is back, and someone raised the repair budget in the environment.
    let run_id = paused.run_id.unwrap().to_string();
    let mut resume = fixture.command();
    resume
        .args(["resume", &run_id, "--local"])
        .env("PROVIDER_READY", "yes")
        .env("FORGE_REPAIR_ATTEMPTS", "3");
    let resumed = fixture.outcome(resume);
    assert_eq!(resumed.code, 0, "{}", resumed.printed());
    assert!(
        resumed.stdout.contains("resumed from checkpoint 1")
            && resumed.stdout.contains("Review cycle 2/2: APPROVED"),
        "{}",
        resumed.printed()
    );
    let record = resumed.record();
    assert_eq!(record.state, RunState::Delivered);
    let states: Vec<RunState> = record.states.iter().map(|s| s.0).collect();
    assert_eq!(
        states,
        [
            RunState::Queued,
            RunState::Running,
            RunState::Paused,
            RunState::Queued,
            RunState::Running,
            RunState::Delivered
        ]
    );
    let result = record.result.as_ref().unwrap();
    assert_eq!(
        result.repair_budget, 1,
        "a resume never raises the frozen budget"
    );
    assert_eq!(result.implementation_rounds, 2);
    assert_eq!(record.cycles.len(), 2, "cycle 1 was kept, cycle 2 added");
    // Round 1's change came back from the checkpoint; the paused round's partial work did not.
    assert_eq!(
        fixture.branch_file(BRANCH, "feature.txt").trim_end(),
        "round 1\nround 2"
    );
    let files = fixture.branch_files(BRANCH).unwrap();
    assert!(files.contains(&"tests.txt".to_string()), "{files:?}");
    assert!(!files.contains(&"partial.txt".to_string()), "{files:?}");
    let prompt = fixture.branch_file(BRANCH, "received_prompt.md");
    assert!(prompt.contains("## Reviewer Feedback"), "{prompt}");
    resumed.assert_no_containers_left();

    // A run that is not paused cannot be resumed.
    let mut again = fixture.command();
    again.args(["resume", &run_id, "--local"]);
    let refused = fixture.outcome(again);
    assert_eq!(refused.code, 2);
    assert!(
        refused.stderr.contains("is delivered, not paused"),
        "{}",
        refused.stderr
    );
}

/// A provider that never recovers: each pause asks for 1 s, and `forgepool run` waits them
/// out (each wait at least twice the last) until the next would pass `FORGEPOOL_PAUSE_WAIT`
/// (4 s in all), then exits 75 printing how to resume.
/// Catches: a command that resumes forever against a provider that never recovers (28 cycles
/// in 14 minutes), a bound applied to each pause instead of all of them, waits that never
/// grow.
#[test]
fn a_run_stops_waiting_at_its_pause_allowance_and_exits_75() {
    let fixture = Fixture::new(None, &["pause-for", "1"], &["approve"]);
    let outcome = fixture.run_with("", &[("FORGEPOOL_PAUSE_WAIT", "4")]);
    assert_eq!(outcome.code, 75, "{}", outcome.printed());
    let starts = outcome
        .events
        .iter()
        .filter(|e| {
            matches!(
                e.kind,
                EventKind::StageStarted {
                    stage: proto::Stage::Implement,
                    ..
                }
            )
        })
        .count();
    // The waits it took, as it printed them: each at least twice the one before, all within
    // the allowance, and one resume per wait.
    let waits: Vec<u64> = outcome
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("Paused: resuming in "))
        .filter_map(|rest| rest.split(' ').next()?.parse().ok())
        .collect();
    assert!(!waits.is_empty(), "it never waited\n{}", outcome.printed());
    assert!(
        waits.windows(2).all(|w| w[1] >= 2 * w[0]),
        "waits that do not grow: {waits:?}"
    );
    assert!(
        waits.iter().sum::<u64>() <= 4,
        "waited past the allowance: {waits:?}"
    );
    assert_eq!(
        starts,
        waits.len() + 1,
        "one resume per wait\n{}",
        outcome.printed()
    );
    assert!(
        outcome.stdout.contains("FORGEPOOL_PAUSE_WAIT")
            && outcome.stdout.contains("forgepool resume"),
        "{}",
        outcome.printed()
    );
    assert_eq!(outcome.record().state, RunState::Paused);
}

/// `forgepool run` under `timeout 8` while it waits out a long pause: SIGTERM cancels the run
/// at once and the command exits 1.
/// Catches: SIGTERM ignored while the command waits (only SIGINT stopped it), a paused run left
/// paused when its command was stopped.
#[test]
fn sigterm_during_a_pause_cancels_the_run() {
    let fixture = Fixture::new(None, &["pause-for", "600"], &["approve"]);
    let file = fixture.dir.path().join("request.toml");
    std::fs::write(
        &file,
        format!(
            "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n[repository]\nurl = \"file://{}\"\nref = \"main\"\n",
            fixture.bare.display()
        ),
    )
    .unwrap();
    let command = fixture.command();
    let binary = command.get_program().to_os_string();
    let mut timed = std::process::Command::new("timeout");
    timed
        .args(["--preserve-status", "-s", "TERM", "-k", "20", "8"])
        .arg(binary)
        .arg("run")
        .arg(&file)
        .arg("--skills")
        .arg(&fixture.skills)
        .arg("--agents")
        .arg(&fixture.agents)
        .envs(command.get_envs().filter_map(|(k, v)| Some((k, v?))))
        .env("FORGEPOOL_PAUSE_WAIT", "900");
    for (name, _) in command.get_envs().filter(|(_, v)| v.is_none()) {
        timed.env_remove(name);
    }
    let outcome = fixture.outcome(timed);
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    assert!(
        outcome.stdout.contains("Run cancelled"),
        "{}",
        outcome.printed()
    );
    assert_eq!(
        outcome.record().state,
        RunState::Cancelled,
        "{}",
        outcome.printed()
    );
}
