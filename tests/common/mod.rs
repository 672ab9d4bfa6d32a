//! The end-to-end harness: real git repositories, a real Docker engine, the real binary.
//!
//! A [`Fixture`] makes a bare repository with one commit on `main`, a skills folder and an
//! agents file that use the test agent image; [`Fixture::run`] runs `forgepool run` on it and
//! returns what a user sees: the exit code, the printed lines, and the stored run.
//!
//! A test that cannot reach Docker or the test image fails and says which script to run; none
//! skips. The harness never waits without a limit: a service's ready line (90 s), each API
//! request and each client command (120 s), each exchange with the broker (30 s), each docker,
//! curl, rabbitmqctl, gdb or `forgepool run` command. A stuck service fails its test with a
//! message that names what did not answer; nextest's 5-minute limit is only the last resort. A
//! passing test stops its services *before* deleting its queues: a consumer whose quorum queue is
//! deleted under it declares the topology again, so the queues came back and piled up on the
//! broker.

#![allow(dead_code)]

pub mod api;
pub mod browser;
pub mod cluster;
pub mod forge;
pub mod kinds;
pub mod model;
pub mod postgres;
pub mod proxy;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use dispatcher::store::{RunRecord, RunStore, SqliteStore};
use proto::Event;
use uuid::Uuid;

/// The image the test agents live in; `scripts/build-images.sh` builds it.
pub const TEST_IMAGE: &str = "forgepool-test-agent:dev";

/// How long a command of the harness (docker, curl, rabbitmqctl) may take.
pub const COMMAND_LIMIT: Duration = Duration::from_secs(60);

/// Runs `command` to its end within `limit`; past it, kills it and panics naming it. No test
/// waits on an engine or a broker that stopped answering: it fails and says which.
pub fn output_within(command: &mut Command, limit: Duration) -> Output {
    let what = format!("{command:?}");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what} cannot start: {e}"));
    // Read both pipes beside the wait, so that a full pipe never stalls the command.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the command can be waited on") {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not finish within {limit:?}: the service it talks to stopped answering"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// Fails (never skips) when the Docker engine or the test image is missing.
pub fn require_docker() {
    let info = output_within(Command::new("docker").arg("info"), COMMAND_LIMIT);
    if !info.status.success() {
        panic!("the Docker engine is not reachable: start it with `scripts/services.sh` (or `dockerd &`) and run the tests again");
    }
    let image = output_within(
        Command::new("docker").args(["image", "inspect", TEST_IMAGE]),
        COMMAND_LIMIT,
    );
    if !image.status.success() {
        panic!("the test image {TEST_IMAGE} is missing: build it with `scripts/build-images.sh`");
    }
}

/// A temporary world for one run.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub bare: PathBuf,
    pub skills: PathBuf,
    pub agents: PathBuf,
}

/// What a user sees after `forgepool run`.
pub struct Outcome {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub run_id: Option<Uuid>,
    pub record: Option<RunRecord>,
    pub events: Vec<Event>,
}

impl Fixture {
    /// A repository, the skill `implement-task` with `review_md` (none when `None`), and agent
    /// profiles running the test agents with the given arguments.
    pub fn new(
        review_md: Option<&str>,
        implementer_args: &[&str],
        reviewer_args: &[&str],
    ) -> Fixture {
        Fixture::with_image(review_md, implementer_args, reviewer_args, TEST_IMAGE)
    }

    /// Like [`Fixture::new`] with another implementer image.
    pub fn with_image(
        review_md: Option<&str>,
        implementer_args: &[&str],
        reviewer_args: &[&str],
        image: &str,
    ) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        Fixture::with_image_in(dir, review_md, implementer_args, reviewer_args, image)
    }

    /// Like [`Fixture::new`], in `dir` (a folder other processes than this one's may need to
    /// see, where a host of `scripts/hosts.sh` has a `/tmp` of its own).
    pub fn with_image_in(
        dir: tempfile::TempDir,
        review_md: Option<&str>,
        implementer_args: &[&str],
        reviewer_args: &[&str],
        image: &str,
    ) -> Fixture {
        require_docker();
        let bare = dir.path().join("repo.git");
        git(
            dir.path(),
            &[
                "init",
                "--quiet",
                "--bare",
                "--initial-branch=main",
                bare.to_str().unwrap(),
            ],
        );
        let seed = dir.path().join("seed");
        git(
            dir.path(),
            &[
                "clone",
                "--quiet",
                bare.to_str().unwrap(),
                seed.to_str().unwrap(),
            ],
        );
        std::fs::write(seed.join("README.md"), "# The project\n").unwrap();
        git(&seed, &["add", "-A"]);
        git(
            &seed,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "--quiet",
                "-m",
                "start",
            ],
        );
        git(&seed, &["push", "--quiet", "origin", "HEAD:main"]);
        // A server-side hook logs every ref update the repository made (after the fact, so a
        // refused push is not counted), and a second push is counted even when it rewrites
        // the branch.
        let hook = bare.join("hooks/post-receive");
        std::fs::write(
            &hook,
            format!(
                "#!/bin/sh\nwhile read old new reference; do echo \"$reference $old $new\" >> '{}'; done\n",
                dir.path().join("pushes.log").display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();

        let skills = dir.path().join("skills");
        let skill = skills.join("default/implement-task");
        std::fs::create_dir_all(&skill).unwrap();
        std::fs::write(
            skill.join("SKILL.md"),
            "# Implement\nDo what the brief says.\n",
        )
        .unwrap();
        if let Some(review) = review_md {
            std::fs::write(skill.join("review.md"), review).unwrap();
        }
        let quote = |args: &[&str]| {
            args.iter()
                .map(|a| format!("{a:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let agents = dir.path().join("agents.toml");
        std::fs::write(
            &agents,
            format!(
                "[defaults]\nimplementer = \"impl\"\nreviewer = \"rev\"\n\n\
                 [agents.impl]\nimage = \"{image}\"\ncommand = [\"/bin/sh\", \"/agents/implementer.sh\", {}]\nmemory = \"128m\"\ncpus = 0.5\ntimeout_seconds = 120\nenv = [\"AGENT_SECRET\"]\n\n\
                 [agents.rev]\nimage = \"{TEST_IMAGE}\"\ncommand = [\"/bin/sh\", \"/agents/reviewer.sh\", {}]\nmemory = \"128m\"\ncpus = 0.5\ntimeout_seconds = 60\n",
                quote(implementer_args),
                quote(reviewer_args)
            ),
        )
        .unwrap();
        Fixture {
            dir,
            bare,
            skills,
            agents,
        }
    }

    /// Adds the profile `final`, a final reviewer running `final.sh MODE`.
    pub fn with_final_reviewer(self, mode: &str) -> Fixture {
        let mut agents = std::fs::read_to_string(&self.agents).unwrap();
        agents.push_str(&format!(
            "\n[agents.final]\nimage = \"{TEST_IMAGE}\"\ncommand = [\"/bin/sh\", \"/agents/final.sh\", \"{mode}\"]\nmemory = \"128m\"\ntimeout_seconds = 60\n"
        ));
        std::fs::write(&self.agents, agents).unwrap();
        self
    }

    /// Runs `forgepool run` with a request for ticket `TEST-1` plus `extra` TOML lines.
    pub fn run(&self, extra: &str) -> Outcome {
        self.run_request(&format!(
            "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n{extra}\n[repository]\nurl = \"file://{}\"\nref = \"main\"\n",
            self.bare.display()
        ))
    }

    /// The forgepool binary with this fixture's store, workspaces and test secret, and none of
    /// the compatibility variables of the environment the tests run in.
    pub fn command(&self) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_forgepool"));
        command
            .env("FORGEPOOL_DATABASE_URL", self.dir.path().join("runs.db"))
            .env(
                "FORGEPOOL_WORKSPACE_DIR",
                self.dir.path().join("workspaces"),
            )
            .env("AGENT_SECRET", "sk-test-0123456789abcdef")
            .env_remove("AUTO_REVIEW_MAX_RETRIES")
            .env_remove("FORGE_REPAIR_ATTEMPTS");
        if self.providers_file().exists() {
            command.env("FORGEPOOL_PROVIDERS_FILE", self.providers_file());
        }
        command
    }

    /// The fixture's providers file (SPEC 16): `forgepool run` is given it when it exists.
    pub fn providers_file(&self) -> PathBuf {
        self.dir.path().join("providers.toml")
    }

    /// Like [`Fixture::run`], with `env` added to forgepool's environment.
    pub fn run_with(&self, extra: &str, env: &[(&str, &str)]) -> Outcome {
        let file = self.dir.path().join("request.toml");
        std::fs::write(
            &file,
            format!(
                "ticket = \"TEST-1\"\nskill = \"implement-task\"\nbrief = \"Add the feature\"\n{extra}\n[repository]\nurl = \"file://{}\"\nref = \"main\"\n",
                self.bare.display()
            ),
        )
        .unwrap();
        let mut command = self.command();
        command
            .arg("run")
            .arg(&file)
            .arg("--skills")
            .arg(&self.skills)
            .arg("--agents")
            .arg(&self.agents)
            .envs(env.iter().copied());
        self.outcome(command)
    }

    /// Runs `forgepool run` on a request text.
    pub fn run_request(&self, request: &str) -> Outcome {
        let file = self.dir.path().join("request.toml");
        std::fs::write(&file, request).unwrap();
        let mut command = self.command();
        command
            .arg("run")
            .arg(&file)
            .arg("--skills")
            .arg(&self.skills)
            .arg("--agents")
            .arg(&self.agents);
        self.outcome(command)
    }

    /// Runs a forgepool command (from [`Fixture::command`]) and reads back the run it printed.
    pub fn outcome(&self, mut command: Command) -> Outcome {
        // Every stage has its own time limit; this bounds a run that ignores them.
        let output = output_within(&mut command, Duration::from_secs(240));
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        self.read_back(output.status.code().unwrap_or(-1), stdout, stderr)
    }

    /// What a user sees of a forgepool command that exited with `code` after printing
    /// `stdout` and `stderr`: the run it printed, read back from the fixture's store.
    pub fn read_back(&self, code: i32, stdout: String, stderr: String) -> Outcome {
        let database = self.dir.path().join("runs.db");
        let run_id = stdout
            .lines()
            .find_map(|l| {
                l.strip_prefix("Run ")
                    .and_then(|rest| rest.split_whitespace().next())
            })
            .and_then(|id| Uuid::parse_str(id).ok());
        let (record, events) = match run_id {
            Some(run_id) => read_store(&database, run_id),
            None => (None, Vec::new()),
        };
        Outcome {
            code,
            stdout,
            stderr,
            run_id,
            record,
            events,
        }
    }

    /// The files on a branch of the repository, or `None` when the branch does not exist.
    /// How many times `branch` was pushed (created, moved or rewritten), as the repository's
    /// `post-receive` hook logged it.
    pub fn pushes(&self, branch: &str) -> usize {
        let reference = format!("refs/heads/{branch} ");
        std::fs::read_to_string(self.dir.path().join("pushes.log"))
            .unwrap_or_default()
            .lines()
            .filter(|line| line.starts_with(&reference))
            .count()
    }

    pub fn branch_files(&self, branch: &str) -> Option<Vec<String>> {
        let output = Command::new("git")
            .args([
                "--git-dir",
                self.bare.to_str().unwrap(),
                "ls-tree",
                "-r",
                "--name-only",
                branch,
            ])
            .output()
            .unwrap();
        output.status.success().then(|| {
            String::from_utf8_lossy(&output.stdout)
                .lines()
                .map(String::from)
                .collect()
        })
    }

    /// A file's text on a branch.
    pub fn branch_file(&self, branch: &str, path: &str) -> String {
        git(&self.bare, &["show", &format!("{branch}:{path}")])
    }
}

impl Outcome {
    /// The stored run; panics with the output when there is none.
    pub fn record(&self) -> &RunRecord {
        self.record.as_ref().unwrap_or_else(|| {
            panic!(
                "no stored run\nstdout:\n{}\nstderr:\n{}",
                self.stdout, self.stderr
            )
        })
    }

    /// Everything printed, for assertion messages.
    pub fn printed(&self) -> String {
        format!(
            "exit {}\nstdout:\n{}\nstderr:\n{}",
            self.code, self.stdout, self.stderr
        )
    }

    /// Asserts that no container of this run is left on the engine.
    pub fn assert_no_containers_left(&self) {
        let run_id = self.run_id.expect("a run id");
        let output = output_within(
            Command::new("docker").args([
                "ps",
                "-aq",
                "--filter",
                &format!("label=forgepool.run_id={run_id}"),
            ]),
            COMMAND_LIMIT,
        );
        let left = String::from_utf8_lossy(&output.stdout).trim().to_string();
        assert!(
            left.is_empty(),
            "containers of run {run_id} were left: {left}"
        );
    }
}

fn read_store(database: &Path, run_id: Uuid) -> (Option<RunRecord>, Vec<Event>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = SqliteStore::open(database.to_str().unwrap()).unwrap();
        let record = store.get_run(run_id).await.unwrap();
        let events = store
            .events(run_id, 0)
            .await
            .unwrap()
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        (record, events)
    })
}

/// Runs git and returns stdout; panics with stderr on failure.
pub fn git(dir: &Path, args: &[&str]) -> String {
    let output = Command::new("git")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "git {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).to_string()
}

/// Prometheus's `promtool`, from Debian's `prometheus` package (`scripts/services.sh`
/// installs it). Fails (never skips) without it.
pub fn promtool() -> &'static str {
    const PROMTOOL: &str = "/usr/bin/promtool";
    if !std::path::Path::new(PROMTOOL).is_file() {
        panic!("promtool is not installed: run `scripts/services.sh` (it installs Debian's `prometheus` package)");
    }
    PROMTOOL
}

/// The host's address on Docker's default bridge, as a container on it sees it (its default
/// route): where a stage reaches a service the test runs on the host.
pub fn bridge_gateway() -> String {
    // The default bridge's gateway, as a container on it sees it: the host's address there.
    let output = output_within(
        Command::new("docker").args([
            "run",
            "--rm",
            "--network",
            "bridge",
            TEST_IMAGE,
            "ip",
            "route",
        ]),
        COMMAND_LIMIT,
    );
    let routes = String::from_utf8_lossy(&output.stdout).to_string();
    routes
        .lines()
        .find_map(|l| l.strip_prefix("default via "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no default route on the bridge network: {routes}"))
        .to_string()
}
