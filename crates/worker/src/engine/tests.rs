//! The engine against the scripted [`FakeRuntime`], on a paused clock: every phase's
//! mapping from a stage's exit to the machine's input, with a real git repository and no
//! Docker. Each test names the bug it catches.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use proto::{Event, EventKind, Job, RunResult, RunState, Stage, StageOutcome};
use tokio_util::sync::CancellationToken;

use super::{Engine, EngineConfig, Execution, RunControl, EXIT_PAUSED};
use crate::ports::gate::{Admission, LocalGate, ProfileGate, Role};
use crate::ports::ledger::{MemoryLedger, ReviewLedger};
use crate::ports::sink::{EventSink, PublishEvent};
use crate::runtime::fake::{Act, FakeRuntime};

const BRANCH: &str = "forge/shop-1";

/// Collects every event of a run.
#[derive(Debug, Default)]
struct Events(Mutex<Vec<Event>>);

impl EventSink for Events {
    async fn publish(&self, event: Event) -> Result<(), PublishEvent> {
        self.0.lock().unwrap().push(event);
        Ok(())
    }
}

/// A bare origin repository with one commit on `main`, and a workspace root.
struct Bench {
    dir: tempfile::TempDir,
    /// The ledger every execution of the bench's runs shares, as workers share the broker's.
    ledger: MemoryLedger,
    /// The profile gate every execution shares, as workers share the broker's caps and pauses.
    gate: std::sync::Arc<LocalGate>,
}

fn git(dir: &Path, args: &[&str]) -> String {
    let output = std::process::Command::new("git")
        .args(["-c", "user.name=t", "-c", "user.email=t@example.com"])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("git runs");
    assert!(output.status.success(), "git {args:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout).to_string()
}

impl Bench {
    fn new() -> Bench {
        let dir = tempfile::tempdir().unwrap();
        let seed = dir.path().join("seed");
        std::fs::create_dir(&seed).unwrap();
        git(&seed, &["init", "-q", "-b", "main"]);
        std::fs::write(seed.join("README.md"), "shop\n").unwrap();
        git(&seed, &["add", "."]);
        git(&seed, &["commit", "-q", "-m", "seed"]);
        git(dir.path(), &["clone", "-q", "--bare", "seed", "origin.git"]);
        // A server-side hook logs every ref update the origin made, so a second push is
        // counted even when it rewrites the branch.
        let hook = dir.path().join("origin.git/hooks/post-receive");
        let log = dir.path().join("pushes.log");
        std::fs::write(
            &hook,
            format!("#!/bin/sh\nwhile read old new reference; do echo \"$reference $old $new\" >> '{}'; done\n", log.display()),
        )
        .unwrap();
        std::process::Command::new("chmod")
            .args(["755", &hook.display().to_string()])
            .status()
            .unwrap();
        Bench {
            dir,
            ledger: MemoryLedger::default(),
            gate: Default::default(),
        }
    }

    /// Every ref update the origin took: `ref old new`.
    fn pushes(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("pushes.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn origin(&self) -> PathBuf {
        self.dir.path().join("origin.git")
    }

    /// A file of the delivered branch; `None` when nothing was pushed.
    fn delivered(&self, path: &str) -> Option<String> {
        let output = std::process::Command::new("git")
            .args(["show", &format!("{BRANCH}:{path}")])
            .current_dir(self.origin())
            .output()
            .unwrap();
        output
            .status
            .success()
            .then(|| String::from_utf8_lossy(&output.stdout).to_string())
    }

    fn job(&self, review: Option<(u32, bool)>, commands: &[(&str, u64)], budget: u32) -> Job {
        let profile = |name: &str| {
            serde_json::json!({"name": name, "image": "agent:fake", "command": [], "env": [],
                "network": "none", "memory_bytes": 1u64 << 30, "cpus": 1.0,
                "timeout_seconds": 1800, "user": null})
        };
        let review = review.map(|(max_cycles, block_on_failure)| {
            serde_json::json!({"source": "skills/x/review.md", "instructions": "Review it.",
                "max_cycles": max_cycles, "block_on_failure": block_on_failure,
                "timeout_seconds": 600})
        });
        let commands: Vec<_> = commands
            .iter()
            .map(|(name, timeout)| serde_json::json!({"argv": [name], "timeout": timeout}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "schema_version": proto::SCHEMA_VERSION, "run_id": uuid::Uuid::new_v4(),
            "ticket": "SHOP-1", "project": "shop", "skill": "implement-task",
            "step": "implement_task", "brief": "Add the feature.",
            "repository": {"url": format!("file://{}", self.origin().display())},
            "commands": commands, "skill_md": "Implement it.",
            "reviewer": review.as_ref().map(|_| profile("reviewer")), "review": review,
            "repair_budget": budget, "implementer": profile("implementer"),
            "final_reviewer": null, "warnings": [],
            "submitted_at": "2026-12-03T12:00:00Z"
        }))
        .expect("a valid job")
    }

    /// Runs `job` to its end on `runtime`.
    async fn run(&self, runtime: FakeRuntime, job: &Job) -> Outcome {
        self.run_with(runtime, job, CancellationToken::new()).await
    }

    /// Runs `job` as a job the broker delivered again.
    async fn run_again(&self, runtime: FakeRuntime, job: &Job) -> Outcome {
        self.execute("again", runtime, job, CancellationToken::new(), true)
            .await
    }

    /// Runs `job` as a worker whose workspaces are under `root` would.
    async fn run_on(&self, root: &str, runtime: FakeRuntime, job: &Job) -> Outcome {
        self.execute(root, runtime, job, CancellationToken::new(), false)
            .await
    }

    /// Runs a copy of the job that may follow an earlier execution (a hand-over's copy).
    async fn run_again_on(&self, root: &str, runtime: FakeRuntime, job: &Job) -> Outcome {
        self.execute(root, runtime, job, CancellationToken::new(), true)
            .await
    }

    async fn run_with(
        &self,
        runtime: FakeRuntime,
        job: &Job,
        cancel: CancellationToken,
    ) -> Outcome {
        self.execute("runs", runtime, job, cancel, false).await
    }

    async fn execute(
        &self,
        root: &str,
        runtime: FakeRuntime,
        job: &Job,
        cancel: CancellationToken,
        again: bool,
    ) -> Outcome {
        let (execution, events, runtime) = self.pooled(root, runtime, job, cancel, again).await;
        let Execution::Ended(result) = execution else {
            panic!("the run is not interrupted, and waits for nothing: {execution:?}");
        };
        Outcome {
            result: *result,
            events,
            runtime,
        }
    }

    /// Executes `job` as a pool's worker does: the execution, its events and the runtime.
    async fn pooled(
        &self,
        root: &str,
        runtime: FakeRuntime,
        job: &Job,
        cancel: CancellationToken,
        again: bool,
    ) -> (Execution, Vec<Event>, std::sync::Arc<FakeRuntime>) {
        let runtime = std::sync::Arc::new(runtime);
        let mut config = EngineConfig::for_process(self.dir.path().join(root));
        config.can_chown = false;
        config.gate = std::sync::Arc::clone(&self.gate) as std::sync::Arc<dyn ProfileGate>;
        let engine = Engine::new(std::sync::Arc::clone(&runtime), config);
        let events = Events::default();
        let interrupt = CancellationToken::new();
        let control = RunControl {
            cancel,
            interrupt,
            again,
            handover: CancellationToken::new(),
        };
        let execution = engine
            .execute_in_pool(job, &events, &self.ledger, control)
            .await
            .expect("events are published");
        (execution, events.0.into_inner().unwrap(), runtime)
    }
}

struct Outcome {
    result: RunResult,
    events: Vec<Event>,
    runtime: std::sync::Arc<FakeRuntime>,
}

impl Outcome {
    fn reason(&self) -> String {
        self.events
            .iter()
            .rev()
            .find_map(|e| match &e.kind {
                EventKind::State { reason, .. } => Some(reason.clone()),
                _ => None,
            })
            .unwrap_or_default()
    }

    /// Asserts the run's final state, showing its reason when it is another.
    fn assert_state(&self, state: RunState) {
        assert_eq!(self.result.state, state, "{}", self.reason());
    }

    /// Asserts that the final state's reason says each of `parts`.
    fn assert_reason(&self, parts: &[&str]) {
        let reason = self.reason();
        for part in parts {
            assert!(reason.contains(part), "`{part}` is not in: {reason}");
        }
    }

    fn cycles(&self) -> Vec<proto::CycleRecord> {
        self.events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::Cycle { cycle } => Some(cycle.clone()),
                _ => None,
            })
            .collect()
    }

    fn verdicts(&self) -> Vec<String> {
        self.cycles().iter().map(|c| c.verdict.clone()).collect()
    }

    fn outcomes(&self, stage: Stage) -> Vec<StageOutcome> {
        self.events
            .iter()
            .filter_map(|e| match &e.kind {
                EventKind::StageFinished {
                    stage: finished,
                    outcome,
                    ..
                } if *finished == stage => Some(*outcome),
                _ => None,
            })
            .collect()
    }
}

/// Plays a scripted run: each stage kind's acts, on a job with `review` (max cycles and
/// `block_on_failure`), `checks` and a repair `budget`.
async fn play(
    script: Vec<(Stage, Vec<Act>)>,
    review: Option<(u32, bool)>,
    checks: &[(&str, u64)],
    budget: u32,
) -> (Bench, Outcome) {
    let bench = Bench::new();
    let runtime = script
        .into_iter()
        .fold(FakeRuntime::default(), |runtime, (stage, acts)| {
            runtime.with(stage, acts)
        });
    let outcome = bench.run(runtime, &bench.job(review, checks, budget)).await;
    (bench, outcome)
}

fn implements(round: u32) -> Act {
    Act::writes("/workspace/feature.txt", &format!("round {round}\n"))
}

/// Catches: an approving first review that does not deliver, or delivers the wrong tree.
#[tokio::test(start_paused = true)]
async fn an_approval_at_once_delivers_the_implemented_tree() {
    let (bench, outcome) = play(
        vec![
            (Stage::Implement, vec![implements(1)]),
            (
                Stage::Review,
                vec![Act::prints("All criteria pass. APPROVED")],
            ),
        ],
        Some((3, true)),
        &[],
        0,
    )
    .await;
    outcome.assert_state(RunState::Delivered);
    assert_eq!(outcome.verdicts(), ["approved"]);
    assert_eq!(outcome.result.branch.as_deref(), Some(BRANCH));
    assert_eq!(bench.delivered("feature.txt").as_deref(), Some("round 1\n"));
    assert_eq!(outcome.runtime.stages(), ["implement", "review"]);
}

/// Catches: feedback that never reaches the next round, or a loop that stops after a
/// rejection with cycles left.
#[tokio::test(start_paused = true)]
async fn a_rejection_sends_its_feedback_to_the_next_round_which_is_approved() {
    let (bench, outcome) = play(
        vec![
            (Stage::Implement, vec![implements(1), implements(2)]),
            (
                Stage::Review,
                vec![
                    Act::prints("REJECTED\nMissing tests for the feature"),
                    Act::prints("APPROVED"),
                ],
            ),
        ],
        Some((3, true)),
        &[],
        0,
    )
    .await;
    outcome.assert_state(RunState::Delivered);
    assert_eq!(outcome.verdicts(), ["rejected", "approved"]);
    assert_eq!(outcome.result.implementation_rounds, 2);
    assert_eq!(bench.delivered("feature.txt").as_deref(), Some("round 2\n"));
    let prompts = outcome.runtime.prompts();
    assert!(
        prompts[2].contains("## Reviewer Feedback\n\nMissing tests for the feature"),
        "the second round's prompt: {}",
        prompts[2]
    );
    assert!(
        !prompts[0].contains("## Reviewer Feedback"),
        "{}",
        prompts[0]
    );
}

/// Catches: `block_on_failure` ignored (a blocked run that pushes anyway), or an exhausted
/// review without blocking that is not delivered, or delivered without its warning.
#[tokio::test(start_paused = true)]
async fn an_exhausted_review_blocks_or_is_delivered_with_warnings_as_block_on_failure_says() {
    for (block_on_failure, state, delivered) in [
        (true, RunState::Blocked, None),
        (false, RunState::DeliveredWithWarnings, Some("round 2\n")),
    ] {
        let bench = Bench::new();
        let runtime = FakeRuntime::default()
            .with(Stage::Implement, [implements(1), implements(2)])
            .with(Stage::Review, [Act::prints("REJECTED\nstill wrong")]);
        let job = bench.job(Some((2, block_on_failure)), &[], 0);
        let outcome = bench.run(runtime, &job).await;
        assert_eq!(outcome.result.state, state, "{}", outcome.reason());
        assert_eq!(outcome.verdicts(), ["rejected", "rejected"]);
        assert_eq!(bench.delivered("feature.txt").as_deref(), delivered);
        if block_on_failure {
            outcome.assert_reason(&["block_on_failure"]);
        } else {
            let warnings = &outcome.result.warnings;
            assert!(
                warnings.iter().any(|w| w.contains("exhausted")),
                "{warnings:?}"
            );
        }
    }
}

/// Catches: a reviewer past its time limit that is waited on, or a crashing one, counted as
/// an approval. On the paused clock the 600 s limit passes at once.
#[tokio::test(start_paused = true)]
async fn a_reviewer_past_its_limit_or_crashing_is_a_rejection_that_says_so() {
    for (act, says, finished) in [
        (
            Act::Hang,
            "timed out after 600 seconds",
            StageOutcome::TimedOut,
        ),
        (
            Act::exits(9, "reviewer blew up"),
            "exited with code 9",
            StageOutcome::Failed,
        ),
    ] {
        let script = vec![
            (Stage::Implement, vec![implements(1)]),
            (Stage::Review, vec![act]),
        ];
        let (_bench, outcome) = play(script, Some((1, false)), &[], 0).await;
        assert_eq!(outcome.outcomes(Stage::Review), [finished]);
        assert_eq!(outcome.verdicts(), ["rejected"]);
        let feedback = &outcome.cycles()[0].feedback;
        assert!(feedback.contains(says), "{feedback}");
        outcome.assert_state(RunState::DeliveredWithWarnings);
    }
}

/// Catches: an implementer past its time limit that leaves the run hanging or delivered.
#[tokio::test(start_paused = true)]
async fn an_implementer_past_its_time_limit_fails_the_run() {
    let (_bench, outcome) = play(vec![(Stage::Implement, vec![Act::Hang])], None, &[], 0).await;
    outcome.assert_state(RunState::Failed);
    outcome.assert_reason(&["timed out after 1800 s"]);
    assert_eq!(outcome.outcomes(Stage::Implement), [StageOutcome::TimedOut]);
}

/// Catches: a crashing implementer whose output is lost, or whose run goes on to review.
#[tokio::test(start_paused = true)]
async fn a_crashing_implementer_fails_the_run_with_its_last_output() {
    let (_bench, outcome) = play(
        vec![
            (
                Stage::Implement,
                vec![Act::exits(3, "something broke in the implementer")],
            ),
            (Stage::Review, vec![Act::prints("APPROVED")]),
        ],
        Some((3, true)),
        &[],
        0,
    )
    .await;
    outcome.assert_state(RunState::Failed);
    let reason = outcome.reason();
    assert!(reason.contains("exited with code 3"), "{reason}");
    assert!(
        reason.contains("something broke in the implementer"),
        "{reason}"
    );
    assert_eq!(
        outcome.runtime.stages(),
        ["implement"],
        "no review after a crash"
    );
}

/// Catches: a provider pause (exit 75) that fails the run, or pauses it without the
/// checkpoint a resume needs.
#[tokio::test(start_paused = true)]
async fn a_provider_pause_pauses_the_run_with_a_checkpoint() {
    let (_bench, outcome) = play(
        vec![(
            Stage::Implement,
            vec![Act::exits(EXIT_PAUSED, "429 rate limited by the provider")],
        )],
        None,
        &[],
        0,
    )
    .await;
    outcome.assert_state(RunState::Paused);
    outcome.assert_reason(&["forgepool resume"]);
    assert!(
        outcome
            .reason()
            .contains("429 rate limited by the provider"),
        "{}",
        outcome.reason()
    );
    let checkpoints = outcome
        .events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Checkpoint { .. }))
        .count();
    assert_eq!(checkpoints, 1);
    assert_eq!(outcome.outcomes(Stage::Implement), [StageOutcome::Paused]);
}

/// Catches: failed checks that do not start a repair round, or a repair that is not
/// verified again.
#[tokio::test(start_paused = true)]
async fn failed_checks_start_a_repair_round_that_is_verified_again() {
    let (_bench, outcome) = play(
        vec![
            (Stage::Implement, vec![implements(1), implements(2)]),
            (
                Stage::Verify,
                vec![Act::exits(4, "fixed.txt missing"), Act::prints("ok")],
            ),
        ],
        None,
        &[("check", 30)],
        1,
    )
    .await;
    outcome.assert_state(RunState::Delivered);
    assert_eq!(outcome.result.implementation_rounds, 2);
    assert_eq!(outcome.result.repair_history[0].failing[0].1, Some(4));
    assert!(outcome.result.repair_history[1].failing.is_empty());
    assert_eq!(
        outcome.runtime.stages(),
        ["implement", "verify", "implement", "verify"]
    );
}

/// Catches: the no-progress guard not tripping (the budget spent on identical rounds).
#[tokio::test(start_paused = true)]
async fn the_same_tree_failing_the_same_way_twice_trips_the_guard() {
    let (bench, outcome) = play(
        vec![
            (
                Stage::Implement,
                vec![Act::writes("/workspace/feature.txt", "same\n")],
            ),
            (Stage::Verify, vec![Act::exits(5, "too few rounds")]),
        ],
        None,
        &[("check", 30)],
        3,
    )
    .await;
    outcome.assert_state(RunState::Blocked);
    outcome.assert_reason(&["no progress"]);
    assert_eq!(outcome.result.implementation_rounds, 2);
    assert_eq!(bench.delivered("feature.txt"), None);
}

/// Catches: a repair budget that is not enforced.
#[tokio::test(start_paused = true)]
async fn a_repair_budget_of_zero_blocks_after_the_first_failure() {
    let (_bench, outcome) = play(
        vec![
            (Stage::Implement, vec![implements(1)]),
            (Stage::Verify, vec![Act::exits(4, "fixed.txt missing")]),
        ],
        None,
        &[("check", 30)],
        0,
    )
    .await;
    outcome.assert_state(RunState::Blocked);
    outcome.assert_reason(&["repair budget of 0"]);
    assert_eq!(outcome.result.implementation_rounds, 1);
}

/// Catches: a final review whose approval is not recorded, or whose changes_required starts
/// another repair round or delivers.
#[tokio::test(start_paused = true)]
async fn the_final_review_approves_or_blocks_without_another_repair() {
    let report = |verdict: &str, findings: &str| {
        Act::writes(
            "/forge/output/review.json",
            &format!(r#"{{"verdict": "{verdict}", "summary": "s", "findings": [{findings}]}}"#),
        )
    };
    for (verdict, findings, state) in [
        ("approved", "", RunState::Delivered),
        (
            "changes_required",
            r#"{"severity": "high", "path": "feature.txt", "line": 1, "summary": "says round 1", "evidence": "round 1"}"#,
            RunState::Blocked,
        ),
    ] {
        let bench = Bench::new();
        let runtime = FakeRuntime::default()
            .with(Stage::Implement, [implements(1)])
            .with(Stage::FinalReview, [report(verdict, findings)]);
        let mut job = bench.job(None, &[], 3);
        let mut final_reviewer = job.implementer.clone();
        final_reviewer.name = "final".into();
        job.final_reviewer = Some(final_reviewer);
        let outcome = bench.run(runtime, &job).await;
        assert_eq!(
            outcome.result.state,
            state,
            "{verdict}: {}",
            outcome.reason()
        );
        assert_eq!(outcome.result.review, verdict);
        assert_eq!(outcome.result.implementation_rounds, 1, "{verdict}");
        assert_eq!(
            bench.delivered("feature.txt").is_some(),
            state == RunState::Delivered,
            "{verdict}"
        );
    }
}

/// Catches: a user's cancel that does not stop the running stage.
#[tokio::test(start_paused = true)]
async fn a_cancel_stops_the_running_stage_and_ends_the_run_cancelled() {
    let bench = Bench::new();
    let runtime = FakeRuntime::default().with(Stage::Implement, [Act::Hang]);
    let cancel = CancellationToken::new();
    let canceller = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            cancel.cancel();
        })
    };
    let outcome = bench
        .run_with(runtime, &bench.job(None, &[], 0), cancel)
        .await;
    canceller.await.unwrap();
    outcome.assert_state(RunState::Cancelled);
}

/// Catches: a stage whose container cannot be made that leaves the run hanging, or fails it
/// without saying why.
#[tokio::test(start_paused = true)]
async fn a_stage_that_cannot_be_created_fails_the_run_with_the_runtimes_reason() {
    let (_bench, outcome) = play(
        vec![(
            Stage::Implement,
            vec![Act::Unstartable("pull access denied".into())],
        )],
        None,
        &[],
        0,
    )
    .await;
    outcome.assert_state(RunState::Failed);
    let reason = outcome.reason();
    assert!(
        reason.contains("agent:fake") && reason.contains("pull access denied"),
        "{reason}"
    );
    assert!(outcome.runtime.stages().is_empty(), "nothing ran");
}

/// An implementer whose change differs at each execution, so a second execution of a run
/// would make a different commit.
fn nonce() -> Act {
    Act::writes("/workspace/feature.txt", &uuid::Uuid::new_v4().to_string())
}

/// Catches: a run executed again after it delivered (a redelivered job) that runs its stages
/// again and pushes a second commit over the first.
#[tokio::test(start_paused = true)]
async fn a_second_execution_of_a_delivered_run_runs_nothing_and_pushes_nothing() {
    let bench = Bench::new();
    let job = bench.job(None, &[], 0);
    let runtime = || FakeRuntime::default().with(Stage::Implement, [nonce()]);
    let first = bench.run(runtime(), &job).await;
    first.assert_state(RunState::Delivered);
    // The broker delivers the job again (its first worker died after the push).
    let second = bench.run_again(runtime(), &job).await;
    second.assert_state(RunState::Delivered);
    second.assert_reason(&["an earlier execution of this run delivered"]);
    assert_eq!(second.result.commit, first.result.commit);
    assert!(
        second.runtime.stages().is_empty(),
        "{:?}",
        second.runtime.stages()
    );
    assert_eq!(bench.pushes().len(), 1, "{:?}", bench.pushes());
}

/// Catches: two executions of one run at once (a job redelivered while its first worker still
/// runs it) that both push, the second replacing the first's commit.
#[tokio::test(start_paused = true)]
async fn two_executions_of_a_run_at_once_push_one_commit() {
    let bench = Bench::new();
    let job = bench.job(None, &[], 0);
    let runtime = || FakeRuntime::default().with(Stage::Implement, [nonce()]);
    let (first, second) = tokio::join!(
        bench.run_on("worker-1", runtime(), &job),
        bench.run_on("worker-2", runtime(), &job)
    );
    first.assert_state(RunState::Delivered);
    second.assert_state(RunState::Delivered);
    assert_eq!(first.result.commit, second.result.commit);
    assert_eq!(bench.pushes().len(), 1, "{:?}", bench.pushes());
    let message = git(&bench.origin(), &["log", "-1", "--format=%B", BRANCH]);
    assert!(
        message.contains(&format!("Forgepool-Run: {}", job.run_id)),
        "{message}"
    );
}

/// Catches: a newer run of the same ticket that cannot replace a finished run's branch, or
/// replaces it without naming itself.
#[tokio::test(start_paused = true)]
async fn a_newer_run_of_the_ticket_replaces_the_branch_of_a_finished_one() {
    let bench = Bench::new();
    let runtime = || FakeRuntime::default().with(Stage::Implement, [nonce()]);
    let older = bench.job(None, &[], 0);
    let newer = bench.job(None, &[], 0);
    bench
        .run(runtime(), &older)
        .await
        .assert_state(RunState::Delivered);
    let outcome = bench.run(runtime(), &newer).await;
    outcome.assert_state(RunState::Delivered);
    assert_eq!(bench.pushes().len(), 2, "{:?}", bench.pushes());
    let message = git(&bench.origin(), &["log", "-1", "--format=%B", BRANCH]);
    assert!(
        message.contains(&format!("Forgepool-Run: {}", newer.run_id)),
        "{message}"
    );
}

/// Catches: a run whose worker lost its claim (or is draining) that goes on, or publishes an
/// ending another execution would contradict.
#[tokio::test(start_paused = true)]
async fn a_lost_claim_stops_the_stage_and_publishes_no_ending() {
    let bench = Bench::new();
    let job = bench.job(None, &[], 0);
    let runtime = std::sync::Arc::new(FakeRuntime::default().with(Stage::Implement, [Act::Hang]));
    let mut config = EngineConfig::for_process(bench.dir.path().join("runs"));
    config.can_chown = false;
    let engine = Engine::new(std::sync::Arc::clone(&runtime), config);
    let (events, lost) = (Events::default(), CancellationToken::new());
    let losing = {
        let lost = lost.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            lost.cancel();
        })
    };
    let ledger = MemoryLedger::default();
    let ended = engine
        .execute(
            &job,
            &events,
            &ledger,
            RunControl::new(CancellationToken::new(), lost),
        )
        .await
        .expect("events are published");
    losing.await.unwrap();
    assert!(ended.is_none(), "the job is handed back, not ended");
    let events = events.0.into_inner().unwrap();
    let endings: Vec<_> = events
        .iter()
        .filter(|e| match &e.kind {
            EventKind::Result { .. } => true,
            EventKind::State { state, .. } => *state != RunState::Running,
            _ => false,
        })
        .collect();
    assert!(endings.is_empty(), "{endings:?}");
    assert_eq!(runtime.stages(), ["implement"]);
    assert!(bench.delivered("feature.txt").is_none());
}

/// Runs `job` on `runtime` with a drain (`handover`) fired after 60 s; returns whether it
/// ended (and how) or was handed back.
async fn drained_after_a_minute(
    bench: &Bench,
    runtime: std::sync::Arc<FakeRuntime>,
    job: &Job,
) -> (Option<RunResult>, Vec<Event>) {
    let mut config = EngineConfig::for_process(bench.dir.path().join("worker-1"));
    config.can_chown = false;
    let engine = Engine::new(runtime, config);
    let (events, handover) = (Events::default(), CancellationToken::new());
    let draining = {
        let handover = handover.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            handover.cancel();
        })
    };
    let mut control = RunControl::new(CancellationToken::new(), CancellationToken::new());
    control.handover = handover;
    let ended = engine
        .execute(job, &events, &bench.ledger, control)
        .await
        .expect("events are published");
    draining.await.unwrap();
    (ended, events.0.into_inner().unwrap())
}

/// Catches: a drain (scale-in, an upgrade) that stops the stage running and loses its work,
/// lets the run start its next stage instead of handing it back between the two, or hands it
/// back without keeping the stage that just ended (the next worker would implement again).
#[tokio::test(start_paused = true)]
async fn a_drain_lets_the_running_stage_finish_and_hands_the_run_back_before_the_next() {
    let bench = Bench::new();
    let job = bench.job(Some((3, true)), &[("check", 60)], 0);
    let slow = Act::Slow(std::time::Duration::from_secs(120), Box::new(implements(1)));
    let runtime = std::sync::Arc::new(
        FakeRuntime::default()
            .with(Stage::Implement, [slow])
            .with(Stage::Verify, [Act::prints("ok")])
            .with(Stage::Review, [Act::prints("APPROVED")]),
    );
    let (ended, events) =
        drained_after_a_minute(&bench, std::sync::Arc::clone(&runtime), &job).await;
    assert!(ended.is_none(), "handed back: {ended:?}");
    assert_eq!(
        runtime.stages(),
        ["implement"],
        "verification waits for the next worker"
    );
    let finished: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::StageFinished { outcome, .. } => Some(*outcome),
            _ => None,
        })
        .collect();
    assert_eq!(
        finished,
        [StageOutcome::Completed],
        "the implementer was not stopped"
    );
    // The next execution verifies and reviews: the implementation is not repeated.
    let second = bench
        .run_again_on(
            "worker-2",
            FakeRuntime::default()
                .with(Stage::Verify, [Act::prints("ok")])
                .with(Stage::Review, [Act::prints("APPROVED")]),
            &job,
        )
        .await;
    second.assert_state(RunState::Delivered);
    assert_eq!(second.runtime.stages(), ["verify", "review"]);
    assert_eq!(second.result.implementation_rounds, 1);
    assert_eq!(bench.delivered("feature.txt").as_deref(), Some("round 1\n"));
}

/// Catches: a drain during a review that rejects, after which the next worker reviews the
/// same round again (paying for it twice, maybe with another verdict) instead of going on
/// with the reviewer's feedback.
#[tokio::test(start_paused = true)]
async fn a_drain_during_a_rejecting_review_keeps_the_verdict_for_the_next_worker() {
    let bench = Bench::new();
    let job = bench.job(Some((3, true)), &[], 0);
    let slow = Act::Slow(
        std::time::Duration::from_secs(120),
        Box::new(Act::prints("REJECTED\nadd tests")),
    );
    let runtime = std::sync::Arc::new(
        FakeRuntime::default()
            .with(Stage::Implement, [implements(1)])
            .with(Stage::Review, [slow]),
    );
    let (ended, _) = drained_after_a_minute(&bench, std::sync::Arc::clone(&runtime), &job).await;
    assert!(ended.is_none(), "handed back: {ended:?}");
    assert_eq!(runtime.stages(), ["implement", "review"]);
    let second = bench
        .run_again_on(
            "worker-2",
            FakeRuntime::default()
                .with(Stage::Implement, [implements(2)])
                .with(Stage::Review, [Act::prints("APPROVED")]),
            &job,
        )
        .await;
    second.assert_state(RunState::Delivered);
    assert_eq!(second.runtime.stages(), ["implement", "review"]);
    assert!(
        second.runtime.prompts()[0].contains("## Reviewer Feedback\n\nadd tests"),
        "round 2 has cycle 1's feedback: {}",
        second.runtime.prompts()[0]
    );
    assert_eq!(
        second.cycles().iter().map(|c| c.cycle).collect::<Vec<_>>(),
        [2]
    );
}

/// Catches: a drain that hands back a run whose last stage ended in time (only its delivery
/// was left), so another worker runs it again for nothing.
#[tokio::test(start_paused = true)]
async fn a_drain_during_the_last_stage_delivers_the_run_and_hands_nothing_back() {
    let bench = Bench::new();
    let job = bench.job(None, &[], 0);
    let slow = Act::Slow(std::time::Duration::from_secs(120), Box::new(implements(1)));
    let runtime = std::sync::Arc::new(FakeRuntime::default().with(Stage::Implement, [slow]));
    let (ended, _) = drained_after_a_minute(&bench, std::sync::Arc::clone(&runtime), &job).await;
    let result = ended.expect("ended here, not handed back");
    assert_eq!(result.state, RunState::Delivered, "{}", result.reason);
    assert_eq!(runtime.stages(), ["implement"]);
    assert_eq!(bench.pushes().len(), 1);
}

/// Catches: a run handed to another execution (a drain, a lost worker) that starts over from
/// round 1, repeating completed stages and spending its budget again.
#[tokio::test(start_paused = true)]
async fn a_handed_over_run_continues_after_its_last_completed_stage() {
    let bench = Bench::new();
    let job = bench.job(Some((3, true)), &[], 0);
    // The first execution implements, is rejected, and is stopped during round 2.
    let runtime = std::sync::Arc::new(
        FakeRuntime::default()
            .with(Stage::Implement, [implements(1), Act::Hang])
            .with(Stage::Review, [Act::prints("REJECTED\nadd tests")]),
    );
    let mut config = EngineConfig::for_process(bench.dir.path().join("worker-1"));
    config.can_chown = false;
    let engine = Engine::new(std::sync::Arc::clone(&runtime), config);
    let (events, drained) = (Events::default(), CancellationToken::new());
    let draining = {
        let drained = drained.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
            drained.cancel();
        })
    };
    let first = engine
        .execute(
            &job,
            &events,
            &bench.ledger,
            RunControl::new(CancellationToken::new(), drained),
        )
        .await
        .expect("events are published");
    draining.await.unwrap();
    assert!(first.is_none(), "handed back");
    assert_eq!(runtime.stages(), ["implement", "review", "implement"]);

    // The next execution starts with round 2: round 1 and its review are not repeated.
    let second = bench
        .run_again_on(
            "worker-2",
            FakeRuntime::default()
                .with(Stage::Implement, [implements(2)])
                .with(Stage::Review, [Act::prints("APPROVED")]),
            &job,
        )
        .await;
    second.assert_state(RunState::Delivered);
    assert_eq!(second.runtime.stages(), ["implement", "review"]);
    let prompts = second.runtime.prompts();
    assert!(
        prompts[0].contains("## Reviewer Feedback\n\nadd tests"),
        "round 2 has round 1's feedback: {}",
        prompts[0]
    );
    assert_eq!(
        second.cycles().iter().map(|c| c.cycle).collect::<Vec<_>>(),
        [2]
    );
    assert_eq!(
        second.result.implementation_rounds, 2,
        "the budget counts across executions"
    );
    assert_eq!(bench.pushes().len(), 1);
    assert!(
        bench
            .ledger
            .progress(&job.run_id.to_string())
            .await
            .unwrap()
            .is_none(),
        "a finished run's progress is forgotten"
    );
}

/// Catches: a run that overwrites the branch while it holds the delivery of another run that
/// has not finished (it pushed, and its final events are not in yet).
#[tokio::test(start_paused = true)]
async fn the_unfinished_delivery_of_another_run_is_never_overwritten() {
    let bench = Bench::new();
    let runtime = || FakeRuntime::default().with(Stage::Implement, [nonce()]);
    let older = bench.job(None, &[], 0);
    bench
        .run(runtime(), &older)
        .await
        .assert_state(RunState::Delivered);
    // The older run looks unfinished again: it keeps progress (as between its push and its
    // final events).
    let state: proto::LoopState = serde_json::from_value(serde_json::json!({
        "machine": {"phase": {"Deliver": {"tree": "t"}},
            "limits": {"max_cycles": 0, "block_on_failure": false, "repair_budget": 0, "final_review": false},
            "implementation_rounds": 1, "repairs_used": 0, "cycles_used": 0,
            "review_exhausted": false, "last_failure": null},
        "history": [], "rounds": [], "checks": [], "cycles": [], "stage_count": 1
    }))
    .unwrap();
    let progress = proto::Checkpoint {
        resume_at: None,
        sequence: 1,
        base: "b".into(),
        tree: "t".into(),
        patch: String::new(),
        state,
    };
    bench
        .ledger
        .keep_progress(&older.run_id.to_string(), &progress)
        .await
        .unwrap();
    let newer = bench.job(None, &[], 0);
    let outcome = bench.run(runtime(), &newer).await;
    outcome.assert_state(RunState::Failed);
    outcome.assert_reason(&[&older.run_id.to_string(), "never overwritten"]);
    assert_eq!(bench.pushes().len(), 1, "{:?}", bench.pushes());
    let message = git(&bench.origin(), &["log", "-1", "--format=%B", BRANCH]);
    assert!(
        message.contains(&format!("Forgepool-Run: {}", older.run_id)),
        "{message}"
    );
}

fn usage(input: u64, output: u64, cost: f64, model: &str) -> (String, String) {
    (
        "/forge/output/usage.json".to_string(),
        format!(
            r#"{{"input_tokens": {input}, "output_tokens": {output}, "cache_read_tokens": 10, "cost_usd": {cost}, "model": "{model}"}}"#
        ),
    )
}

/// Catches: usage.json not read, not summed across stages, or missing from the result, the
/// report or the stage events; a malformed one that fails the run instead of being noted.
#[tokio::test(start_paused = true)]
async fn the_stages_usage_is_summed_into_the_result_and_the_report() {
    let implementer = Act::Exit {
        code: 0,
        stdout: String::new(),
        files: vec![
            ("/workspace/feature.txt".into(), "round 1\n".into()),
            usage(1000, 200, 0.25, "model-a"),
        ],
    };
    let rejecting = Act::Exit {
        code: 0,
        stdout: "Missing tests. REJECTED".into(),
        files: vec![usage(300, 50, 0.125, "model-b")],
    };
    let malformed = Act::Exit {
        code: 0,
        stdout: String::new(),
        files: vec![
            ("/workspace/feature.txt".into(), "round 2\n".into()),
            (
                "/forge/output/usage.json".into(),
                "{\"cost_usd\": -3}".into(),
            ),
        ],
    };
    let approving = Act::Exit {
        code: 0,
        stdout: "APPROVED".into(),
        files: vec![usage(300, 50, 0.125, "model-b")],
    };
    let (_bench, outcome) = play(
        vec![
            (Stage::Implement, vec![implementer, malformed]),
            (Stage::Review, vec![rejecting, approving]),
        ],
        Some((3, true)),
        &[],
        0,
    )
    .await;
    outcome.assert_state(RunState::Delivered);
    let totals = outcome.result.usage.clone().expect("the run's usage");
    assert_eq!(
        (
            totals.input_tokens,
            totals.output_tokens,
            totals.cache_read_tokens,
            totals.stages
        ),
        (1600, 300, 30, 3)
    );
    assert!((totals.cost_usd - 0.5).abs() < 1e-9, "{}", totals.cost_usd);
    assert_eq!(totals.models, ["model-a", "model-b"]);
    assert!(
        outcome.result.report.contains("## Usage"),
        "{}",
        outcome.result.report
    );
    assert!(
        outcome
            .result
            .report
            .contains("| 1600 | 300 | 30 | 0 | 0.5000 | 3 |"),
        "{}",
        outcome.result.report
    );
    let reported: Vec<bool> = outcome
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::StageFinished { usage, .. } => Some(usage.is_some()),
            _ => None,
        })
        .collect();
    assert_eq!(reported, [true, true, false, true]);
    let noted = outcome.events.iter().any(|e| {
        matches!(&e.kind, EventKind::Log { text, .. } if text.contains("usage.json: cost_usd must be"))
    });
    assert!(noted, "the malformed usage.json is noted in the run's log");
}

/// Catches: a budget that does not stop the run, or stops it before the stage that spent it
/// had its result recorded.
#[tokio::test(start_paused = true)]
async fn a_run_over_its_budget_starts_no_further_stage() {
    let bench = Bench::new();
    let mut job = bench.job(Some((3, true)), &[], 0);
    job.budget = Some(proto::Budget::dollars(1.0));
    let implementer = Act::Exit {
        code: 0,
        stdout: String::new(),
        files: vec![
            ("/workspace/feature.txt".into(), "round 1\n".into()),
            usage(10, 10, 1.5, "model-a"),
        ],
    };
    let runtime = FakeRuntime::default()
        .with(Stage::Implement, vec![implementer])
        .with(Stage::Review, vec![Act::prints("APPROVED")]);
    let outcome = bench.run(runtime, &job).await;
    outcome.assert_state(RunState::Failed);
    outcome.assert_reason(&["budget exceeded", "$1.5000", "$1.00", "budget.max_cost_usd"]);
    assert_eq!(outcome.runtime.stages(), ["implement"]);
    assert!(outcome.result.report.contains("Budget: $1.00"));
    assert!(bench.pushes().is_empty(), "nothing is delivered");
}

/// Catches: a pause.json whose time is ignored (no resume time in the checkpoint, no pause of
/// the profile), or a paused profile whose next run still starts a container.
#[tokio::test(start_paused = true)]
async fn a_pause_json_pauses_the_profile_and_the_run_resumes_at_its_time() {
    let bench = Bench::new();
    let job = bench.job(None, &[], 0);
    let pausing = Act::Exit {
        code: EXIT_PAUSED,
        stdout: "429".into(),
        files: vec![(
            "/forge/output/pause.json".into(),
            r#"{"reason": "rate_limit", "retry_after_seconds": 600}"#.into(),
        )],
    };
    let outcome = bench
        .run(
            FakeRuntime::default().with(Stage::Implement, vec![pausing]),
            &job,
        )
        .await;
    outcome.assert_state(RunState::Paused);
    outcome.assert_reason(&["asked to wait until", "resumes it then by itself"]);
    let resume_at = outcome
        .events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Checkpoint { checkpoint } => checkpoint.resume_at.clone(),
            _ => None,
        })
        .expect("the checkpoint says when the run resumes");
    let at = proto::parse_time(&resume_at).unwrap();
    let now = std::time::SystemTime::now();
    assert!(
        at > now + std::time::Duration::from_secs(590)
            && at < now + std::time::Duration::from_secs(610)
    );

    // Another run of the profile pauses until the same time without starting a container.
    let other = bench.job(None, &[], 0);
    let runtime = FakeRuntime::default().with(Stage::Implement, vec![implements(1)]);
    let second = bench.run(runtime, &other).await;
    second.assert_state(RunState::Paused);
    second.assert_reason(&[
        "agent profile `implementer` is paused across the pool until",
        "rate_limit",
    ]);
    assert!(
        second.runtime.stages().is_empty(),
        "no stage of a paused profile starts"
    );
    let second_at = second.events.iter().find_map(|e| match &e.kind {
        EventKind::Checkpoint { checkpoint } => checkpoint.resume_at.clone(),
        _ => None,
    });
    assert_eq!(second_at.as_deref(), Some(resume_at.as_str()));
}

/// Catches: a run that starts a stage of a profile whose cap is full, or that waits holding
/// its slot instead of handing itself back with its progress kept.
#[tokio::test(start_paused = true)]
async fn a_run_whose_profile_is_at_its_cap_hands_itself_back_to_wait() {
    let bench = Bench::new();
    let mut job = bench.job(None, &[], 0);
    job.implementer.max_concurrent = Some(1);
    let held = bench
        .gate
        .admit(uuid::Uuid::new_v4(), &job.implementer)
        .await;
    assert!(matches!(held, Admission::Go(_)));
    let runtime = FakeRuntime::default().with(Stage::Implement, vec![implements(1)]);
    let (execution, events, runtime) = bench
        .pooled("runs", runtime, &job, CancellationToken::new(), false)
        .await;
    assert!(
        matches!(execution, Execution::Waiting(Role::Implementer)),
        "{execution:?}"
    );
    assert!(runtime.stages().is_empty());
    let waiting = events.iter().rev().find_map(|e| match &e.kind {
        EventKind::State { state, reason } => Some((*state, reason.clone())),
        _ => None,
    });
    let (state, reason) = waiting.expect("a state");
    assert_eq!(state, RunState::Queued);
    assert_eq!(proto::waiting_profile(&reason), Some("implementer"));

    // Once the slot is given back, the run goes through.
    drop(held);
    let runtime = FakeRuntime::default().with(Stage::Implement, vec![implements(1)]);
    let outcome = bench.run_again(runtime, &job).await;
    outcome.assert_state(RunState::Delivered);
}

/// Catches: a resumed run that waits for its reviewer's cap and then starts again from its
/// pause's checkpoint (its implementer would run, and be paid for, once per wait).
#[tokio::test(start_paused = true)]
async fn a_resumed_run_that_waits_continues_from_its_own_progress() {
    let bench = Bench::new();
    let mut job = bench.job(Some((3, true)), &[], 0);
    if let Some(reviewer) = job.reviewer.as_mut() {
        reviewer.max_concurrent = Some(1);
    }
    let paused = bench
        .run(
            FakeRuntime::default().with(Stage::Implement, vec![Act::exits(EXIT_PAUSED, "429")]),
            &job,
        )
        .await;
    paused.assert_state(RunState::Paused);
    let checkpoint = paused
        .events
        .iter()
        .find_map(|e| match &e.kind {
            EventKind::Checkpoint { checkpoint } => Some(checkpoint.clone()),
            _ => None,
        })
        .expect("a checkpoint");
    job.resume = Some(checkpoint);
    let reviewer = job.reviewer.clone().expect("a reviewer");
    let held = bench.gate.admit(uuid::Uuid::new_v4(), &reviewer).await;
    let runtime = FakeRuntime::default().with(Stage::Implement, vec![implements(1)]);
    let (execution, _, runtime) = bench
        .pooled("runs", runtime, &job, CancellationToken::new(), true)
        .await;
    assert!(
        matches!(execution, Execution::Waiting(Role::Reviewer)),
        "{execution:?}"
    );
    assert_eq!(runtime.stages(), ["implement"]);
    drop(held);
    let runtime = FakeRuntime::default()
        .with(Stage::Implement, vec![implements(2)])
        .with(Stage::Review, vec![Act::prints("APPROVED")]);
    let outcome = bench.run_again(runtime, &job).await;
    outcome.assert_state(RunState::Delivered);
    assert_eq!(
        outcome.runtime.stages(),
        ["review"],
        "the implementer does not run again"
    );
    assert_eq!(bench.delivered("feature.txt").as_deref(), Some("round 1\n"));
}
