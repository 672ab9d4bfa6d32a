//! A distributed cluster for end-to-end tests: one dispatcher and several workers as real
//! processes, on a real RabbitMQ under a prefix of their own, against the real Docker engine.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};

use super::Fixture;

/// The broker the tests use.
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The job key every test service shares (`FORGEPOOL_JOB_KEY`).
pub const JOB_KEY: &str = "forgepool-test-job-key-0123456789";

/// The states a run view went through, in order.
pub fn state_names(view: &serde_json::Value) -> Vec<&str> {
    view["states"]
        .as_array()
        .map(|states| states.iter().filter_map(|s| s["state"].as_str()).collect())
        .unwrap_or_default()
}

/// Fails (never skips) when RabbitMQ is not reachable.
pub fn require_rabbitmq() {
    if std::net::TcpStream::connect_timeout(
        &"127.0.0.1:5672".parse().unwrap(),
        Duration::from_secs(2),
    )
    .is_err()
    {
        panic!("RabbitMQ is not reachable on 127.0.0.1:5672: start it with `scripts/services.sh` and run the tests again");
    }
}

/// How long one request to the dispatcher's API may take, its body included.
pub const HTTP_LIMIT: Duration = Duration::from_secs(120);

/// How long one exchange with the broker by the harness may take.
const BROKER_LIMIT: Duration = Duration::from_secs(30);

/// Awaits `work` for at most [`BROKER_LIMIT`]; past it, panics saying what the broker did not do.
async fn on_broker<T>(what: &str, work: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(BROKER_LIMIT, work)
        .await
        .unwrap_or_else(|_| {
            panic!("RabbitMQ did not {what} within {BROKER_LIMIT:?} (`rabbitmq-diagnostics status` shows its state)")
        })
}

/// A running process with its captured output.
pub struct Service {
    pub child: Child,
    pub address: String,
    pub log: PathBuf,
}

impl Service {
    /// Sends SIGTERM and waits up to `limit` for the process to exit.
    pub fn terminate(&mut self, limit: Duration) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let started = Instant::now();
        while started.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        None
    }

    /// Kills the process with SIGKILL.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            std::thread::sleep(Duration::from_millis(300));
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// What a test may change about a cluster.
#[derive(Default)]
pub struct Options {
    /// The dispatcher's store (a path or URL); a SQLite file in the fixture by default.
    pub database: Option<String>,
    /// Environment added to every service process (after the defaults, so it wins; an empty
    /// value removes the variable).
    pub env: Vec<(String, String)>,
}

/// A dispatcher and workers sharing a fixture.
pub struct Cluster {
    pub fixture: Fixture,
    pub prefix: String,
    pub token: Option<String>,
    /// The dispatcher's `--database`: a SQLite file in the fixture unless a test chose one.
    pub database: String,
    /// Environment added to every service process.
    pub env: Vec<(String, String)>,
    pub dispatcher: Option<Service>,
    pub workers: Vec<Service>,
    pub http: reqwest::Client,
}

impl Cluster {
    /// Starts a dispatcher and `workers` workers (each with `slots` run slots).
    pub async fn start(
        fixture: Fixture,
        workers: usize,
        slots: u16,
        token: Option<&str>,
    ) -> Cluster {
        Cluster::start_with(fixture, workers, slots, token, Options::default()).await
    }

    /// Like [`Cluster::start`], with other options.
    pub async fn start_with(
        fixture: Fixture,
        workers: usize,
        slots: u16,
        token: Option<&str>,
        options: Options,
    ) -> Cluster {
        require_rabbitmq();
        let database = options
            .database
            .unwrap_or_else(|| fixture.dir.path().join("runs.db").display().to_string());
        let prefix = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        let mut cluster = Cluster {
            fixture,
            prefix,
            token: token.map(String::from),
            database,
            env: options.env,
            dispatcher: None,
            workers: Vec::new(),
            // No request may hang a test: a dispatcher that stops answering fails it.
            http: reqwest::Client::builder()
                .timeout(HTTP_LIMIT)
                .build()
                .unwrap(),
        };
        cluster.start_dispatcher();
        for i in 0..workers {
            cluster.start_worker(&format!("w{i}"), slots);
        }
        cluster
    }

    fn base_command(&self, args: &[&str], log_name: &str) -> (Command, PathBuf) {
        let log = self.fixture.dir.path().join(log_name);
        let mut command = Command::new(env!("CARGO_BIN_EXE_forgepool"));
        command
            .args(args)
            .env("FORGEPOOL_AMQP_URL", AMQP_URL)
            .env("FORGEPOOL_AMQP_PREFIX", &self.prefix)
            .env("FORGEPOOL_LOG", "info,lapin=off")
            .env("AGENT_SECRET", "sk-test-0123456789abcdef")
            .env("FORGEPOOL_JOB_KEY", JOB_KEY)
            // The tests' repositories are local folders, which a pool refuses by default.
            .env("FORGEPOOL_ALLOWED_URL_SCHEMES", "https,ssh,file")
            .env_remove("AUTO_REVIEW_MAX_RETRIES")
            .env_remove("FORGE_REPAIR_ATTEMPTS")
            .envs(
                self.env
                    .iter()
                    .filter(|(_, v)| !v.is_empty())
                    .map(|(k, v)| (k, v)),
            )
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        for (name, _) in self.env.iter().filter(|(_, v)| v.is_empty()) {
            command.env_remove(name);
        }
        (command, log)
    }

    /// Starts (or restarts) the dispatcher on a free port, with the fixture's store.
    pub fn start_dispatcher(&mut self) {
        self.dispatcher = Some(self.spawn_dispatcher("dispatcher.log"));
    }

    /// Starts another dispatcher on a free port with the same store and settings (a replica),
    /// logging to `log_name` in the fixture.
    pub fn spawn_dispatcher(&self, log_name: &str) -> Service {
        let (mut command, log) = self.base_command(&["dispatcher"], log_name);
        command
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--skills")
            .arg(&self.fixture.skills)
            .arg("--agents")
            .arg(&self.fixture.agents)
            .arg("--database")
            .arg(&self.database);
        if let Some(token) = &self.token {
            command.env("FORGEPOOL_API_TOKEN", token);
        }
        spawn(command, log, "dispatcher listening on ")
    }

    /// Starts a worker called `name`.
    pub fn start_worker(&mut self, name: &str, slots: u16) -> usize {
        self.start_worker_with(name, slots, &[])
    }

    /// Starts a worker called `name` with extra environment.
    pub fn start_worker_with(&mut self, name: &str, slots: u16, env: &[(&str, &str)]) -> usize {
        let workspace = self.fixture.dir.path().join(format!("ws-{name}"));
        let (mut command, log) = self.base_command(&["worker"], &format!("worker-{name}.log"));
        command
            .arg("--metrics-addr")
            .arg("127.0.0.1:0")
            .arg("--worker-id")
            .arg(format!("{}-{name}", self.prefix))
            .arg("--concurrency")
            .arg(slots.to_string())
            .arg("--workspace")
            .arg(&workspace)
            .arg("--drain-seconds")
            .arg("5")
            .arg("--agents")
            .arg(&self.fixture.agents)
            .envs(env.iter().copied());
        self.workers.push(spawn(command, log, "listening on "));
        self.workers.len() - 1
    }

    /// Starts a worker called `name` on host `host` of `scripts/hosts.sh`: in its namespaces,
    /// with its own Docker engine and `/tmp` (so its own workspace and cache), reaching the
    /// broker at `amqp_url` over the hosts' bridge.
    pub fn start_worker_on_host(&mut self, name: &str, slots: u16, host: u8, amqp_url: &str) {
        let (command, log) = self.base_command(&["worker"], &format!("worker-{name}.log"));
        let mut on_host =
            Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/hosts.sh"));
        on_host
            .arg("exec")
            .arg(host.to_string())
            .arg(command.get_program())
            .args(command.get_args())
            .args(["--metrics-addr", "127.0.0.1:0", "--worker-id"])
            .arg(format!("{}-{name}", self.prefix))
            .args(["--concurrency", &slots.to_string(), "--drain-seconds", "5"])
            .arg("--agents")
            .arg(&self.fixture.agents)
            .envs(command.get_envs().filter_map(|(k, v)| Some((k, v?))))
            .env("FORGEPOOL_AMQP_URL", amqp_url)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap());
        for (name, _) in command.get_envs().filter(|(_, v)| v.is_none()) {
            on_host.env_remove(name);
        }
        self.workers.push(spawn(on_host, log, "listening on "));
    }

    /// The dispatcher's base URL.
    pub fn url(&self) -> String {
        format!(
            "http://{}",
            self.dispatcher
                .as_ref()
                .expect("dispatcher running")
                .address
        )
    }

    /// A request to the API with the cluster's token.
    pub fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.url()));
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    /// A valid run request for `ticket`, plus extra JSON fields.
    pub fn request_body(&self, ticket: &str, extra: serde_json::Value) -> serde_json::Value {
        let mut body = serde_json::json!({
            "ticket": ticket, "skill": "implement-task", "brief": "Add the feature",
            "repository": {"url": format!("file://{}", self.fixture.bare.display()), "ref": "main"}
        });
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            for (key, value) in extra {
                body.insert(key.clone(), value.clone());
            }
        }
        body
    }

    /// Submits through the API and returns the run id.
    pub async fn submit(&self, ticket: &str) -> String {
        self.submit_with(ticket, serde_json::json!({})).await
    }

    /// Waits until a run of `ticket` is stored (one a producer submitted through the broker)
    /// and returns its id.
    pub async fn run_of_ticket(&self, ticket: &str) -> String {
        let started = Instant::now();
        loop {
            let runs = self.runs_of_ticket(ticket).await;
            if let Some(id) = runs.first().and_then(|run| run["run_id"].as_str()) {
                return id.to_string();
            }
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "the submission of {ticket} was not accepted\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Submits a request with extra fields through the API and returns the run id.
    pub async fn submit_with(&self, ticket: &str, extra: serde_json::Value) -> String {
        let response = self
            .request(reqwest::Method::POST, "/v1/runs")
            .json(&self.request_body(ticket, extra))
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            201,
            "{}",
            response.text().await.unwrap_or_default()
        );
        let body: serde_json::Value = response.json().await.unwrap();
        body["run_id"].as_str().unwrap().to_string()
    }

    /// The run as the API shows it.
    pub async fn run(&self, run_id: &str) -> serde_json::Value {
        self.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Waits until every run is in a terminal state; panics with the logs after `limit`.
    pub async fn wait_terminal(
        &self,
        run_ids: &[String],
        limit: Duration,
    ) -> Vec<serde_json::Value> {
        let started = Instant::now();
        loop {
            let mut views = Vec::new();
            for id in run_ids {
                views.push(self.run(id).await);
            }
            let done = views.iter().all(|v| {
                matches!(
                    v["state"].as_str(),
                    Some(
                        "delivered"
                            | "delivered_with_warnings"
                            | "blocked"
                            | "failed"
                            | "cancelled"
                    )
                )
            });
            if done {
                return views;
            }
            if started.elapsed() > limit {
                let states: Vec<_> = views.iter().map(|v| v["state"].clone()).collect();
                let (kept, threads) = self.keep_evidence(&views);
                // The summary comes last: CI shows the end of a failure's output.
                panic!(
                    "runs did not end within {limit:?}: {states:?}\n{}\nfull logs, the runs and the services' thread backtraces are in {}\n{threads}\nruns did not end within {limit:?}: {states:?}",
                    self.logs(),
                    kept.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// Waits for one run to end; returns its view and the reason of its last state.
    pub async fn wait_one(&self, run_id: &str, limit: Duration) -> (serde_json::Value, String) {
        let view = self
            .wait_terminal(&[run_id.to_string()], limit)
            .await
            .remove(0);
        let reason = view["states"]
            .as_array()
            .and_then(|states| states.last())
            .and_then(|state| state["reason"].as_str())
            .unwrap_or_default()
            .to_string();
        (view, reason)
    }

    /// A run's events as the Server-Sent Events stream sends them.
    pub async fn event_stream(&self, run_id: &str) -> String {
        self.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The stored runs of `ticket`, newest first.
    pub async fn runs_of_ticket(&self, ticket: &str) -> Vec<serde_json::Value> {
        let list: serde_json::Value = self
            .request(reqwest::Method::GET, &format!("/v1/runs?ticket={ticket}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["runs"].as_array().cloned().unwrap_or_default()
    }

    /// Asks the API to cancel a run: the status and the answer.
    pub async fn cancel(&self, run_id: &str) -> (reqwest::StatusCode, serde_json::Value) {
        let response = self
            .request(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel"))
            .send()
            .await
            .unwrap();
        let status = response.status();
        (status, response.json().await.unwrap_or_default())
    }

    /// Waits up to 30 s until the run is `running` and one of its containers exists.
    pub async fn wait_running(&self, run_id: &str) {
        let started = Instant::now();
        while self.run(run_id).await["state"] != "running" || container_count(run_id) == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "run {run_id} never started a stage\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What a run's event stream sends within `limit` (a live run's stream does not end).
    pub async fn event_stream_until(&self, run_id: &str, limit: Duration) -> String {
        let deadline = tokio::time::Instant::now() + limit;
        let request = self.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events"));
        let Ok(Ok(mut response)) = tokio::time::timeout_at(deadline, request.send()).await else {
            return String::new();
        };
        let mut text = Vec::new();
        while let Ok(Ok(Some(chunk))) = tokio::time::timeout_at(deadline, response.chunk()).await {
            text.extend_from_slice(&chunk);
        }
        String::from_utf8_lossy(&text).to_string()
    }

    /// Keeps what explains a stuck run, outside the fixture (which is deleted): every service
    /// log in full, the run views, and each live service's thread backtraces (with gdb).
    /// Returns the folder, `target/tmp/evidence/{prefix}`, and a short summary of the threads:
    /// the frames of forgepool, lapin, bollard and tokio's blocking calls in each service.
    pub fn keep_evidence(&self, views: &[serde_json::Value]) -> (PathBuf, String) {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join("evidence")
            .join(&self.prefix);
        let _ = std::fs::create_dir_all(&dir);
        if let Ok(entries) = std::fs::read_dir(self.fixture.dir.path()) {
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().ends_with(".log") {
                    let _ = std::fs::copy(entry.path(), dir.join(entry.file_name()));
                }
            }
        }
        let _ = std::fs::write(
            dir.join("runs.json"),
            serde_json::to_string_pretty(views).unwrap_or_default(),
        );
        let mut summary = String::new();
        let services = self.dispatcher.iter().chain(self.workers.iter());
        for (n, service) in services.enumerate() {
            let pid = service.child.id().to_string();
            // Bounded: this is the failure path, which must end.
            let Ok(output) = Command::new("timeout")
                .args([
                    "60",
                    "gdb",
                    "-p",
                    &pid,
                    "-batch",
                    "-ex",
                    "thread apply all bt",
                ])
                .output()
            else {
                summary.push_str("gdb is not installed: no thread backtraces\n");
                break;
            };
            let text = String::from_utf8_lossy(&output.stdout).to_string();
            let _ = std::fs::write(dir.join(format!("backtrace-{n}-{pid}.txt")), &text);
            summary.push_str(&format!(
                "--- threads of {} (pid {pid})\n",
                service.log.display()
            ));
            for (line, count) in thread_lines(&text) {
                summary.push_str(&format!("{count} × {line}\n"));
            }
        }
        (dir, summary)
    }

    /// Every service log, for failure messages.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for entry in std::fs::read_dir(self.fixture.dir.path())
            .unwrap()
            .flatten()
        {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.ends_with(".log") {
                let content = std::fs::read_to_string(entry.path()).unwrap_or_default();
                let tail: String = content
                    .lines()
                    .rev()
                    .take(40)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                text.push_str(&format!("--- {name}\n{tail}\n"));
            }
        }
        text
    }

    /// A broker connection for publishing and inspecting queues directly.
    pub async fn broker(&self) -> Connection {
        connect_broker().await
    }

    /// Publishes raw bytes to a queue of this cluster (`jobs`, `submissions`…).
    pub async fn publish_raw(&self, queue: &str, payload: &[u8], reply_to: Option<&str>) {
        self.publish_with(queue, payload, reply_to, None).await;
    }

    /// Publishes a job signed with `key` (the cluster's own key unless another is given), as
    /// only the dispatcher should.
    pub async fn publish_signed(&self, payload: &[u8], key: Option<&str>) {
        let key = proto::JobKey::new(key.unwrap_or(JOB_KEY)).unwrap();
        self.publish_with("jobs", payload, None, Some(key.sign(payload)))
            .await;
    }

    /// Publishes a copy of a signed job: its body and its signature, as taken from the queue.
    pub async fn publish_copy(&self, payload: &[u8], signature: &str) {
        self.publish_with("jobs", payload, None, Some(signature.to_string()))
            .await;
    }

    /// Publishes a copy of a signed job that says its execution was lost `lost` times before
    /// (the count a worker's copy carries, `x-forgepool-lost`).
    pub async fn publish_lost_copy(&self, payload: &[u8], signature: &str, lost: u32) {
        let queue = format!("{}.jobs", self.prefix);
        let headers = [
            (proto::SIGNATURE_HEADER, signature.to_string()),
            ("x-forgepool-lost", lost.to_string()),
        ];
        self.publish_to("", &queue, payload, None, &headers, None)
            .await;
    }

    /// Takes the first job off the jobs queue, as an attacker with a broker login would copy
    /// it: its body and its signature header. Waits up to 10 s for one.
    pub async fn take_job(&self) -> (Vec<u8>, String) {
        let connection = self.broker().await;
        let take = async {
            let channel = connection.create_channel().await.unwrap();
            for _ in 0..100 {
                let queue = format!("{}.jobs", self.prefix);
                let got = channel
                    .basic_get(queue.into(), BasicGetOptions { no_ack: true })
                    .await
                    .unwrap();
                if let Some(message) = got {
                    let signature = message
                        .delivery
                        .properties
                        .headers()
                        .as_ref()
                        .and_then(|h| h.inner().get(proto::SIGNATURE_HEADER).cloned())
                        .and_then(|v| match v {
                            lapin::types::AMQPValue::LongString(s) => Some(s.to_string()),
                            _ => None,
                        })
                        .expect("a job the dispatcher published is signed");
                    return (message.delivery.data.clone(), signature);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("no job reached the jobs queue within 10 s");
        };
        let taken = on_broker("take a job", take).await;
        let _ = on_broker("close a connection", connection.close(200, "bye".into())).await;
        taken
    }

    /// Deletes a queue of this cluster (`done.{run}`, …).
    pub async fn delete_queue(&self, queue: &str) {
        let connection = self.broker().await;
        let delete = async {
            let channel = connection.create_channel().await.unwrap();
            channel
                .queue_delete(
                    format!("{}.{queue}", self.prefix).into(),
                    QueueDeleteOptions::default(),
                )
                .await
                .unwrap()
        };
        on_broker("delete a queue", delete).await;
        let _ = on_broker("close a connection", connection.close(200, "bye".into())).await;
    }

    /// Publishes to the exchange `{prefix}.{exchange}` (not to a queue by name).
    pub async fn publish_to_exchange(&self, exchange: &str, payload: &[u8]) {
        let exchange = format!("{}.{exchange}", self.prefix);
        self.publish_to(&exchange, "", payload, None, &[], None)
            .await;
    }

    /// Publishes a run request to the submit exchange with a `message_id`.
    pub async fn submit_message(&self, payload: &[u8], message_id: &str) {
        let exchange = format!("{}.submit", self.prefix);
        self.publish_to(&exchange, "", payload, None, &[], Some(message_id))
            .await;
    }

    async fn publish_with(
        &self,
        queue: &str,
        payload: &[u8],
        reply_to: Option<&str>,
        signature: Option<String>,
    ) {
        let queue = format!("{}.{queue}", self.prefix);
        let headers: Vec<(&str, String)> = signature
            .map(|signature| (proto::SIGNATURE_HEADER, signature))
            .into_iter()
            .collect();
        self.publish_to("", &queue, payload, reply_to, &headers, None)
            .await;
    }

    /// Publishes with confirms, so the broker has the message before the connection closes.
    async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        payload: &[u8],
        reply_to: Option<&str>,
        headers: &[(&str, String)],
        message_id: Option<&str>,
    ) {
        let connection = self.broker().await;
        let publish = async {
            let channel = connection.create_channel().await.unwrap();
            // Confirms make sure the broker has the message before the connection closes.
            channel
                .confirm_select(lapin::options::ConfirmSelectOptions::default())
                .await
                .unwrap();
            let mut properties = BasicProperties::default().with_delivery_mode(2);
            if let Some(reply_to) = reply_to {
                properties = properties.with_reply_to(reply_to.into());
            }
            if let Some(message_id) = message_id {
                properties = properties.with_message_id(message_id.into());
            }
            if !headers.is_empty() {
                let mut table = lapin::types::FieldTable::default();
                for (name, value) in headers {
                    table.insert(
                        (*name).into(),
                        lapin::types::AMQPValue::LongString(value.as_str().into()),
                    );
                }
                properties = properties.with_headers(table);
            }
            channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    payload,
                    properties,
                )
                .await
                .unwrap()
                .await
                .unwrap();
        };
        on_broker("confirm a publish", publish).await;
        let _ = on_broker("close a connection", connection.close(200, "bye".into())).await;
    }

    /// Takes every message from the dead-letter queue: (payload, reason header).
    pub async fn dead_letters(&self) -> Vec<(Vec<u8>, String)> {
        let connection = self.broker().await;
        let take = async {
            let channel = connection.create_channel().await.unwrap();
            let mut found = Vec::new();
            while let Some(message) = channel
                .basic_get(
                    format!("{}.dead", self.prefix).into(),
                    BasicGetOptions { no_ack: true },
                )
                .await
                .unwrap()
            {
                let reason = message
                    .delivery
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get("x-forgepool-reason").cloned())
                    .and_then(|v| {
                        if let lapin::types::AMQPValue::LongString(s) = v {
                            Some(s.to_string())
                        } else {
                            None
                        }
                    })
                    .unwrap_or_default();
                found.push((message.delivery.data.clone(), reason));
            }
            found
        };
        let found = on_broker("hand over the dead letters", take).await;
        let _ = on_broker("close a connection", connection.close(200, "bye".into())).await;
        found
    }

    /// How many times `branch` was pushed, as the repository's `post-receive` hook logged it.
    pub fn pushes(&self, branch: &str) -> usize {
        self.fixture.pushes(branch)
    }

    /// Stops the services, then deletes this cluster's queues from the broker; the end of a
    /// test that passed. The services go first: a consumer whose queue is deleted declares
    /// the topology again, and a quorum queue declared while it is being deleted can leave
    /// RabbitMQ 3.10 unable to declare any quorum queue again.
    pub async fn delete_queues(mut self) {
        self.stop_services(Duration::from_secs(15));
        delete_prefix_queues(&self.prefix).await;
    }

    /// Sends SIGTERM to the dispatcher and every worker, and waits up to `limit` for all of
    /// them to exit (those still running are killed).
    pub fn stop_services(&mut self, limit: Duration) {
        // Only services still running: a reaped process's id may belong to another by now.
        let services: Vec<&mut Service> = self
            .dispatcher
            .iter_mut()
            .chain(self.workers.iter_mut())
            .filter_map(|service| matches!(service.child.try_wait(), Ok(None)).then_some(service))
            .collect();
        for service in &services {
            let _ = Command::new("kill")
                .args(["-TERM", &service.child.id().to_string()])
                .status();
        }
        let deadline = Instant::now() + limit;
        for service in services {
            while Instant::now() < deadline && matches!(service.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            service.kill();
        }
    }
}

/// A connection to the test broker, within [`BROKER_LIMIT`].
pub async fn connect_broker() -> Connection {
    let properties = ConnectionProperties::default();
    on_broker(
        "accept a connection",
        Connection::connect(AMQP_URL, properties),
    )
    .await
    .unwrap()
}

/// Deletes the shared queues of the services under `prefix`, which must be stopped: a running
/// consumer would declare them again.
pub async fn delete_prefix_queues(prefix: &str) {
    let connection = connect_broker().await;
    for queue in [
        "submissions",
        "jobs",
        "jobs.waiting",
        "dead",
        "dispatcher.dead",
        "dispatcher.events",
        "execution-questions",
        "allotments",
    ] {
        let delete = async {
            let channel = connection.create_channel().await?;
            channel
                .queue_delete(
                    format!("{prefix}.{queue}").into(),
                    QueueDeleteOptions::default(),
                )
                .await
        };
        on_broker("delete a queue", delete)
            .await
            .unwrap_or_else(|e| panic!("the queue {prefix}.{queue} cannot be deleted: {e}"));
    }
    let _ = on_broker("close a connection", connection.close(200, "bye".into())).await;
}

/// How long a service may take to print its ready line. The dispatcher prints it once the
/// broker topology is declared; it retries a broker that does not answer for longer than this.
const READY_LIMIT: Duration = Duration::from_secs(90);

/// Starts `command` (its stdout piped) and waits, boundedly, for the line containing `ready`;
/// what follows it on that line is the service's address.
pub fn spawn(mut command: Command, log: PathBuf, ready: &str) -> Service {
    let mut child = command.spawn().expect("the forgepool binary starts");
    let stdout = child.stdout.take().unwrap();
    // Read stdout on a thread of its own, which keeps draining it afterwards so the service
    // never blocks on a full pipe; the ready line comes back over a channel, boundedly.
    let (found, address) = std::sync::mpsc::channel();
    let ready = ready.to_string();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let mut found = Some(found);
        while reader.read_line(&mut line).unwrap_or(0) > 0 {
            if let Some(at) = line.find(&ready) {
                if let Some(found) = found.take() {
                    let _ = found.send(line[at + ready.len()..].trim().to_string());
                }
            }
            line.clear();
        }
    });
    match address.recv_timeout(READY_LIMIT) {
        Ok(address) => Service {
            child,
            address,
            log,
        },
        Err(error) => {
            let exited = child.try_wait().ok().flatten();
            let _ = child.kill();
            let _ = child.wait();
            let logged = std::fs::read_to_string(&log).unwrap_or_default();
            let what = match (error, exited) {
                (_, Some(status)) => format!("the service exited ({status}) before it was ready"),
                (RecvTimeoutError::Disconnected, None) => {
                    "the service closed its output before it was ready".to_string()
                }
                (RecvTimeoutError::Timeout, None) => format!(
                    "the service was not ready within {READY_LIMIT:?} (is RabbitMQ answering? `rabbitmq-diagnostics status`)"
                ),
            };
            panic!("{what}:\n{logged}");
        }
    }
}

/// One line per kind of thread in a gdb `thread apply all bt`: its name, the function it is
/// in, and the innermost forgepool frame, with how many threads share that line.
fn thread_lines(backtraces: &str) -> Vec<(String, usize)> {
    let function = |frame: &str| -> String {
        let frame = frame.split(" at ").next().unwrap_or(frame);
        let name = frame.split(" in ").nth(1).unwrap_or(frame);
        let name = name.split(" (").next().unwrap_or(name);
        name.trim_start_matches(|c: char| c == '#' || c.is_ascii_digit() || c == ' ')
            .chars()
            .take(100)
            .collect()
    };
    let mut lines: Vec<(String, usize)> = Vec::new();
    for thread in backtraces.split("\nThread ").skip(1) {
        let name = thread.split('"').nth(1).unwrap_or("?");
        let frames: Vec<&str> = thread.lines().filter(|l| l.starts_with('#')).collect();
        let innermost = frames
            .iter()
            .map(|f| function(f))
            .find(|f| {
                [
                    "lapin::",
                    "tokio::",
                    "parking_lot",
                    "flume::",
                    "bollard::",
                    "hyper",
                ]
                .iter()
                .any(|crate_name| f.starts_with(crate_name))
            })
            .unwrap_or_default();
        let ours = frames
            .iter()
            .find(|f| f.contains("forgepool"))
            .map(|f| function(f))
            .unwrap_or_default();
        let line = format!("{name}: {innermost} | {ours}");
        match lines.iter_mut().find(|(known, _)| *known == line) {
            Some((_, count)) => *count += 1,
            None => lines.push((line, 1)),
        }
    }
    lines
}

/// The messages (ready and unacknowledged) in the cluster's jobs and wait queues, as
/// `rabbitmqctl` counts them: zero once every job was settled.
pub fn jobs_on_broker(prefix: &str) -> usize {
    let output = super::output_within(
        Command::new("rabbitmqctl").args([
            "list_queues",
            "--quiet",
            "--no-table-headers",
            "name",
            "messages",
        ]),
        super::COMMAND_LIMIT,
    );
    assert!(
        output.status.success(),
        "rabbitmqctl list_queues failed; start RabbitMQ with scripts/services.sh"
    );
    let jobs = [format!("{prefix}.jobs"), format!("{prefix}.jobs.waiting")];
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .filter(|(name, _)| jobs.iter().any(|j| j == name.trim()))
        .map(|(_, count)| count.trim().parse::<usize>().unwrap_or(0))
        .sum()
}

/// The containers of a run on the engine.
pub fn container_count(run_id: &str) -> usize {
    let output = super::output_within(
        Command::new("docker").args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=forgepool.run_id={run_id}"),
        ]),
        super::COMMAND_LIMIT,
    );
    String::from_utf8_lossy(&output.stdout).lines().count()
}
