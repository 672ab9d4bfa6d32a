//! The model gateway (SPEC 16) through `forgepool run` and real stage containers: the
//! provider's key is a unique marker, and the tests look for it from the host side while the
//! stage runs (its environment, every file it can see, `/proc/*/environ`, its mounts) and
//! after (the store, events, printed output, workspaces, the delivered branch). The fake
//! model server counts what reached the provider.
//! Needs Docker, the test images and the forgepool image (the relay):
//! `scripts/services.sh && scripts/build-images.sh && scripts/build-forgepool-image.sh --debug`.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::kinds::providers;
use common::model::{FakeModel, Script, INPUT_TOKENS, OUTPUT_TOKENS};
use common::{output_within, Fixture, COMMAND_LIMIT};
use proto::EventKind;

const MARKER: &str = "sk-ant-REAL-KEY-MARKER-7f3a9c1e5b";
const BRANCH: &str = "forge/test-1";

fn docker(args: &[&str]) -> std::process::Output {
    output_within(Command::new("docker").args(args), COMMAND_LIMIT)
}

/// The running implement stage of this test: the one whose environment names `provider`.
fn find_stage(provider: &str, deadline: Instant) -> Option<String> {
    while Instant::now() < deadline {
        let listed = docker(&["ps", "-q", "--filter", "label=forgepool.stage=implement"]);
        for id in String::from_utf8_lossy(&listed.stdout).split_whitespace() {
            let env = docker(&["inspect", "--format", "{{json .Config.Env}}", id]);
            if String::from_utf8_lossy(&env.stdout).contains(provider) {
                return Some(id.to_string());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    None
}

/// What the host finds in a running stage container: its configuration (environment,
/// mounts), every process's environment, and every file under `/` it can read.
fn look_inside(id: &str) -> (String, String, String) {
    let inspected = docker(&["inspect", id]);
    let environ = docker(&[
        "exec",
        id,
        "sh",
        "-c",
        "cat /proc/[0-9]*/environ | tr '\\0' '\\n'",
    ]);
    let files = docker(&[
        "exec",
        id,
        "sh",
        "-c",
        &format!(
            "grep -r -l -s -F '{MARKER}' / --exclude-dir=proc --exclude-dir=sys; echo grep-done"
        ),
    ]);
    (
        String::from_utf8_lossy(&inspected.stdout).to_string(),
        String::from_utf8_lossy(&environ.stdout).to_string(),
        String::from_utf8_lossy(&files.stdout).to_string(),
    )
}

/// A `command` stage with a provider calls its model through the gateway with its stage
/// token; the provider gets the worker's key; the key is nowhere in the container (looked
/// for from the host while it runs), nor in anything forgepool stores, prints or delivers;
/// the stage cannot reach the provider directly; the reviewer, a later stage, replays the
/// implementer's token and is refused without reaching the provider; the run's usage is
/// what the provider stated, metered by the gateway (the agent reported none).
/// Catches: a key passed into the stage (env, file, mount), a key in the store or logs, a
/// stage network with a route to the provider, a token that outlives its stage, usage not
/// metered on the wire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_stays_in_the_worker_and_a_stage_token_dies_with_its_stage() {
    let model = FakeModel::start(Script::writing("hello.txt", "hi", 0)).await;
    common::kinds::require_images(proto::AgentKind::ClaudeCode);
    let provider = format!("fake{}-anthropic-messages", model.port);
    let direct = format!("{}:{}", common::bridge_gateway(), model.port);
    let review = "---\nmax_retries: 1\n---\n# Review\nCheck the change.\n";
    let fixture = Fixture::new(
        Some(review),
        &["model-call", &direct, "6"],
        &["replay-token"],
    );
    std::fs::write(fixture.providers_file(), providers(&[&model])).unwrap();
    let agents = std::fs::read_to_string(&fixture.agents)
        .unwrap()
        .replace(
            "timeout_seconds = 120\n",
            &format!("timeout_seconds = 120\nprovider = \"{provider}\"\n"),
        )
        .replace(
            "timeout_seconds = 60\n",
            &format!("timeout_seconds = 60\nprovider = \"{provider}\"\n"),
        );
    std::fs::write(&fixture.agents, agents).unwrap();

    let running = std::thread::spawn(move || {
        let outcome = fixture.run_with("", &[("ANTHROPIC_API_KEY", MARKER)]);
        (fixture, outcome)
    });
    let stage = tokio::task::spawn_blocking({
        let provider = provider.clone();
        move || {
            let id = find_stage(&provider, Instant::now() + Duration::from_secs(120))?;
            Some(look_inside(&id))
        }
    })
    .await
    .unwrap();
    let (fixture, outcome) = tokio::task::spawn_blocking(move || running.join().unwrap())
        .await
        .unwrap();
    let context = outcome.printed();
    let (inspected, environ, files) =
        stage.unwrap_or_else(|| panic!("the stage was never seen running\n{context}"));
    assert!(
        environ.contains("FORGE_MODEL_TOKEN=fpg-"),
        "the stage's environment was read: {environ}"
    );
    assert!(
        environ.contains("ANTHROPIC_BASE_URL=http://forgepool-gateway:"),
        "{environ}"
    );
    assert!(files.contains("grep-done"), "the file search ran: {files}");
    for (place, text) in [
        ("configuration", &inspected),
        ("/proc/*/environ", &environ),
        ("files", &files),
    ] {
        assert!(
            !text.contains(MARKER),
            "the key is in the stage's {place}:\n{text}"
        );
    }

    assert_eq!(outcome.code, 0, "{context}");
    let requests = model.requests();
    assert_eq!(
        requests.len(),
        1,
        "only the implementer's call reached the provider: {:?}",
        requests.iter().map(|r| &r.path).collect::<Vec<_>>()
    );
    assert_eq!(
        requests[0].key.as_deref(),
        Some(MARKER),
        "the provider got the worker's key"
    );
    assert!(
        fixture
            .branch_file(BRANCH, "model-answer.txt")
            .contains("message_start"),
        "{context}"
    );
    assert_eq!(
        fixture.branch_file(BRANCH, "direct.txt").trim(),
        "direct: refused"
    );
    let logs: String = outcome
        .events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::Log { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(
        logs.contains("replayed token: HTTP/1.1 401"),
        "the dead token was refused\n{logs}"
    );

    let usage = outcome
        .record()
        .result
        .as_ref()
        .and_then(|r| r.usage.clone())
        .expect("usage of record");
    assert_eq!(
        (
            usage.input_tokens + usage.cache_read_tokens,
            usage.output_tokens
        ),
        (INPUT_TOKENS, OUTPUT_TOKENS),
        "the gateway metered the provider's answer\n{context}"
    );

    // Nothing forgepool kept, printed or delivered holds the key.
    let stored = serde_json::to_string(&outcome.events).unwrap();
    assert!(!stored.contains(MARKER));
    assert!(!outcome.stdout.contains(MARKER) && !outcome.stderr.contains(MARKER));
    let everything = docker_free_grep(fixture.dir.path());
    assert!(everything.is_empty(), "the key is in {everything:?}");
    let branch = output_within(
        Command::new("git").args([
            "-C",
            fixture.bare.to_str().unwrap(),
            "grep",
            "-F",
            MARKER,
            BRANCH,
        ]),
        COMMAND_LIMIT,
    );
    assert!(branch.stdout.is_empty(), "the key is in the branch");
    model.stop();
    outcome.assert_no_containers_left();
}

/// Every file under `dir` (the store, the workspaces, the repositories) holding the marker.
fn docker_free_grep(dir: &std::path::Path) -> Vec<String> {
    let found = output_within(
        Command::new("grep")
            .args(["-r", "-l", "-s", "-F", MARKER])
            .arg(dir),
        COMMAND_LIMIT,
    );
    String::from_utf8_lossy(&found.stdout)
        .lines()
        .filter(|line| !line.ends_with("providers.toml"))
        .map(str::to_string)
        .collect()
}

/// A profile naming a provider's key in `env` is refused before anything runs, pointing to
/// `provider`; a profile naming a provider the worker has no key for fails its stage saying
/// which variable to set, and nothing reaches the provider.
/// Catches: keys passed into stages by configuration; a stage started without a key that
/// then fails obscurely inside the CLI.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_in_env_are_refused_and_a_missing_key_is_named() {
    let model = FakeModel::start(Script::writing("hello.txt", "hi", 0)).await;
    let provider = format!("fake{}-anthropic-messages", model.port);
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    std::fs::write(fixture.providers_file(), providers(&[&model])).unwrap();
    let original = std::fs::read_to_string(&fixture.agents).unwrap();
    std::fs::write(
        &fixture.agents,
        original.replace(
            "env = [\"AGENT_SECRET\"]",
            "env = [\"AGENT_SECRET\", \"OPENAI_API_KEY\"]",
        ),
    )
    .unwrap();
    let (fixture, refused) = tokio::task::spawn_blocking(move || {
        let outcome = fixture.run_with("", &[]);
        (fixture, outcome)
    })
    .await
    .unwrap();
    assert_eq!(refused.code, 2, "{}", refused.printed());
    assert!(
        refused
            .stderr
            .contains("agents.impl.env passes OPENAI_API_KEY"),
        "{}",
        refused.stderr
    );
    assert!(
        refused.stderr.contains("agents.impl.provider"),
        "{}",
        refused.stderr
    );

    std::fs::write(
        &fixture.agents,
        original.replace(
            "timeout_seconds = 120\n",
            &format!("timeout_seconds = 120\nprovider = \"{provider}\"\n"),
        ),
    )
    .unwrap();
    let (_fixture, outcome) = tokio::task::spawn_blocking(move || {
        let outcome = fixture.run_with("", &[]);
        (fixture, outcome)
    })
    .await
    .unwrap();
    assert_eq!(outcome.code, 1, "{}", outcome.printed());
    assert!(
        outcome
            .stdout
            .contains("set ANTHROPIC_API_KEY in the worker's environment"),
        "{}",
        outcome.printed()
    );
    assert!(model.requests().is_empty());
    model.stop();
}

/// The dispatcher's token in the pool test.
const FLEET_TOKEN: &str = "gateway-fleet-token-0123456789";

/// Two workers share a profile whose provider answers the first call with 429 and
/// `retry-after: 5`. The gateway of the worker that got it halts the stage and pauses the
/// profile across the pool; a run submitted then, which the other worker takes, starts no
/// stage of the profile until the reset; the provider gets no call meanwhile; both runs
/// resume by themselves and deliver.
/// Catches: a rate limit that pauses only the stage that hit it (the other worker would call
/// the provider into more 429s), a pause without the provider's reset time, paused runs that
/// never resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_rate_limit_pauses_the_profile_across_the_pool() {
    let mut script = Script::writing("hello.txt", "hi", 1);
    script.retry_after = 5;
    let model = FakeModel::start(script).await;
    let (fixture, options) = through_the_gateway(&model, &["model-call", "127.0.0.1:9", "0"], "");
    let cluster =
        common::cluster::Cluster::start_with(fixture, 2, 1, Some(FLEET_TOKEN), options).await;
    let first = cluster.submit("GW-1").await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let refused_at = loop {
        if let Some(refused) = model.requests().iter().find(|r| r.answer == "429") {
            break refused.at;
        }
        assert!(
            Instant::now() < deadline,
            "no call reached the provider\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let second = cluster.submit("GW-2").await;
    let views = cluster
        .wait_terminal(&[first.clone(), second.clone()], Duration::from_secs(180))
        .await;
    for view in &views {
        assert_eq!(view["state"], "delivered", "{view}\n{}", cluster.logs());
        assert!(
            common::cluster::state_names(view).contains(&"paused"),
            "{view}\n{}",
            cluster.logs()
        );
    }

    // The reset, as the provider named it (kept to the second).
    let reset = refused_at + Duration::from_secs(4);
    let calls: Vec<_> = model
        .requests()
        .iter()
        .map(|r| (r.at, r.answer.clone()))
        .collect();
    assert!(
        calls
            .iter()
            .all(|(at, answer)| answer == "429" || *at < refused_at || *at >= reset),
        "a call reached the provider during the pause: {calls:?}"
    );
    for run in [&first, &second] {
        let stream = cluster.event_stream(run).await;
        for line in stream.lines().filter_map(|l| l.strip_prefix("data:")) {
            let Ok(event) = serde_json::from_str::<proto::Event>(line.trim()) else {
                continue;
            };
            if let EventKind::StageStarted {
                stage: proto::Stage::Implement,
                ..
            } = event.kind
            {
                let at = humantime::parse_rfc3339_weak(&event.time).unwrap();
                assert!(
                    at <= refused_at || at >= reset,
                    "run {run} started an implement stage at {} during the pause (429 at {:?})",
                    event.time,
                    refused_at
                );
            }
        }
    }
    model.stop();
}

/// Two runs on one worker, each implementer listening on its own addresses after calling
/// the model: from the host, each stage container tries to connect to every address of the
/// other (`docker exec`, busybox `nc`); nothing arrives, both calls reached the provider
/// through the relay, and the two containers share no network.
/// Catches: provider stages of different runs on one shared network (a `network = "none"`
/// stage listened and another run's stage connected to it), a stage network the relay is not
/// on (the model call would fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stages_of_two_runs_cannot_reach_each_other() {
    let model = FakeModel::start(Script::writing("hello.txt", "hi", 0)).await;
    let (fixture, options) = through_the_gateway(&model, &["listen", "25"], "");
    let provider = format!("fake{}-anthropic-messages", model.port);
    let cluster =
        common::cluster::Cluster::start_with(fixture, 1, 2, Some(FLEET_TOKEN), options).await;
    let runs = [cluster.submit("NET-1").await, cluster.submit("NET-2").await];
    let stages = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            let found = running_stages(&provider);
            if found.len() == 2 {
                return found;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("two implement stages were never seen running at once");
    })
    .await
    .unwrap();
    let knocks = tokio::task::spawn_blocking(move || {
        let networks: Vec<_> = stages.iter().map(|id| stage_networks(id)).collect();
        let shared = networks[0]
            .iter()
            .any(|(name, _)| networks[1].iter().any(|(other, _)| other == name));
        let mut knocks = Vec::new();
        for (from, to) in [(0, 1), (1, 0)] {
            for (_, address) in &networks[to] {
                let knock = docker(&[
                    "exec",
                    &stages[from],
                    "sh",
                    "-c",
                    &format!(
                        "echo knock | nc -w 3 {address} 7777 && echo connected || echo refused"
                    ),
                ]);
                knocks.push(format!(
                    "{from} -> {address}: {}",
                    String::from_utf8_lossy(&knock.stdout).trim()
                ));
            }
        }
        (format!("{networks:?}"), shared, knocks)
    })
    .await
    .unwrap();
    let views = cluster.wait_terminal(&runs, Duration::from_secs(180)).await;
    let (networks, shared, knocks) = knocks;
    assert!(
        knocks.len() >= 2 && knocks.iter().all(|k| k.ends_with("refused")),
        "a stage reached another: {knocks:?} ({networks})"
    );
    assert!(!shared, "the stages share a network: {networks}");
    for view in &views {
        assert_eq!(view["state"], "delivered", "{view}\n{}", cluster.logs());
    }
    for ticket in ["net-1", "net-2"] {
        let branch = format!("forge/{ticket}");
        let fixture = &cluster.fixture;
        assert_eq!(
            fixture.branch_file(&branch, "knocked.txt"),
            "",
            "something reached the stage of {ticket}"
        );
        assert!(
            fixture
                .branch_file(&branch, "model-answer.txt")
                .contains("message_start"),
            "the stage of {ticket} reached the gateway"
        );
    }
    assert_eq!(model.requests().len(), 2, "{:?}", model.requests());
    model.stop();
}

/// The running implement stages whose environment names `provider`.
fn running_stages(provider: &str) -> Vec<String> {
    let listed = docker(&["ps", "-q", "--filter", "label=forgepool.stage=implement"]);
    String::from_utf8_lossy(&listed.stdout)
        .split_whitespace()
        .filter(|id| {
            let env = docker(&["inspect", "--format", "{{json .Config.Env}}", id]);
            String::from_utf8_lossy(&env.stdout).contains(provider)
        })
        .map(String::from)
        .collect()
}

/// A container's networks and its address on each.
fn stage_networks(id: &str) -> Vec<(String, String)> {
    let inspected = docker(&[
        "inspect",
        "--format",
        "{{range $name, $net := .NetworkSettings.Networks}}{{$name}} {{$net.IPAddress}}\n{{end}}",
        id,
    ]);
    String::from_utf8_lossy(&inspected.stdout)
        .lines()
        .filter_map(|line| line.split_once(' '))
        .filter(|(_, address)| !address.is_empty())
        .map(|(name, address)| (name.to_string(), address.to_string()))
        .collect()
}

/// A stage of a gateway profile that claims a provider pause itself (`pause.json`, exit 75)
/// while the provider never said 429: its own run pauses, and another run of the same profile
/// is delivered meanwhile without a pause.
/// Catches: an agent's claim taken for the provider's (one stage could rest its profile across
/// the pool for up to a day).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stages_own_pause_claim_pauses_only_its_run() {
    let model = FakeModel::start(Script::writing("hello.txt", "hi", 0)).await;
    let (fixture, options) = through_the_gateway(&model, &["forge-pause", "FORGE-1"], "");
    let cluster =
        common::cluster::Cluster::start_with(fixture, 1, 1, Some(FLEET_TOKEN), options).await;
    let forger = cluster.submit("FORGE-1").await;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let view = cluster.run(&forger).await;
        if view["state"] == "paused" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the forging run never paused: {view}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let other = cluster.submit("FORGE-2").await;
    let views = cluster
        .wait_terminal(std::slice::from_ref(&other), Duration::from_secs(120))
        .await;
    assert_eq!(
        views[0]["state"],
        "delivered",
        "{}\n{}",
        views[0],
        cluster.logs()
    );
    assert!(
        !common::cluster::state_names(&views[0]).contains(&"paused"),
        "the other run of the profile was paused: {}",
        views[0]
    );
    assert_eq!(cluster.run(&forger).await["state"], "paused");
    assert!(
        model.requests().iter().all(|r| r.answer != "429"),
        "the provider never rate-limited anyone"
    );
    model.stop();
}

/// A profile with a daily budget of 200 tokens: the first run's only call is admitted (its
/// worst case, 100 bytes and 16 output tokens, fits in the day) and the provider states more
/// than the day's budget (366 tokens) on the first worker. That worker
/// then stops; the second run goes to a fresh worker, whose gateway knows nothing of the
/// first, so only the dispatcher's store can refuse it: the second call is refused at its
/// gateway, the run pauses until the next UTC day with the reason, and the provider sees one
/// call in all.
/// Catches: a daily budget counted per worker or per run (the second call would pass), a
/// refusal that fails the run instead of pausing it until the day's end, a dispatcher that
/// allots past the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profiles_daily_budget_is_one_across_the_pool() {
    let model = FakeModel::start(Script::writing("hello.txt", "hi", 0)).await;
    let (fixture, options) = through_the_gateway(
        &model,
        &["model-call", "127.0.0.1:9", "0"],
        "daily_budget = { max_tokens = 200 }\n",
    );
    let mut cluster =
        common::cluster::Cluster::start_with(fixture, 1, 1, Some(FLEET_TOKEN), options).await;
    let first = cluster.submit("DAY-1").await;
    let views = cluster
        .wait_terminal(std::slice::from_ref(&first), Duration::from_secs(120))
        .await;
    assert_eq!(
        views[0]["state"],
        "delivered",
        "{}\n{}",
        views[0],
        cluster.logs()
    );
    assert_eq!(
        model.requests().len(),
        1,
        "the first run's call: {:?}\n{}",
        model.requests(),
        cluster.logs()
    );

    cluster.start_worker("fresh", 1);
    cluster.workers[0].terminate(Duration::from_secs(30));
    let second = cluster.submit("DAY-2").await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let view = loop {
        let view = cluster.run(&second).await;
        if view["state"] == "paused" {
            break view;
        }
        let waiting = view["state"] == "queued" || view["state"] == "running";
        assert!(
            waiting && Instant::now() < deadline,
            "the second run never paused: {view}\n{}",
            cluster.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let text = view.to_string();
    assert!(
        text.contains("daily budget exhausted") && text.contains("daily_budget.max_tokens"),
        "the pause says why: {view}"
    );
    assert_eq!(
        model.requests().len(),
        1,
        "the refused call never reached the provider"
    );
    model.stop();
}

/// A fixture whose implementer (running `implementer`) and reviewer profiles call `model`
/// through the gateway, with `extra` lines in each profile, and the cluster options that give
/// the workers the providers file and the key.
fn through_the_gateway(
    model: &FakeModel,
    implementer: &[&str],
    extra: &str,
) -> (Fixture, common::cluster::Options) {
    let provider = format!("fake{}-anthropic-messages", model.port);
    let review = "---\nmax_retries: 1\n---\n# Review\nCheck the change.\n";
    let fixture = Fixture::new(Some(review), implementer, &["approve"]);
    std::fs::write(fixture.providers_file(), providers(&[model])).unwrap();
    let agents = std::fs::read_to_string(&fixture.agents).unwrap().replace(
        "timeout_seconds = 120\n",
        &format!("timeout_seconds = 120\nprovider = \"{provider}\"\n{extra}"),
    );
    std::fs::write(&fixture.agents, agents).unwrap();
    let options = common::cluster::Options {
        env: vec![
            (
                "FORGEPOOL_PROVIDERS_FILE".into(),
                fixture.providers_file().display().to_string(),
            ),
            ("ANTHROPIC_API_KEY".into(), MARKER.into()),
        ],
        ..Default::default()
    };
    (fixture, options)
}
