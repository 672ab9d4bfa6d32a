//! The readers against each CLI's real output (captured from the real CLIs in their images
//! against a scripted fake model server: `fixtures/README.md`), and against hostile output.

use super::*;
use proptest::prelude::*;

fn fixture(kind: &str, name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/agents/fixtures")
        .join(kind)
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn profile(kind: AgentKind) -> AgentProfile {
    AgentProfile {
        name: "agent".into(),
        image: kind.default_image().unwrap_or_default(),
        command: vec![],
        env: vec![],
        network: proto::Network::Egress,
        memory_bytes: 1 << 30,
        cpus: 1.0,
        timeout_seconds: 60,
        user: None,
        read_only_root: true,
        disk_bytes: proto::DEFAULT_DISK_BYTES,
        egress: vec!["172.17.0.1:8089".into()],
        max_concurrent: None,
        kind,
        model: Some("fake-model".into()),
        base_url: Some("http://172.17.0.1:8089".into()),
        provider: None,
        daily_budget: None,
        args: vec!["--extra".into()],
        pause_seconds: None,
        server_tools: Vec::new(),
    }
}

/// Catches: a kind whose command line loses the prompt, the profile's model or extra
/// arguments, or runs without its home on the tmpfs.
#[test]
fn every_kind_runs_its_cli_with_the_prompt_model_and_arguments() {
    let prompt = "# Skill\n\nDo it; `rm -rf /` stays text: $HOME \"quoted\"";
    for kind in &AgentKind::ALL[1..] {
        let invocation = invocation(&profile(*kind), Role::Implementer, prompt).unwrap();
        let command = &invocation.command;
        assert_eq!(
            command[..2],
            ["/bin/sh".to_string(), "-c".to_string()],
            "{kind:?}"
        );
        assert!(command.iter().any(|a| a == prompt), "{kind:?}: {command:?}");
        assert!(
            command.iter().any(|a| a.contains("fake-model"))
                || invocation.env.iter().any(|e| e.contains("fake-model")),
            "{kind:?}: the model is lost"
        );
        assert_eq!(command.last().filter(|_| false), None);
        assert!(command.iter().any(|a| a == "--extra"), "{kind:?}");
        assert!(
            invocation.env.iter().any(|e| e == "HOME=/tmp/home"),
            "{kind:?}"
        );
        assert!(
            invocation.env.iter().any(|e| e.contains("172.17.0.1:8089"))
                || command.iter().any(|a| a.contains("172.17.0.1:8089")),
            "{kind:?}: the base URL is lost"
        );
    }
    assert!(invocation(&profile(AgentKind::Command), Role::Implementer, prompt).is_none());
}

/// Catches: a prompt too long for one argument passed whole (the container would not start).
#[test]
fn a_prompt_too_long_for_an_argument_is_left_in_its_file() {
    let prompt = "x".repeat(MAX_INLINE_PROMPT + 1);
    let invocation =
        invocation(&profile(AgentKind::ClaudeCode), Role::Implementer, &prompt).unwrap();
    assert!(invocation
        .command
        .iter()
        .all(|a| a.len() < MAX_INLINE_PROMPT));
    assert!(invocation
        .command
        .iter()
        .any(|a| a.contains("/forge/input/prompt.md")));
}

/// Catches: a reader that parses a JSON line cut across reads as two broken lines.
#[test]
fn lines_split_across_reads_are_read_whole() {
    let line = r#"{"type":"result","subtype":"success","is_error":false,"result":"APPROVED","usage":{"input_tokens":10,"output_tokens":2}}"#;
    let mut reader = AgentReader::new(AgentKind::ClaudeCode).unwrap();
    let mut readable = String::new();
    for piece in line.as_bytes().chunks(7) {
        readable.push_str(&reader.stdout(std::str::from_utf8(piece).unwrap()));
    }
    readable.push_str(&reader.stdout("\n"));
    let (report, _) = reader.finish();
    assert_eq!(report.final_text, "APPROVED");
    assert_eq!(report.usage.unwrap().input_tokens, 10);
    assert!(readable.contains("claude-code finished"), "{readable}");
}

/// Catches: an endless line that grows the reader's memory, or hides the lines after it.
#[test]
fn an_endless_line_is_skipped_and_the_next_one_read() {
    let mut reader = AgentReader::new(AgentKind::Codex).unwrap();
    let block = "y".repeat(64 * 1024);
    let mut readable = String::new();
    for _ in 0..40 {
        readable.push_str(&reader.stdout(&block));
    }
    assert!(reader.partial.len() <= MAX_AGENT_LINE);
    readable.push_str(&reader.stdout("\n{\"type\":\"item.completed\",\"item\":{\"type\":\"agent_message\",\"text\":\"after\"}}\n"));
    let (report, _) = reader.finish();
    assert_eq!(report.final_text, "after");
    assert_eq!(report.unreadable_lines, 1);
    assert!(readable.contains("was not read"), "{readable}");
}

/// Catches: a rate limit read as a failure or a success, or a pause without its end.
#[test]
fn a_rate_limit_settles_as_a_pause_until_the_named_time() {
    let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let mut report = AgentReport::new(AgentKind::Aider);
    report.rate_limited(
        "litellm.RateLimitError: Please try again in 7s.",
        Some(Duration::from_secs(7)),
    );
    let settled = report.settle(0, now, DEFAULT_RATE_LIMIT_PAUSE);
    assert_eq!(settled.exit_code, super::EXIT_PAUSED);
    let pause = settled.pause.unwrap();
    assert_eq!(
        pause.until,
        proto::format_timestamp(now + Duration::from_secs(7) + Duration::from_millis(999))
    );
    let unnamed = AgentReport {
        outcome: AgentOutcome::RateLimited {
            reason: "429".into(),
            resets_at: None,
            retry_after: None,
        },
        ..AgentReport::new(AgentKind::Codex)
    };
    let pause = unnamed
        .settle(1, now, DEFAULT_RATE_LIMIT_PAUSE)
        .pause
        .unwrap();
    assert_eq!(
        pause.until,
        proto::format_timestamp(now + DEFAULT_RATE_LIMIT_PAUSE + Duration::from_millis(999))
    );
    let gemini = AgentReport::new(AgentKind::GeminiCli).settle(
        gemini::EXIT_RATE_LIMITED,
        now,
        DEFAULT_RATE_LIMIT_PAUSE,
    );
    assert_eq!(
        gemini.exit_code,
        super::EXIT_PAUSED,
        "exit 173 is Gemini's 429"
    );
    let failed = AgentReport {
        outcome: AgentOutcome::Failed("boom".into()),
        ..AgentReport::new(AgentKind::Codex)
    };
    assert_eq!(
        failed.settle(0, now, DEFAULT_RATE_LIMIT_PAUSE).exit_code,
        1,
        "a CLI that says it failed fails"
    );
    assert_eq!(
        AgentReport::new(AgentKind::Codex)
            .settle(0, now, DEFAULT_RATE_LIMIT_PAUSE)
            .exit_code,
        0
    );
}

/// What a fixture's run reads as: its report, its readable log, and how it settles.
fn replay(kind: AgentKind, case: &str, exit_code: i64) -> (AgentReport, String, Settled) {
    let mut reader = AgentReader::new(kind).unwrap();
    let stdout = fixture(kind.as_str(), &format!("{case}.stdout"));
    // Fed in uneven pieces, as a container's log stream arrives.
    let mut readable = String::new();
    for piece in stdout.as_bytes().chunks(777) {
        readable.push_str(&reader.stdout(&String::from_utf8_lossy(piece)));
    }
    reader.stderr(&fixture(kind.as_str(), &format!("{case}.stderr")));
    let (mut report, rest) = reader.finish();
    readable.push_str(&rest);
    if kind == AgentKind::MiniSweAgent {
        report.take_output_file(fixture(kind.as_str(), &format!("{case}.traj.json")).as_bytes());
    }
    let settled = report.settle(
        exit_code,
        std::time::SystemTime::now(),
        DEFAULT_RATE_LIMIT_PAUSE,
    );
    (report, readable, settled)
}

fn tokens(usage: &Usage) -> (u64, u64, u64) {
    (
        usage.input_tokens,
        usage.cache_read_tokens,
        usage.output_tokens,
    )
}

/// Every kind's real success output (fixtures/README.md): the usage the fake reported
/// (cache reads apart from input, whichever way the CLI counts them), the cost where the
/// CLI gives one, the tool call, the final text, readable lines instead of JSON, completed.
/// Catches: a reader that drifts from the CLI's real output (a renamed field, cached tokens
/// counted twice or lost, a tool call missed), or raw JSON in the log.
#[test]
fn each_kinds_real_success_output_reads_as_the_fake_reported() {
    let cases = [
        (AgentKind::ClaudeCode, (2734, 500, 134), Some(0.010362)),
        (AgentKind::Codex, (2734, 500, 134), None),
        (AgentKind::GeminiCli, (2734, 500, 134), None),
        (AgentKind::Opencode, (2734, 500, 134), Some(0.010362)),
        (AgentKind::MiniSweAgent, (2734, 500, 134), Some(0.011712)),
    ];
    for (kind, expected, cost) in cases {
        let (report, readable, settled) = replay(kind, "success", 0);
        let usage = report
            .usage
            .clone()
            .unwrap_or_else(|| panic!("{kind:?} has usage"));
        assert_eq!(tokens(&usage), expected, "{kind:?}: {usage:?}");
        if let Some(cost) = cost {
            assert!((usage.cost_usd - cost).abs() < 1e-6, "{kind:?}: {usage:?}");
        }
        assert_eq!(report.final_text.trim(), "DONE", "{kind:?}");
        assert!(
            report.transcript.tool_calls() >= 1,
            "{kind:?}: {:#?}",
            report.transcript
        );
        assert_eq!(report.outcome, AgentOutcome::Completed, "{kind:?}");
        assert_eq!(settled.exit_code, 0, "{kind:?}");
        assert_eq!(report.unreadable_lines, 0, "{kind:?}");
        if kind != AgentKind::MiniSweAgent {
            assert!(
                !readable.contains("{\"type\""),
                "{kind:?} logged raw JSON:\n{readable}"
            );
            assert!(
                readable.contains("→ "),
                "{kind:?} told no tool call:\n{readable}"
            );
        }
    }
    // aider prints rounded figures ("1.2k sent"); its edit is its tool call.
    let (report, _, settled) = replay(AgentKind::Aider, "success", 0);
    let usage = report.usage.clone().unwrap();
    assert_eq!(tokens(&usage), (1200, 0, 56), "{usage:?}");
    assert!((usage.cost_usd - 0.0045).abs() < 1e-9, "{usage:?}");
    assert!(
        report.transcript.tool_calls() >= 1,
        "{:#?}",
        report.transcript
    );
    assert_eq!(settled.exit_code, 0);
}

/// Every kind's real output after its retries gave up on 429s (`retry-after: 3`): a pause,
/// whatever the exit code (aider's 0, Gemini's 173, the others' 1), until the reset the CLI
/// passed on, or the default when it kept it to itself.
/// Catches: a rate limit read as a failure or a success, and a lost `retry-after`.
#[test]
fn each_kinds_real_rate_limit_output_reads_as_a_pause() {
    let cases = [
        (AgentKind::ClaudeCode, 1, Some(3)),
        (AgentKind::Codex, 1, None),
        (AgentKind::GeminiCli, 173, None),
        (AgentKind::Opencode, 1, Some(3)),
        (AgentKind::Aider, 0, Some(3)),
        (AgentKind::MiniSweAgent, 1, Some(3)),
    ];
    for (kind, exit_code, named) in cases {
        let (report, _, settled) = replay(kind, "rate_limit", exit_code);
        let AgentOutcome::RateLimited {
            retry_after,
            resets_at,
            ..
        } = &report.outcome
        else {
            panic!("{kind:?} did not read a rate limit: {:?}", report.outcome);
        };
        assert_eq!(settled.exit_code, EXIT_PAUSED, "{kind:?}");
        assert!(settled.pause.is_some(), "{kind:?}");
        assert_eq!(resets_at, &None, "{kind:?}");
        assert_eq!(retry_after.map(|d| d.as_secs()), named, "{kind:?}");
    }
}

/// The reviewers' real output: the verdict is the final text.
/// Catches: a reviewer's verdict lost among its tool calls.
#[test]
fn a_reviewers_real_output_ends_in_its_verdict() {
    for kind in [AgentKind::ClaudeCode, AgentKind::Codex] {
        let (report, _, settled) = replay(kind, "review", 0);
        assert_eq!(report.final_text.trim(), "REJECTED: add a test", "{kind:?}");
        assert_eq!(settled.exit_code, 0, "{kind:?}");
    }
}

/// A rate limit aider or mini-swe-agent retried and overcame does not pause the stage.
/// Catches: a successful stage paused because a retry was printed on the way.
#[test]
fn a_rate_limit_overcome_by_a_retry_does_not_pause() {
    let aider = "litellm.RateLimitError: RateLimitError: OpenAIException - Rate limit reached. Please try again in 2s.\nRetrying in 0.2 seconds...\nhello.txt\nApplied edit to hello.txt\nTokens: 1.2k sent, 56 received. Cost: $0.0045 message, $0.0045 session.\n";
    let (report, _) = AgentReader::read_all(AgentKind::Aider, aider).unwrap();
    assert_eq!(report.outcome, AgentOutcome::Completed);
    let mut reader = AgentReader::new(AgentKind::MiniSweAgent).unwrap();
    reader.stderr("Retrying in 4 seconds as it raised RateLimitError: Please try again in 2s.\n");
    let (mut report, _) = reader.finish();
    report.take_output_file(fixture("mini-swe-agent", "success.traj.json").as_bytes());
    assert_eq!(report.outcome, AgentOutcome::Completed);
    assert_eq!(
        report
            .settle(0, std::time::SystemTime::now(), DEFAULT_RATE_LIMIT_PAUSE)
            .exit_code,
        0
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Catches: a reader that panics on, or keeps without bound, whatever a CLI prints.
    #[test]
    fn readers_never_panic_and_stay_bounded(
        kind_index in 1usize..AgentKind::ALL.len(),
        pieces in proptest::collection::vec(
            prop_oneof![
                ".{0,200}",
                Just("{\"type\":\"result\",\"is_error\":true,\"api_error_status\":429}\n".to_string()),
                Just("{\"type\":\"assistant\",\"message\":{\"content\":[{\"type\":\"tool_use\",\"id\":\"1\",\"name\":\"Write\",\"input\":{\"a\":[[[[1]]]]}}]}}\n".to_string()),
                Just("{\"type\":\"turn.failed\",\"error\":{\"message\":\"429 Too Many Requests\"}}\n".to_string()),
                Just("{\"type\":\"step_finish\",\"part\":{\"tokens\":{\"input\":1e308,\"output\":-5},\"cost\":\"x\"}}\n".to_string()),
                Just("Tokens: 99999999999999999999k sent, 1.5.5 received. Cost: $NaN message\n".to_string()),
                Just("[".repeat(300)),
                Just("\n".to_string()),
            ],
            0..60,
        ),
    ) {
        let kind = AgentKind::ALL[kind_index];
        let mut reader = AgentReader::new(kind).unwrap();
        let mut readable = 0usize;
        for piece in &pieces {
            readable += reader.stdout(piece).len();
            reader.stderr(piece);
        }
        let (mut report, rest) = reader.finish();
        report.take_output_file(pieces.concat().as_bytes());
        prop_assert!(readable + rest.len() <= pieces.iter().map(|p| p.len() * 4 + 256).sum::<usize>() + 4096);
        let used: usize = report.transcript.entries.iter().map(|e| e.text.len()).sum();
        prop_assert!(used <= proto::MAX_TRANSCRIPT_BYTES);
        let _ = report.settle(0, std::time::SystemTime::now(), DEFAULT_RATE_LIMIT_PAUSE);
    }
}
