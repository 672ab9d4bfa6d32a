//! The real agent CLIs (SPEC 16), each in the image `scripts/build-agent-images.sh` builds,
//! run by `forgepool run` as production runs them: non-root, read-only root, and
//! `network = "egress"` with only the fake model server allowed (never host networking).
//! Judged by what the fake model server recorded and what the delivered branch holds.
//! Needs Docker, the agent images and the forgepool image (the egress proxy):
//! `scripts/services.sh && scripts/build-agent-images.sh && scripts/build-forgepool-image.sh --debug`.

mod common;

use std::time::Duration;

use common::kinds::{
    fixture, key, key_variable, profile, providers, require_images, review, CONTENT, FILE,
};
use common::model::{
    FakeModel, Script, FEEDBACK, FINAL_REVIEW_MARK, FINAL_SUMMARY, INPUT_TOKENS, OUTPUT_TOKENS,
    REVIEWER_MARK,
};
use common::Fixture;
use proto::{AgentKind, EventKind, Stage, StageOutcome};

const BRANCH: &str = "forge/test-1";

fn script(rate_limited: usize) -> Script {
    Script::writing(FILE, CONTENT, rate_limited)
}

/// The implementer changes the file with the CLI's own tool; the reviewer of the same kind
/// rejects once; the second round's request carries the feedback; the reviewer approves;
/// the branch holds the file; the run's usage is what the fake scripted; the transcript
/// holds the tool call; the key reached the model and nothing stored.
/// Catches: a kind whose command line, endpoint, proxy or key does not reach the model; a
/// reader that loses the usage, the verdict or the tool calls; feedback not given back.
async fn delivers_with(kind: AgentKind) {
    let model = FakeModel::start(script(0)).await;
    let fixture = fixture(kind, &model);
    let key = key(kind);
    let outcome = tokio::task::spawn_blocking({
        let key = key.clone();
        move || {
            let outcome = fixture.run_with("", &[(key_variable(kind), key.as_str())]);
            (fixture, outcome)
        }
    })
    .await
    .unwrap();
    let (fixture, outcome) = outcome;
    let requests = model.requests();
    let summary = requests
        .iter()
        .map(|r| format!("{} -> {}", r.path, r.answer))
        .collect::<Vec<_>>()
        .join("\n");
    let context = format!("{}\nrequests:\n{summary}", outcome.printed());
    assert_eq!(outcome.code, 0, "{context}");
    assert!(
        outcome.stdout.contains(&format!("REJECTED - {FEEDBACK}")),
        "{context}"
    );
    assert!(
        outcome.stdout.contains("Review cycle 2/3: APPROVED"),
        "{context}"
    );
    assert_eq!(
        fixture.branch_file(BRANCH, FILE).trim(),
        CONTENT,
        "{context}"
    );

    // What the fake server got: the CLI's tool call answered, the feedback given back, the
    // key the worker holds.
    assert!(
        requests
            .iter()
            .any(|r| r.answer == "tool" || r.answer == "whole-edit"),
        "{context}"
    );
    let round_two = requests.iter().find(|r| {
        let text = r.body.to_string();
        text.contains("## Reviewer Feedback")
            && text.contains(FEEDBACK)
            && !text.contains(REVIEWER_MARK)
    });
    assert!(
        round_two.is_some(),
        "no implementer request carried the feedback\n{context}"
    );
    assert!(
        requests
            .iter()
            .all(|r| r.key.as_deref().is_some_and(|k| k.contains(&key))),
        "every request carries the profile's key\n{context}"
    );

    // The run's usage is what the fake answered.
    let record = outcome.record();
    let usage = record
        .result
        .as_ref()
        .and_then(|r| r.usage.clone())
        .expect("the run has usage");
    let answers = model.usage_answers();
    assert_eq!(
        (
            usage.input_tokens + usage.cache_read_tokens,
            usage.output_tokens
        ),
        (INPUT_TOKENS * answers, OUTPUT_TOKENS * answers),
        "the run's usage is the fake's {answers} answers\n{context}"
    );

    // The implementer's transcript holds its tool call.
    let transcripts: Vec<_> = outcome
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Transcript {
                stage,
                agent,
                transcript,
                ..
            } => Some((*stage, *agent, transcript)),
            _ => None,
        })
        .collect();
    let implement = transcripts
        .iter()
        .find(|(stage, _, _)| *stage == Stage::Implement)
        .expect("the implement stage has a transcript");
    assert_eq!(implement.1, kind);
    assert!(implement.2.tool_calls() >= 1, "{:#?}", implement.2);
    let stored = serde_json::to_string(&outcome.events).unwrap();
    assert!(!stored.contains(&key), "the key is in a stored event");
    let logs: String = outcome
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Log { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(
        !logs.contains("{\"type\":"),
        "the CLI's raw JSON reached the log\n{logs}"
    );
    // The gateway's count (the run's usage) and the CLI's own agree within 1 % for every
    // stage: a disagreement would be noted in the stage's log.
    assert!(
        !logs.contains("the model gateway metered"),
        "the CLI's usage and the gateway's disagree\n{logs}"
    );
    if !matches!(kind, AgentKind::Aider | AgentKind::MiniSweAgent) {
        // The JSON streams become readable lines, tool by tool (aider and mini-swe-agent
        // print text for people, which is logged as it is).
        assert!(logs.contains("→ "), "the log tells the tool calls\n{logs}");
    }
    model.stop();
    outcome.assert_no_containers_left();
    drop(fixture);
}

/// The `pause_seconds` the rate-limit tests give their profiles, far from the provider's 2 s
/// and from the default 300 s, so that the test tells which one paused the stage.
const PROFILE_PAUSE: u64 = 12;

/// The first requests are refused with a 429 and `retry-after: 2`: the model gateway halts
/// the stage at the first, which ends paused (not failed, not completed) until the reset the
/// provider named (not the profile's `pause_seconds`), whatever the CLI would have done;
/// `forgepool run` waits each pause out and resumes the run by itself; the resumed run
/// delivers, and the paused rounds were not spent.
/// Catches: a rate limit read as a failure (Claude, Codex, opencode and mini-swe-agent exit
/// 1), as a success (aider exits 0), Gemini's exit 173 taken for a crash, a pause without
/// the provider's reset time, a CLI left retrying into more 429s, and a pause nobody resumes.
async fn pauses_on_a_rate_limit_with(kind: AgentKind, refused: usize) {
    let model = FakeModel::start(script(refused)).await;
    let fixture = fixture(kind, &model);
    let agents = std::fs::read_to_string(&fixture.agents).unwrap();
    let agents = agents.replace(
        "timeout_seconds = 300\n",
        &format!("timeout_seconds = 300\npause_seconds = {PROFILE_PAUSE}\n"),
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    let key = key(kind);
    let (fixture, outcome) = tokio::task::spawn_blocking(move || {
        let env = [(key_variable(kind), key.as_str())];
        let outcome = fixture.run_with("", &env);
        (fixture, outcome)
    })
    .await
    .unwrap();
    let requests = model.requests();
    let context = format!(
        "{}\nrequests: {:?}",
        outcome.printed(),
        requests.iter().map(|r| &r.answer).collect::<Vec<_>>()
    );
    let paused = outcome.events.iter().any(|e| {
        matches!(
            &e.kind,
            EventKind::StageFinished {
                stage: Stage::Implement,
                outcome: StageOutcome::Paused,
                ..
            }
        )
    });
    assert!(paused, "the implement stage never paused\n{context}");
    let resume_at = outcome.events.iter().find_map(|e| match &e.kind {
        EventKind::Checkpoint { checkpoint } => checkpoint.resume_at.clone(),
        _ => None,
    });
    let resume_at = resume_at.expect("the pause names its end");
    // The fake says `retry-after: 2`; the gateway reads it from the answer (the time is kept
    // to the second, so the wait from the 429 is 1 to 2 s).
    let first_refusal = requests
        .iter()
        .find(|r| r.answer == "429")
        .expect("a 429 was answered")
        .at;
    let until = humantime::parse_rfc3339_weak(&resume_at).unwrap();
    let wait = until.duration_since(first_refusal).unwrap_or_default();
    let seconds = wait.as_secs_f64();
    assert!(
        (0.9..=2.1).contains(&seconds),
        "the pause lasts the provider's 2 s (not the profile's {PROFILE_PAUSE} s), not {wait:?}\n{context}"
    );
    assert!(
        outcome
            .stdout
            .contains("in this process (Ctrl-C or SIGTERM cancels the run"),
        "{context}"
    );
    assert_eq!(outcome.code, 0, "the resumed run delivered\n{context}");
    assert!(
        outcome.stdout.contains("Review cycle 2/3: APPROVED"),
        "{context}"
    );
    let result = outcome
        .record()
        .result
        .clone()
        .expect("a delivered run has a result");
    assert_eq!(
        result.implementation_rounds, 2,
        "the paused round was not spent\n{context}"
    );
    assert_eq!(
        fixture.branch_file(BRANCH, FILE).trim(),
        CONTENT,
        "{context}"
    );
    assert_eq!(
        requests.iter().filter(|r| r.answer == "429").count(),
        refused,
        "{context}"
    );
    model.stop();
    outcome.assert_no_containers_left();
    drop(fixture);
}

/// The final review (SPEC 7.3) by each kind: once the loop approved, the same CLI as the
/// run's final review agent writes `/forge/output/review.json` with its own tool, over a
/// read-only copy; forgepool accepts it, and the run is delivered with the review approved
/// and its summary in the result.
/// Catches: a kind whose final reviewer cannot write its report (file tools confined to the
/// workspace, a read-only mode that forbids every write), or whose report is not read.
async fn final_review_with(kind: AgentKind) {
    let model = FakeModel::start(script(0)).await;
    let fixture = fixture(kind, &model);
    let mut agents = std::fs::read_to_string(&fixture.agents).unwrap();
    agents.push_str(&format!("\n{}", profile(kind, "final", &model)));
    std::fs::write(&fixture.agents, agents).unwrap();
    let key = key(kind);
    let (fixture, outcome) = tokio::task::spawn_blocking(move || {
        let extra = "[assurance]\nreview_agent = \"final\"\n";
        let outcome = fixture.run_with(extra, &[(key_variable(kind), key.as_str())]);
        (fixture, outcome)
    })
    .await
    .unwrap();
    let requests = model.requests();
    let summary: Vec<String> = requests
        .iter()
        .map(|r| format!("{} -> {}", r.path, r.answer))
        .collect();
    let context = format!("{}\nrequests:\n{}", outcome.printed(), summary.join("\n"));
    assert_eq!(outcome.code, 0, "{context}");
    assert!(
        requests
            .iter()
            .any(|r| r.body.to_string().contains(FINAL_REVIEW_MARK)
                && (r.answer == "tool" || r.answer == "whole-edit")),
        "the final reviewer never called a tool\n{context}"
    );
    let result = outcome.record().result.clone().unwrap();
    assert_eq!(result.review, "approved", "{context}");
    let report = result.final_review.expect("the final review's report");
    assert_eq!(report.summary, FINAL_SUMMARY, "{context}");
    outcome.assert_no_containers_left();
    drop(fixture);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_writes_a_final_review() {
    final_review_with(AgentKind::ClaudeCode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_writes_a_final_review() {
    final_review_with(AgentKind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_cli_writes_a_final_review() {
    final_review_with(AgentKind::GeminiCli).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_writes_a_final_review() {
    final_review_with(AgentKind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_writes_a_final_review() {
    final_review_with(AgentKind::Aider).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mini_swe_agent_writes_a_final_review() {
    final_review_with(AgentKind::MiniSweAgent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_delivers_a_reviewed_change() {
    delivers_with(AgentKind::ClaudeCode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_pauses_on_a_rate_limit_and_resumes() {
    pauses_on_a_rate_limit_with(AgentKind::ClaudeCode, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_delivers_a_reviewed_change() {
    delivers_with(AgentKind::Codex).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_pauses_on_a_rate_limit_and_resumes() {
    pauses_on_a_rate_limit_with(AgentKind::Codex, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_cli_delivers_a_reviewed_change() {
    delivers_with(AgentKind::GeminiCli).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_cli_pauses_on_a_rate_limit_and_resumes() {
    pauses_on_a_rate_limit_with(AgentKind::GeminiCli, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_delivers_a_reviewed_change() {
    delivers_with(AgentKind::Opencode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_pauses_on_a_rate_limit_and_resumes() {
    pauses_on_a_rate_limit_with(AgentKind::Opencode, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_delivers_a_reviewed_change() {
    delivers_with(AgentKind::Aider).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aider_pauses_on_a_rate_limit_and_resumes() {
    pauses_on_a_rate_limit_with(AgentKind::Aider, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mini_swe_agent_delivers_a_reviewed_change() {
    delivers_with(AgentKind::MiniSweAgent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mini_swe_agent_pauses_on_a_rate_limit_and_resumes() {
    pauses_on_a_rate_limit_with(AgentKind::MiniSweAgent, 2).await;
}

/// The token of the pool test's dispatcher.
const TOKEN: &str = "agents-pool-token-0123456789";

/// Claude Code and Codex in the pool: a dispatcher, RabbitMQ and a worker running both at
/// once (each against its own fake model), as production runs them. Each run delivers; the
/// API serves each agent stage's transcript (with the stage's usage) and refuses a stage
/// that has none; the run view opens a stage to its transcript in Chromium.
/// Catches: agent kinds that only work in `forgepool run` (a job message that loses the
/// profile's kind, model or base URL; a worker that does not read the CLI's report), a
/// transcript endpoint that counts stages differently from the view, and a view that does
/// not show the transcript or the stage's tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_and_codex_run_in_the_pool_with_their_transcripts_shown() {
    common::browser::browser_tools();
    let claude = FakeModel::start(script(0)).await;
    let codex = FakeModel::start(script(0)).await;
    require_images(AgentKind::ClaudeCode);
    require_images(AgentKind::Codex);
    let fixture = Fixture::new(Some(&review()), &["change"], &["approve"]);
    std::fs::write(fixture.providers_file(), providers(&[&claude, &codex])).unwrap();
    std::fs::write(
        &fixture.agents,
        format!(
            "[defaults]\nimplementer = \"claude\"\nreviewer = \"claude-review\"\n\n{}\n{}\n{}\n{}",
            profile(AgentKind::ClaudeCode, "claude", &claude),
            profile(AgentKind::ClaudeCode, "claude-review", &claude),
            profile(AgentKind::Codex, "codex", &codex),
            profile(AgentKind::Codex, "codex-review", &codex),
        ),
    )
    .unwrap();
    let mut keys = [AgentKind::ClaudeCode, AgentKind::Codex]
        .map(|kind| (key_variable(kind).to_string(), key(kind)))
        .to_vec();
    keys.push((
        "FORGEPOOL_PROVIDERS_FILE".to_string(),
        fixture.providers_file().display().to_string(),
    ));
    let options = common::cluster::Options {
        env: keys,
        ..Default::default()
    };
    let cluster = common::cluster::Cluster::start_with(fixture, 1, 2, Some(TOKEN), options).await;
    let by_claude = cluster.submit_with("AGENT-1", serde_json::json!({})).await;
    let by_codex = cluster
        .submit_with(
            "AGENT-2",
            serde_json::json!({"agents": {"implementer": "codex", "reviewer": "codex-review"}}),
        )
        .await;
    let views = cluster
        .wait_terminal(
            &[by_claude.clone(), by_codex.clone()],
            Duration::from_secs(300),
        )
        .await;
    for (view, model) in views.iter().zip([&claude, &codex]) {
        assert_eq!(view["state"], "delivered", "{view}\n{}", cluster.logs());
        let answers = model.usage_answers();
        assert_eq!(
            view["usage"]["output_tokens"],
            OUTPUT_TOKENS * answers,
            "{view}"
        );
    }

    for (run, kind, tool) in [
        (&by_claude, AgentKind::ClaudeCode, "Write"),
        (&by_codex, AgentKind::Codex, "shell"),
    ] {
        // Stage 1 is the implementer's; its transcript holds the tool call and its result.
        let response = cluster
            .request(
                reqwest::Method::GET,
                &format!("/v1/runs/{run}/stages/1/transcript"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let stage: proto::StageTranscript = response.json().await.unwrap();
        assert_eq!(
            (stage.index, stage.stage.as_str(), stage.round),
            (1, "implement", 1)
        );
        assert_eq!(stage.agent, kind.as_str());
        assert!(
            stage
                .transcript
                .entries
                .iter()
                .any(|e| e.role == "tool_call" && e.tool.as_deref() == Some(tool)),
            "{:#?}",
            stage.transcript
        );
        assert!(stage
            .transcript
            .entries
            .iter()
            .any(|e| e.role == "tool_result"));
        let usage = stage.usage.expect("the stage's usage");
        assert_eq!(usage.output_tokens % OUTPUT_TOKENS, 0, "{usage:?}");
        assert!(usage.output_tokens > 0, "{usage:?}");
        assert!(!serde_json::to_string(&stage.transcript)
            .unwrap()
            .contains(&key(kind)));
        // A stage the run never had.
        let missing = cluster
            .request(
                reqwest::Method::GET,
                &format!("/v1/runs/{run}/stages/99/transcript"),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 404);

        common::browser::browse(
            &cluster,
            TOKEN,
            "transcript",
            &[("RUN", run), ("AGENT", kind.as_str()), ("TOOL", tool)],
        )
        .await;
    }
    claude.stop();
    codex.stop();
    for run in [&by_claude, &by_codex] {
        assert_eq!(common::cluster::container_count(run), 0);
    }
}

/// A run whose budget is 100 tokens: the CLI's first call may take far more (its body and its
/// whole `max_tokens`), so the gateway refuses it before it reaches the provider; the stage
/// ends "budget exhausted" and the run fails with that reason, having spent nothing.
/// Catches: a budget checked after the fact (the call would be answered and billed), a
/// request admitted whose own worst case is more than what is left, a refusal the CLI
/// retries into, a stage that goes on after its budget is spent.
async fn stops_at_its_budget_with(kind: AgentKind) {
    let model = FakeModel::start(script(0)).await;
    let fixture = fixture(kind, &model);
    let key = key(kind);
    let (fixture, outcome) = tokio::task::spawn_blocking(move || {
        let env = [(key_variable(kind), key.as_str())];
        let outcome = fixture.run_with("budget = { max_tokens = 100 }", &env);
        (fixture, outcome)
    })
    .await
    .unwrap();
    let context = outcome.printed();
    let requests = model.requests();
    assert_eq!(outcome.code, 1, "{context}");
    assert!(outcome.stdout.contains("budget exhausted"), "{context}");
    assert!(outcome.stdout.contains("budget.max_tokens"), "{context}");
    assert!(
        requests.is_empty(),
        "no call reached the provider: {:?}",
        requests.iter().map(|r| &r.answer).collect::<Vec<_>>()
    );
    let spent = outcome
        .record()
        .result
        .as_ref()
        .and_then(|r| r.usage.clone())
        .map_or(0, |u| {
            u.input_tokens + u.output_tokens + u.cache_read_tokens
        });
    assert_eq!(spent, 0, "{context}");
    model.stop();
    outcome.assert_no_containers_left();
    drop(fixture);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_stops_at_its_budget() {
    stops_at_its_budget_with(AgentKind::ClaudeCode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_stops_at_its_budget() {
    stops_at_its_budget_with(AgentKind::Codex).await;
}
