//! Delivering to real forges: git over HTTPS with a token (Debian's nginx serving
//! `git http-backend` through fcgiwrap, TLS from a test CA, HTTP basic authentication), with
//! the credentials of the forges file. The token must work when right, fail clearly when
//! wrong, and appear in nothing stored, printed or given to a stage. Needs `nginx-light`,
//! `fcgiwrap` and `openssl` (installed by `scripts/services.sh`).

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::api::{serve_json, ApiRequest};
use common::forge::{FakeGithub, GitHttps};
use common::Fixture;

const TOKEN: &str = common::forge::GITHUB_TOKEN;

fn run(dir: &Path, program: &str, args: &[&str]) {
    let output = common::output_within(
        Command::new(program).args(args).current_dir(dir),
        common::COMMAND_LIMIT,
    );
    assert!(output.status.success(), "{program} {args:?}: {output:?}");
}

/// A request for `ticket` on the repository at `url`, on `main`.
fn request(ticket: &str, url: &str) -> String {
    format!(
        "ticket = \"{ticket}\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n[repository]\nurl = \"{url}\"\nref = \"main\"\n"
    )
}

/// `forgepool run` of `request` (written to `{name}.toml`), with `env` added to the fixture's
/// environment and `removed` taken from it.
fn run_request(
    fixture: &Fixture,
    name: &str,
    request: &str,
    env: &[(&str, &std::ffi::OsStr)],
    removed: &[&str],
) -> common::Outcome {
    let file = fixture.dir.path().join(format!("{name}.toml"));
    std::fs::write(&file, request).unwrap();
    let mut command = fixture.command();
    command
        .arg("run")
        .arg(&file)
        .arg("--skills")
        .arg(&fixture.skills)
        .arg("--agents")
        .arg(&fixture.agents)
        .envs(env.iter().copied());
    for name in removed {
        command.env_remove(name);
    }
    fixture.outcome(command)
}

/// A test CA and a server certificate for 127.0.0.1 signed by it: `(ca.pem, cert, key)`.
/// Everything a run left that a user or an operator could read: the store's bytes, what
/// forgepool printed, and the branch's files.
fn everything_kept(fixture: &Fixture, outcome: &common::Outcome) -> String {
    let store = std::fs::read(fixture.dir.path().join("runs.db")).unwrap_or_default();
    format!(
        "{}\n{}\n{}",
        String::from_utf8_lossy(&store),
        outcome.stdout,
        outcome.stderr
    )
}

/// Catches: a token that does not reach forgepool's git (the push fails), a wrong token that
/// fails with a bare git error, a token that lands in the store, the output, a stage's
/// environment or mounts, and a missing token variable found only mid-run.
#[test]
fn a_token_from_the_forges_file_pushes_over_https_and_is_kept_nowhere() {
    let fixture = Fixture::new(None, &["env-dump"], &["approve"]);
    let tls = fixture.dir.path().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    let server = GitHttps::start(fixture.dir.path(), &tls, "x-access-token", TOKEN);
    let forges = fixture.dir.path().join("forges.toml");
    std::fs::write(
        &forges,
        format!(
            "[[forge]]\nhost = \"{}\"\nkind = \"github\"\napi_url = \"http://127.0.0.1:9/\"\ntoken_env = \"FORGE_TEST_TOKEN\"\nca_file = \"{}\"\n",
            server.host(),
            server.ca.display()
        ),
    )
    .unwrap();
    let url = format!("https://{}/repo.git", server.host());
    let run = |ticket: &str, token: Option<&str>| {
        let forges = ("FORGEPOOL_FORGES_FILE", forges.as_os_str());
        match token {
            Some(token) => run_request(
                &fixture,
                ticket,
                &request(ticket, &url),
                &[forges, ("FORGE_TEST_TOKEN", token.as_ref())],
                &[],
            ),
            None => run_request(
                &fixture,
                ticket,
                &request(ticket, &url),
                &[forges],
                &["FORGE_TEST_TOKEN"],
            ),
        }
    };

    let delivered = run("HTTPS-1", Some(TOKEN));
    assert_eq!(
        delivered.code, 0,
        "{}\n{}",
        delivered.stdout, delivered.stderr
    );
    assert_eq!(fixture.pushes("forge/https-1"), 1);
    let env = fixture.branch_file("forge/https-1", "env.txt");
    let mounts = fixture.branch_file("forge/https-1", "mounts.txt");
    assert!(
        env.contains("FORGE_STAGE=implement"),
        "the agent's environment: {env}"
    );
    assert!(
        !env.contains(TOKEN) && !env.contains("FORGE_TEST_TOKEN"),
        "{env}"
    );
    assert!(
        !mounts.contains("forges") && !mounts.contains("ca.pem"),
        "{mounts}"
    );
    assert!(!everything_kept(&fixture, &delivered).contains(TOKEN));

    let refused = run("HTTPS-2", Some("ghs_wrongToken"));
    assert_eq!(refused.code, 1, "{}\n{}", refused.stdout, refused.stderr);
    let reason = refused.record().states.last().unwrap().1.clone();
    assert!(
        reason.contains(&format!(
            "{} refused the token in $FORGE_TEST_TOKEN",
            server.host()
        )),
        "{reason}"
    );
    assert_eq!(fixture.pushes("forge/https-2"), 0);
    assert!(!everything_kept(&fixture, &refused).contains("ghs_wrongToken"));

    let unset = run("HTTPS-3", None);
    assert_eq!(unset.code, 2, "{}\n{}", unset.stdout, unset.stderr);
    assert!(
        unset
            .stderr
            .contains("token_env names FORGE_TEST_TOKEN, which is not set"),
        "{}",
        unset.stderr
    );
    assert!(unset.stderr.contains("forges.toml"), "{}", unset.stderr);
}

/// Debian's sshd on a loopback port, letting in one deploy key as root (the repositories are
/// root's), with a host key of its own.
struct GitSsh {
    child: Child,
    port: u16,
    /// `[127.0.0.1]:PORT ssh-ed25519 …`: the line a pinned `known_hosts` holds.
    host_line: String,
}

impl Drop for GitSsh {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl GitSsh {
    fn start(dir: &Path, deploy_public_key: &Path) -> GitSsh {
        assert!(
            Path::new("/usr/sbin/sshd").exists(),
            "/usr/sbin/sshd is missing: run scripts/services.sh (it installs openssh-server)"
        );
        run(
            dir,
            "ssh-keygen",
            &["-q", "-t", "ed25519", "-N", "", "-f", "host_key"],
        );
        std::fs::copy(deploy_public_key, dir.join("authorized_keys")).unwrap();
        std::fs::create_dir_all("/run/sshd").unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        std::fs::write(
            dir.join("sshd_config"),
            format!(
                "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\nAuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let child = Command::new("/usr/sbin/sshd")
            .args([
                "-D",
                "-e",
                "-f",
                &dir.join("sshd_config").display().to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("sshd.log")).unwrap())
            .spawn()
            .expect("sshd starts");
        let key = std::fs::read_to_string(dir.join("host_key.pub")).unwrap();
        let key: Vec<&str> = key.split_whitespace().take(2).collect();
        let server = GitSsh {
            child,
            port,
            host_line: format!("[127.0.0.1]:{port} {}\n", key.join(" ")),
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "sshd did not listen: {}",
                std::fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        server
    }
}

/// Catches: a deploy key that forgepool's git does not use (the push is refused), and an
/// unknown host key that is learned instead of refused.
#[test]
fn a_deploy_key_pushes_over_ssh_to_a_pinned_host_and_an_unknown_host_key_is_refused() {
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let keys = fixture.dir.path().join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    run(
        &keys,
        "ssh-keygen",
        &["-q", "-t", "ed25519", "-N", "", "-f", "deploy_key"],
    );
    let server = GitSsh::start(&keys, &keys.join("deploy_key.pub"));
    let pinned = keys.join("known_hosts");
    std::fs::write(&pinned, &server.host_line).unwrap();
    // Another key for the same host: what a man in the middle would show.
    run(
        &keys,
        "ssh-keygen",
        &["-q", "-t", "ed25519", "-N", "", "-f", "other_key"],
    );
    let other = std::fs::read_to_string(keys.join("other_key.pub")).unwrap();
    let other: Vec<&str> = other.split_whitespace().take(2).collect();
    let wrong = keys.join("wrong_known_hosts");
    std::fs::write(
        &wrong,
        format!("[127.0.0.1]:{} {}\n", server.port, other.join(" ")),
    )
    .unwrap();

    let run_with = |ticket: &str, known_hosts: &Path| {
        let forges = fixture.dir.path().join(format!("forges-{ticket}.toml"));
        std::fs::write(
            &forges,
            format!(
                "[[forge]]\nhost = \"127.0.0.1:{}\"\nkind = \"gitea\"\napi_url = \"http://127.0.0.1:9/\"\nssh_key_file = \"{}\"\nknown_hosts_file = \"{}\"\n",
                server.port,
                keys.join("deploy_key").display(),
                known_hosts.display()
            ),
        )
        .unwrap();
        let url = format!(
            "ssh://root@127.0.0.1:{}{}",
            server.port,
            fixture.bare.display()
        );
        let env = [("FORGEPOOL_FORGES_FILE", forges.as_os_str())];
        run_request(&fixture, ticket, &request(ticket, &url), &env, &[])
    };

    let delivered = run_with("SSH-1", &pinned);
    assert_eq!(
        delivered.code, 0,
        "{}\n{}",
        delivered.stdout, delivered.stderr
    );
    assert_eq!(fixture.pushes("forge/ssh-1"), 1);

    let refused = run_with("SSH-2", &wrong);
    assert_eq!(refused.code, 1, "{}\n{}", refused.stdout, refused.stderr);
    let reason = refused.record().states.last().unwrap().1.clone();
    assert!(reason.contains("is not the one pinned in"), "{reason}");
    assert!(reason.contains("known_hosts_file"), "{reason}");
    assert_eq!(fixture.pushes("forge/ssh-2"), 0);
    let learned = std::fs::read_to_string(&wrong).unwrap();
    assert!(
        !learned.contains(&server.host_line),
        "the host key was not learned"
    );
}

/// The requests a receiver took: headers (lowercased) and body.
type Taken =
    std::sync::Arc<std::sync::Mutex<Vec<(std::collections::HashMap<String, String>, Vec<u8>)>>>;

/// A webhook receiver on loopback: each request's headers (lowercased) and body, answered
/// with the next status of its script (then 200).
struct Receiver {
    port: u16,
    requests: Taken,
}

impl Receiver {
    fn start(mut statuses: std::collections::VecDeque<u16>) -> Receiver {
        use std::io::{BufRead, BufReader, Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = std::sync::Arc::clone(&requests);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut headers = std::collections::HashMap::new();
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                loop {
                    line.clear();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 || line.trim().is_empty() {
                        break;
                    }
                    if let Some((name, value)) = line.split_once(':') {
                        headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
                    }
                }
                let length = headers
                    .get("content-length")
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(0);
                let mut body = vec![0; length];
                let _ = reader.read_exact(&mut body);
                kept.lock().unwrap().push((headers, body));
                let status = statuses.pop_front().unwrap_or(200);
                let mut stream = stream;
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
            }
        });
        Receiver { port, requests }
    }
}

/// Catches: no webhook on a terminal state, a body without the run's outcome, a signature a
/// receiver cannot check, a failing receiver not retried, and attempts not recorded with the
/// run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_is_signed_retried_and_each_attempt_recorded() {
    const SECRET: &str = "webhook-secret-0123456789";
    let receiver = Receiver::start([503].into_iter().collect());
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let hooks = fixture.dir.path().join("webhooks.toml");
    std::fs::write(
        &hooks,
        format!(
            "[[webhook]]\nname = \"ci-bot\"\nurl = \"http://127.0.0.1:{}/hook\"\nsecret_env = \"HOOK_SECRET\"\n",
            receiver.port
        ),
    )
    .unwrap();
    let options = common::cluster::Options {
        env: vec![
            (
                "FORGEPOOL_WEBHOOKS_FILE".into(),
                hooks.display().to_string(),
            ),
            ("HOOK_SECRET".into(), SECRET.into()),
        ],
        ..Default::default()
    };
    let cluster = common::cluster::Cluster::start_with(fixture, 1, 1, None, options).await;
    let run_id = cluster.submit("HOOK-1").await;
    let (view, _) = cluster.wait_one(&run_id, Duration::from_secs(60)).await;
    assert_eq!(view["state"], "delivered");
    let started = Instant::now();
    while receiver.requests.lock().unwrap().len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the webhook was not retried"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let requests = receiver.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 2, "one failure, one delivery");
    let key = proto::JobKey::new(SECRET).unwrap();
    for (headers, body) in &requests {
        assert_eq!(
            headers.get("x-forgepool-signature-256"),
            Some(&key.sign(body)),
            "the signature checks"
        );
        let body: serde_json::Value = serde_json::from_slice(body).unwrap();
        assert_eq!(body["run_id"], run_id.as_str());
        assert_eq!(body["ticket"], "HOOK-1");
        assert_eq!(body["state"], "delivered");
        assert_eq!(body["branch"], "forge/hook-1");
        assert_eq!(body["commit"], view["result"]["commit"]);
    }
    assert_eq!(
        requests[0].0.get("x-forgepool-delivery"),
        requests[1].0.get("x-forgepool-delivery"),
        "both attempts are one notification"
    );
    let mut attempts = Vec::new();
    let started = Instant::now();
    while attempts.len() < 2 && started.elapsed() < Duration::from_secs(10) {
        attempts = cluster
            .event_stream(&run_id)
            .await
            .lines()
            .filter(|l| l.starts_with("data:") && l.contains("\"webhook\""))
            .map(|l| serde_json::from_str::<serde_json::Value>(&l[5..]).unwrap())
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let summary: Vec<_> = attempts
        .iter()
        .map(|a| {
            (
                a["attempt"].clone(),
                a["status"].clone(),
                a["outcome"].clone(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (1.into(), 503.into(), "retrying".into()),
            (2.into(), 200.into(), "delivered".into())
        ],
        "{attempts:?}"
    );
    cluster.delete_queues().await;
}

/// Catches: `forgepool run` exiting before its webhooks are told, or telling them without
/// recording the attempt.
#[test]
fn forgepool_run_tells_its_webhooks_before_it_exits() {
    const SECRET: &str = "webhook-secret-0123456789";
    let receiver = Receiver::start(std::collections::VecDeque::new());
    let fixture = Fixture::new(None, &["change"], &["approve"]);
    let hooks = fixture.dir.path().join("webhooks.toml");
    std::fs::write(
        &hooks,
        format!(
            "[[webhook]]\nname = \"local\"\nurl = \"http://127.0.0.1:{}/\"\nsecret_env = \"HOOK_SECRET\"\nstates = [\"delivered\"]\n",
            receiver.port
        ),
    )
    .unwrap();
    let url = format!("file://{}", fixture.bare.display());
    let env = [
        ("FORGEPOOL_WEBHOOKS_FILE", hooks.as_os_str()),
        ("HOOK_SECRET", SECRET.as_ref()),
    ];
    let outcome = run_request(&fixture, "LOCAL-1", &request("LOCAL-1", &url), &env, &[]);
    assert_eq!(outcome.code, 0, "{}\n{}", outcome.stdout, outcome.stderr);
    assert!(
        outcome
            .stdout
            .contains("Webhook local: attempt 1, delivered"),
        "{}",
        outcome.stdout
    );
    let requests = receiver.requests.lock().unwrap().clone();
    assert_eq!(requests.len(), 1);
    let (headers, body) = &requests[0];
    assert_eq!(
        headers.get("x-forgepool-signature-256"),
        Some(&proto::JobKey::new(SECRET).unwrap().sign(body))
    );
    let recorded = outcome
        .events
        .iter()
        .filter(|e| matches!(&e.kind, proto::EventKind::Webhook { outcome, .. } if outcome == "delivered"))
        .count();
    assert_eq!(recorded, 1, "the attempt is in the run's record");
}

/// A review that ends `delivered_with_warnings` when exhausted (a draft pull request).
const LENIENT_REVIEW: &str =
    "---\nmax_retries: 1\nblock_on_failure: false\n---\n# Check\nAPPROVED when tests.txt exists.\n";

/// Adds the reviewer profile `rejecter`, which always rejects.
fn with_rejecter(fixture: Fixture) -> Fixture {
    let mut agents = std::fs::read_to_string(&fixture.agents).unwrap();
    agents.push_str("\n[agents.rejecter]\nimage = \"forgepool-test-agent:dev\"\ncommand = [\"/bin/sh\", \"/agents/reviewer.sh\", \"reject\"]\nmemory = \"128m\"\ntimeout_seconds = 60\n");
    std::fs::write(&fixture.agents, agents).unwrap();
    fixture
}

/// Catches: no pull request after delivery, a second pull request when the ticket is
/// delivered again (it must update the open one), a request GitHub's schema refuses (Prism
/// answers 422 and the pull request is missing), no commit status, and a pull request
/// missing from the result, the report and the progress lines.
#[test]
fn github_pull_requests_are_opened_once_and_updated_on_redelivery() {
    let fixture = with_rejecter(Fixture::new(
        Some(LENIENT_REVIEW),
        &["change"],
        &["approve"],
    ));
    let tls = fixture.dir.path().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    // The repository at https://HOST/acme/shop.git is the fixture's.
    let served = fixture.dir.path().join("served");
    std::fs::create_dir_all(served.join("acme")).unwrap();
    std::os::unix::fs::symlink(&fixture.bare, served.join("acme/shop.git")).unwrap();
    let server = GitHttps::start(&served, &tls, "x-access-token", TOKEN);
    let github = FakeGithub::start(fixture.dir.path());
    let forges = fixture.dir.path().join("forges.toml");
    std::fs::write(
        &forges,
        format!(
            "run_url = \"https://forgepool.example/runs/{{run_id}}\"\n[[forge]]\nhost = \"{}\"\nkind = \"github\"\napi_url = \"http://127.0.0.1:{}\"\ngraphql_url = \"http://127.0.0.1:{}/graphql\"\ntoken_env = \"FORGE_TEST_TOKEN\"\nca_file = \"{}\"\n",
            server.host(),
            github.port,
            github.upstream,
            server.ca.display()
        ),
    )
    .unwrap();
    let url = format!("https://{}/acme/shop.git", server.host());
    let run = |reviewer: &str| {
        let env = [
            ("FORGEPOOL_FORGES_FILE", forges.as_os_str()),
            ("FORGE_TEST_TOKEN", TOKEN.as_ref()),
        ];
        let text = format!(
            "{}[agents]\nreviewer = \"{reviewer}\"\n",
            request("PR-1", &url)
        );
        run_request(&fixture, "PR-1", &text, &env, &[])
    };
    let first = run("rejecter");
    assert_eq!(first.code, 0, "{}\n{}", first.stdout, first.stderr);
    let url = "https://github.example/acme/shop/pull/1";
    assert!(
        first
            .stdout
            .contains(&format!("Pull request opened: {url}")),
        "{}\n{:?}",
        first.stdout,
        first.record().result.as_ref().map(|r| r.warnings.clone())
    );
    let result = first.record().result.clone().unwrap();
    assert_eq!(result.pull_request.as_deref(), Some(url));
    assert!(result.report.contains(&format!("Pull request: {url}")));
    assert!(github.state.lock().unwrap().pulls[0].5, "opened as a draft");
    let second = run("rev");
    assert_eq!(second.code, 0, "{}\n{}", second.stdout, second.stderr);
    assert!(
        second
            .stdout
            .contains(&format!("Pull request updated: {url}")),
        "{}",
        second.stdout
    );
    let state = github.state.lock().unwrap();
    assert_eq!(
        state.pulls.len(),
        1,
        "one pull request: {:?}",
        state.requests
    );
    let (_, head, base, title, body, draft) = &state.pulls[0];
    assert_eq!(
        (head.as_str(), base.as_str(), *draft),
        ("forge/pr-1", "main", false),
        "ready for review once approved"
    );
    assert_eq!(title, "PR-1: Add the feature");
    assert!(body.contains("# PR-1"), "the report is the body: {body}");
    assert_eq!(state.statuses, 2, "a status on each delivered commit");
    let link = format!("https://forgepool.example/runs/{}", second.run_id.unwrap());
    assert!(
        state.requests.iter().any(|(m, p, body)| m == "POST"
            && p.contains("/statuses/")
            && body["target_url"] == link.as_str()),
        "the status links to the run: {:?}",
        state.requests
    );
    assert!(
        state
            .requests
            .iter()
            .any(|(m, p, _)| m == "PATCH" && p == "/repos/acme/shop/pulls/1"),
        "{:?}",
        state.requests
    );
    assert_eq!(fixture.pushes("forge/pr-1"), 2);
}

/// A merge or pull request a hand-modelled forge keeps: number, head, base, title, body.
type KeptPull = (u64, String, String, String, String);

/// What a hand-modelled GitLab or Gitea saw and keeps.
#[derive(Default)]
struct ForgeState {
    requests: Vec<String>,
    pulls: Vec<KeptPull>,
    statuses: Vec<String>,
    links: Vec<String>,
}

/// A stateful fake of GitLab's REST v4 or Gitea's REST v1, modelled by hand on their
/// documentation (neither publishes a packaged OpenAPI description to validate against; see
/// README.md, scripts/forge-tools.sh): it refuses a request without the kind's authorization header, a body
/// without a required field or with a field the endpoint does not take, and a state the
/// endpoint does not know, as the real ones do (400 on GitLab, 422 on Gitea).
fn fake_forge(
    kind: &'static str,
    token: &'static str,
) -> (u16, std::sync::Arc<std::sync::Mutex<ForgeState>>) {
    let state = std::sync::Arc::new(std::sync::Mutex::new(ForgeState::default()));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let kept = std::sync::Arc::clone(&state);
    serve_json(listener, move |request| {
        let mut state = kept.lock().unwrap();
        state.requests.push(format!(
            "{} {}?{}",
            request.method, request.path, request.query
        ));
        match kind {
            "gitlab" => gitlab_answer(&mut state, request, token),
            _ => gitea_answer(&mut state, request, token),
        }
    });
    (port, state)
}

/// Checks a JSON body: every `required` field a string, nothing outside `allowed`.
fn body_refusal(body: &serde_json::Value, required: &[&str], allowed: &[&str]) -> Option<String> {
    let Some(fields) = body.as_object() else {
        return Some("the body is not a JSON object".into());
    };
    if let Some(missing) = required
        .iter()
        .find(|k| !fields.get(**k).is_some_and(|v| v.is_string()))
    {
        return Some(format!("{missing} is missing"));
    }
    fields
        .keys()
        .find(|k| !allowed.contains(&k.as_str()))
        .map(|k| format!("{k} does not exist"))
}

/// GitLab v4 (docs.gitlab.com: "Merge requests API", "Commits API: set the pipeline status of
/// a commit", "Projects API: get a single project").
fn gitlab_answer(
    state: &mut ForgeState,
    request: &ApiRequest,
    token: &str,
) -> (u16, serde_json::Value) {
    use serde_json::json;
    if request.header("authorization") != Some(&format!("Bearer {token}")) {
        return (401, json!({"message": "401 Unauthorized"}));
    }
    let project = "/api/v4/projects/acme%2Fshop";
    let merge_request = |pull: &KeptPull| {
        json!({"id": 100 + pull.0, "iid": pull.0, "project_id": 7, "title": pull.3,
            "description": pull.4, "state": "opened", "source_branch": pull.1,
            "target_branch": pull.2, "draft": pull.3.starts_with("Draft:"),
            "web_url": format!("https://gitlab.example/acme/shop/-/merge_requests/{}", pull.0)})
    };
    let mr_fields = [
        "source_branch",
        "target_branch",
        "title",
        "description",
        "assignee_id",
        "assignee_ids",
        "reviewer_ids",
        "labels",
        "milestone_id",
        "remove_source_branch",
        "squash",
        "allow_collaboration",
        "target_project_id",
    ];
    let path = request.path.as_str();
    match (request.method.as_str(), path.strip_prefix(project)) {
        ("GET", Some("")) => (
            200,
            json!({"id": 7, "path_with_namespace": "acme/shop", "default_branch": "main"}),
        ),
        ("GET", Some("/merge_requests")) => {
            let asked = |key: &str| {
                request
                    .query
                    .split('&')
                    .find_map(|p| p.strip_prefix(&format!("{key}=")))
                    .unwrap_or("")
                    .to_string()
            };
            if asked("state") != "opened" {
                return (
                    400,
                    json!({"error": "state must be opened, closed, locked, merged or all"}),
                );
            }
            let open: Vec<_> = state
                .pulls
                .iter()
                .filter(|p| {
                    asked("source_branch") == p.1.replace('/', "%2F")
                        && asked("target_branch") == p.2
                })
                .map(merge_request)
                .collect();
            (200, serde_json::Value::Array(open))
        }
        ("POST", Some("/merge_requests")) => {
            if let Some(error) = body_refusal(
                &request.body,
                &["source_branch", "target_branch", "title"],
                &mr_fields,
            ) {
                return (400, json!({"error": error}));
            }
            let text = |k: &str| request.body[k].as_str().unwrap_or("").to_string();
            let pull = (
                state.pulls.len() as u64 + 1,
                text("source_branch"),
                text("target_branch"),
                text("title"),
                text("description"),
            );
            state.pulls.push(pull.clone());
            (201, merge_request(&pull))
        }
        ("PUT", Some(rest)) if rest.starts_with("/merge_requests/") => {
            let iid: u64 = rest.rsplit('/').next().unwrap().parse().unwrap_or(0);
            let editable = [
                "title",
                "description",
                "target_branch",
                "assignee_id",
                "labels",
                "state_event",
                "squash",
                "discussion_locked",
            ];
            if let Some(error) = body_refusal(&request.body, &[], &editable) {
                return (400, json!({"error": error}));
            }
            let Some(kept) = state.pulls.iter_mut().find(|p| p.0 == iid) else {
                return (404, json!({"message": "404 Not found"}));
            };
            kept.3 = request.body["title"]
                .as_str()
                .unwrap_or(&kept.3)
                .to_string();
            kept.4 = request.body["description"]
                .as_str()
                .unwrap_or(&kept.4)
                .to_string();
            let kept = kept.clone();
            (200, merge_request(&kept))
        }
        ("POST", Some(rest)) if rest.starts_with("/statuses/") => {
            let allowed = [
                "state",
                "ref",
                "name",
                "context",
                "target_url",
                "description",
                "coverage",
                "pipeline_id",
            ];
            let states = ["pending", "running", "success", "failed", "canceled"];
            if let Some(error) = body_refusal(&request.body, &["state"], &allowed) {
                return (400, json!({"error": error}));
            }
            let asked = request.body["state"].as_str().unwrap_or("");
            if !states.contains(&asked) {
                return (400, json!({"error": "state does not have a valid value"}));
            }
            state.statuses.push(asked.to_string());
            let link = request.body["target_url"].as_str().unwrap_or("");
            state.links.push(link.to_string());
            (
                201,
                json!({"id": 1, "sha": rest.trim_start_matches("/statuses/"), "status": asked, "name": request.body["name"]}),
            )
        }
        _ => (404, json!({"message": "404 Not found"})),
    }
}

/// Gitea v1 (its swagger: `CreatePullRequestOption`, `EditPullRequestOption`,
/// `CreateStatusOption`; an edited pull request is answered 201).
fn gitea_answer(
    state: &mut ForgeState,
    request: &ApiRequest,
    token: &str,
) -> (u16, serde_json::Value) {
    use serde_json::json;
    if request.header("authorization") != Some(&format!("token {token}")) {
        return (401, json!({"message": "token is required"}));
    }
    let repository = "/api/v1/repos/acme/shop";
    let pull_json = |pull: &KeptPull| {
        json!({"id": 100 + pull.0, "number": pull.0, "title": pull.3, "body": pull.4,
            "state": "open", "draft": pull.3.starts_with("WIP:"),
            "head": {"ref": pull.1, "label": pull.1}, "base": {"ref": pull.2, "label": pull.2},
            "html_url": format!("https://gitea.example/acme/shop/pulls/{}", pull.0)})
    };
    match (
        request.method.as_str(),
        request.path.strip_prefix(repository),
    ) {
        ("GET", Some("")) => (
            200,
            json!({"id": 3, "full_name": "acme/shop", "default_branch": "main"}),
        ),
        ("GET", Some("/pulls")) => {
            if !request.query.split('&').any(|p| p == "state=open") {
                return (422, json!({"message": "state must be open, closed or all"}));
            }
            (
                200,
                serde_json::Value::Array(state.pulls.iter().map(pull_json).collect()),
            )
        }
        ("POST", Some("/pulls")) => {
            let allowed = [
                "assignee",
                "assignees",
                "base",
                "body",
                "due_date",
                "head",
                "labels",
                "milestone",
                "title",
                "reviewers",
                "team_reviewers",
            ];
            if let Some(error) = body_refusal(&request.body, &["head", "base", "title"], &allowed) {
                return (422, json!({"message": error}));
            }
            let text = |k: &str| request.body[k].as_str().unwrap_or("").to_string();
            let pull = (
                state.pulls.len() as u64 + 1,
                text("head"),
                text("base"),
                text("title"),
                text("body"),
            );
            state.pulls.push(pull.clone());
            (201, pull_json(&pull))
        }
        ("PATCH", Some(rest)) if rest.starts_with("/pulls/") => {
            let allowed = [
                "allow_maintainer_edit",
                "assignee",
                "assignees",
                "base",
                "body",
                "due_date",
                "labels",
                "milestone",
                "state",
                "title",
                "unset_due_date",
            ];
            if let Some(error) = body_refusal(&request.body, &[], &allowed) {
                return (422, json!({"message": error}));
            }
            let number: u64 = rest.rsplit('/').next().unwrap().parse().unwrap_or(0);
            let Some(kept) = state.pulls.iter_mut().find(|p| p.0 == number) else {
                return (404, json!({"message": "pull request does not exist"}));
            };
            kept.3 = request.body["title"]
                .as_str()
                .unwrap_or(&kept.3)
                .to_string();
            kept.4 = request.body["body"].as_str().unwrap_or(&kept.4).to_string();
            let kept = kept.clone();
            (201, pull_json(&kept))
        }
        ("POST", Some(rest)) if rest.starts_with("/statuses/") => {
            let states = ["pending", "success", "error", "failure", "warning"];
            if let Some(error) = body_refusal(
                &request.body,
                &["state"],
                &["context", "description", "state", "target_url"],
            ) {
                return (422, json!({"message": error}));
            }
            let asked = request.body["state"].as_str().unwrap_or("");
            if !states.contains(&asked) {
                return (422, json!({"message": "state is not valid"}));
            }
            state.statuses.push(asked.to_string());
            let link = request.body["target_url"].as_str().unwrap_or("");
            state.links.push(link.to_string());
            (
                201,
                json!({"id": 1, "status": asked, "context": request.body["context"]}),
            )
        }
        _ => (404, json!({"message": "not found"})),
    }
}

/// Delivers the same ticket twice to a GitLab or Gitea fake: first with the review exhausted
/// (delivered with warnings: a draft), then approved.
fn pull_requests_on(kind: &'static str, user: &str, draft_mark: &str, web: &str) {
    const FORGE_TOKEN: &str = "glpat-forgepoolTestToken0123";
    let fixture = with_rejecter(Fixture::new(
        Some(LENIENT_REVIEW),
        &["change"],
        &["approve"],
    ));
    let tls = fixture.dir.path().join("tls");
    std::fs::create_dir_all(&tls).unwrap();
    let served = fixture.dir.path().join("served");
    std::fs::create_dir_all(served.join("acme")).unwrap();
    std::os::unix::fs::symlink(&fixture.bare, served.join("acme/shop.git")).unwrap();
    let server = GitHttps::start(&served, &tls, user, FORGE_TOKEN);
    let (port, state) = fake_forge(kind, FORGE_TOKEN);
    let api = if kind == "gitlab" { "api/v4" } else { "api/v1" };
    let forges = fixture.dir.path().join("forges.toml");
    std::fs::write(
        &forges,
        format!(
            "run_url = \"https://forgepool.example/runs/{{run_id}}\"\n[[forge]]\nhost = \"{}\"\nkind = \"{kind}\"\napi_url = \"http://127.0.0.1:{port}/{api}\"\ntoken_env = \"FORGE_TEST_TOKEN\"\nca_file = \"{}\"\n",
            server.host(),
            server.ca.display()
        ),
    )
    .unwrap();
    let url = format!("https://{}/acme/shop.git", server.host());
    let run = |reviewer: &str| {
        let env = [
            ("FORGEPOOL_FORGES_FILE", forges.as_os_str()),
            ("FORGE_TEST_TOKEN", FORGE_TOKEN.as_ref()),
        ];
        let text = format!(
            "{}[agents]\nreviewer = \"{reviewer}\"\n",
            request("PR-1", &url)
        );
        run_request(&fixture, "PR-1", &text, &env, &[])
    };
    let first = run("rejecter");
    assert_eq!(first.code, 0, "{}\n{}", first.stdout, first.stderr);
    assert!(
        first
            .stdout
            .contains(&format!("Pull request opened: {web}")),
        "{}\n{:?}",
        first.stdout,
        state.lock().unwrap().requests
    );
    assert_eq!(
        first
            .record()
            .result
            .as_ref()
            .unwrap()
            .pull_request
            .as_deref(),
        Some(web)
    );
    {
        let state = state.lock().unwrap();
        assert_eq!(state.pulls.len(), 1, "{:?}", state.requests);
        assert_eq!(
            state.pulls[0].3,
            format!("{draft_mark}PR-1: Add the feature"),
            "a draft"
        );
    }
    let second = run("rev");
    assert_eq!(second.code, 0, "{}\n{}", second.stdout, second.stderr);
    assert!(
        second
            .stdout
            .contains(&format!("Pull request updated: {web}")),
        "{}",
        second.stdout
    );
    let state = state.lock().unwrap();
    assert_eq!(
        state.pulls.len(),
        1,
        "one pull request: {:?}",
        state.requests
    );
    let (_, head, base, title, body) = &state.pulls[0];
    assert_eq!((head.as_str(), base.as_str()), ("forge/pr-1", "main"));
    assert_eq!(title, "PR-1: Add the feature", "no longer a draft");
    assert!(body.contains("# PR-1"), "the report is the body: {body}");
    let failed = if kind == "gitlab" {
        "failed"
    } else {
        "failure"
    };
    assert_eq!(
        state.statuses,
        [failed, "success"],
        "a status on each delivered commit"
    );
    assert_eq!(fixture.pushes("forge/pr-1"), 2);
    let run_id = second.run_id.unwrap();
    assert_eq!(
        state.links.last().map(String::as_str),
        Some(format!("https://forgepool.example/runs/{run_id}").as_str()),
        "the status links to the run"
    );
}

/// Catches: no merge request on GitLab, a second one on redelivery, a draft not marked (or
/// still marked once approved), a request GitLab refuses (a project path sent unencoded, a
/// field it does not take, a wrong status state, a missing bearer token), and no status.
#[test]
fn gitlab_merge_requests_are_opened_once_marked_draft_and_updated() {
    pull_requests_on(
        "gitlab",
        "oauth2",
        "Draft: ",
        "https://gitlab.example/acme/shop/-/merge_requests/1",
    );
}

/// Catches: the same on Gitea or Forgejo (its `token` authorization, its `WIP: ` drafts, its
/// status states).
#[test]
fn gitea_pull_requests_are_opened_once_marked_draft_and_updated() {
    pull_requests_on(
        "gitea",
        "forgepool",
        "WIP: ",
        "https://gitea.example/acme/shop/pulls/1",
    );
}
