//! The dispatcher's clients: `submit`, `watch`, `status`, `cancel` and `resume`. They print the
//! same progress lines and use the same exit codes as `forgepool run`, or JSON with
//! `--output json`; every request has a time limit.

mod output;
mod watch;

use std::path::Path;

use proto::{PoolView, Problem, RunList, RunView, SubmitResponse};

use crate::config::{ClientArgs, OutputFormat};
use crate::progress;
use output::{json, Printer};

/// Exit code for invalid input or configuration (the dispatcher refused the request).
const EXIT_INVALID: i32 = 2;
/// Exit code when the dispatcher fails a request, or answers what the client cannot read.
const EXIT_FAILED: i32 = 1;
/// Exit code when the dispatcher cannot be reached at all (sysexits' `EX_UNAVAILABLE`): no
/// answer within the time limit, or no connection.
pub const EXIT_UNREACHABLE: i32 = 69;

/// Why a request did not give what was asked.
#[derive(Debug)]
enum Failure {
    /// No connection, or no answer in time.
    Unreachable(String),
    /// The dispatcher refused the request (4xx), with its problem details.
    Refused(String),
    /// The dispatcher failed (5xx), or its answer could not be read.
    Failed(String),
}

impl Failure {
    fn message(&self) -> String {
        match self {
            Failure::Unreachable(m) | Failure::Refused(m) | Failure::Failed(m) => m.clone(),
        }
    }

    /// Prints the failure; returns its exit code.
    fn report(self) -> i32 {
        eprintln!("error: {}", self.message());
        match self {
            Failure::Unreachable(_) => EXIT_UNREACHABLE,
            Failure::Refused(_) => EXIT_INVALID,
            Failure::Failed(_) => EXIT_FAILED,
        }
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    timeout: std::time::Duration,
}

impl Client {
    fn new(args: &ClientArgs) -> Client {
        // The overall limit is set per request: an event stream may stay open for hours, as
        // long as something arrives (a read limit).
        let http = reqwest::Client::builder()
            .connect_timeout(args.timeout.min(std::time::Duration::from_secs(10)))
            .read_timeout(args.timeout.max(std::time::Duration::from_secs(45)))
            .build()
            .unwrap_or_default();
        Client {
            http,
            base: args.dispatcher_url.trim_end_matches('/').to_string(),
            token: args.api_token.clone(),
            timeout: args.timeout,
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    /// Sends a request and returns a successful response (headers read within the time
    /// limit), or why not.
    async fn open(&self, builder: reqwest::RequestBuilder) -> Result<reqwest::Response, Failure> {
        let sent = tokio::time::timeout(self.timeout, builder.send()).await;
        let response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(error)) if !error.is_timeout() && !error.is_connect() => {
                return Err(Failure::Failed(format!(
                    "the request to the dispatcher at {} failed: {error}",
                    self.base
                )))
            }
            Ok(Err(error)) => return Err(self.unreachable(&error.to_string())),
            Err(_) => return Err(self.unreachable(&format!("no answer within {:?}", self.timeout))),
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let body = tokio::time::timeout(self.timeout, response.bytes())
            .await
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        let detail = match serde_json::from_slice::<Problem>(&body) {
            Ok(problem) => format!("{} ({})", problem.detail, problem.code),
            Err(_) => format!("the dispatcher answered {status}"),
        };
        Err(if status.is_client_error() {
            Failure::Refused(detail)
        } else {
            Failure::Failed(detail)
        })
    }

    fn unreachable(&self, why: &str) -> Failure {
        Failure::Unreachable(format!(
            "cannot reach the dispatcher at {}: {why}; start it, or set FORGEPOOL_DISPATCHER_URL (--dispatcher-url)",
            self.base
        ))
    }

    /// Sends a request and decodes its JSON answer, all within the time limit.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<T, Failure> {
        let response = self.open(builder).await?;
        let body = tokio::time::timeout(self.timeout, response.bytes())
            .await
            .map_err(|_| self.unreachable(&format!("no answer within {:?}", self.timeout)))?
            .map_err(|error| self.unreachable(&error.to_string()))?;
        serde_json::from_slice(&body).map_err(|error| {
            Failure::Failed(format!("unexpected answer from the dispatcher: {error}"))
        })
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, Failure> {
        self.call(self.request(reqwest::Method::GET, path)).await
    }
}

/// `forgepool submit FILE [--wait]`.
pub async fn submit(args: &ClientArgs, file: &Path, wait: bool) -> i32 {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(error) => {
            eprintln!(
                "error: cannot read the run request {}: {error}",
                file.display()
            );
            return EXIT_INVALID;
        }
    };
    // Parse locally so that TOML files work and field errors are named before any request.
    let request = match dispatcher::request::from_file_text(&text) {
        Ok(request) => request,
        Err(error) => {
            eprintln!("error: {}: {error}", file.display());
            return EXIT_INVALID;
        }
    };
    let client = Client::new(args);
    let posted = client
        .request(reqwest::Method::POST, "/v1/runs")
        .json(&request);
    let accepted: SubmitResponse = match client.call(posted).await {
        Ok(accepted) => accepted,
        Err(failure) => return failure.report(),
    };
    for warning in &accepted.warnings {
        eprintln!("warning: {}", progress::printable(warning));
    }
    let line = format!("Run {} accepted", accepted.run_id);
    answered(
        args,
        &client,
        &accepted.run_id.to_string(),
        &accepted,
        &line,
        wait,
    )
    .await
}

/// After `submit` or `resume`: prints the answer (its JSON, unless the run's events follow as
/// JSON lines; or `line`), then follows the run when asked to wait.
async fn answered<T: serde::Serialize>(
    args: &ClientArgs,
    client: &Client,
    run_id: &str,
    answer: &T,
    line: &str,
    wait: bool,
) -> i32 {
    let printer = Printer::new(args);
    match (args.output, wait) {
        (OutputFormat::Json, false) => json(answer),
        (OutputFormat::Json, true) => {}
        (OutputFormat::Text, _) => printer.line(line),
    }
    if wait {
        watch::watch_run(client, run_id, &printer).await
    } else {
        0
    }
}

/// `forgepool watch RUN_ID`.
pub async fn watch(args: &ClientArgs, run_id: &str) -> i32 {
    watch::watch_run(&Client::new(args), run_id, &Printer::new(args)).await
}

/// Which runs `forgepool status` lists.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    /// Only runs in this state.
    pub state: Option<String>,
    /// Only runs of this ticket.
    pub ticket: Option<String>,
    /// Only runs of this skill.
    pub skill: Option<String>,
    /// At most this many.
    pub limit: u32,
}

/// `forgepool status [RUN_ID] [--state S] [--ticket T] [--skill K] [--limit N]`.
pub async fn status(args: &ClientArgs, run_id: Option<&str>, filter: &ListFilter) -> i32 {
    let client = Client::new(args);
    match run_id {
        Some(run_id) => {
            match client
                .get_json::<RunView>(&format!("/v1/runs/{run_id}"))
                .await
            {
                Ok(view) if args.output == OutputFormat::Json => json(&view),
                Ok(view) => print_run(&view),
                Err(failure) => return failure.report(),
            }
            0
        }
        None => {
            let mut query = vec![format!("limit={}", filter.limit)];
            for (name, value) in [
                ("state", &filter.state),
                ("ticket", &filter.ticket),
                ("skill", &filter.skill),
            ] {
                if let Some(value) = value {
                    query.push(format!("{name}={}", encode(value)));
                }
            }
            let path = format!("/v1/runs?{}", query.join("&"));
            match client.get_json::<RunList>(&path).await {
                Ok(list) if args.output == OutputFormat::Json => json(&list),
                Ok(list) => {
                    print_list(&list);
                    // The pool's hosts follow; a dispatcher that cannot say leaves them out.
                    if let Ok(pool) = client.get_json::<PoolView>("/v1/pool").await {
                        print_hosts(&pool);
                    }
                }
                Err(failure) => return failure.report(),
            }
            0
        }
    }
}

/// A query value, percent-encoded.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn print_list(list: &RunList) {
    if list.runs.is_empty() {
        println!("No runs.");
        return;
    }
    println!(
        "{:<36}  {:<23}  {:<14}  {:<18}  {:>6}  {:>6}  UPDATED",
        "RUN", "STATE", "TICKET", "SKILL", "ROUNDS", "CYCLES"
    );
    for run in &list.runs {
        println!(
            "{:<36}  {:<23}  {:<14}  {:<18}  {:>6}  {:>6}  {}",
            run.run_id,
            run.state.as_str(),
            progress::printable(&run.ticket),
            progress::printable(&run.skill),
            run.rounds,
            run.cycles,
            run.updated_at
        );
    }
    if let Some(next) = &list.next_cursor {
        println!("(more runs: the API's cursor {next})");
    }
}

/// The live workers, a line each, by host: what `forgepool status` prints after the runs.
fn print_hosts(pool: &PoolView) {
    println!();
    if pool.hosts.is_empty() {
        println!("No live workers (none announced itself in the last 35 s).");
        return;
    }
    let workers: usize = pool.hosts.iter().map(|h| h.workers.len()).sum();
    println!(
        "{workers} live worker{} on {} host{}:",
        if workers == 1 { "" } else { "s" },
        pool.hosts.len(),
        if pool.hosts.len() == 1 { "" } else { "s" }
    );
    println!(
        "{:<24}  {:<28}  {:>5}  {:>5}  {:<10}  SEEN",
        "HOST", "WORKER", "SLOTS", "BUSY", "VERSION"
    );
    for host in &pool.hosts {
        for worker in &host.workers {
            println!(
                "{:<24}  {:<28}  {:>5}  {:>5}  {:<10}  {} s ago",
                progress::printable(&host.host),
                progress::printable(&worker.worker),
                worker.slots,
                worker.busy,
                progress::printable(&worker.version),
                worker.seen_seconds_ago
            );
        }
    }
}

fn print_run(view: &RunView) {
    println!(
        "Run {} ({}, skill {}): {}",
        view.run_id,
        progress::printable(&view.ticket),
        progress::printable(&view.skill),
        view.state
    );
    for change in &view.states {
        println!(
            "  {} {}: {}",
            change.time,
            change.state,
            progress::printable(&change.reason)
        );
    }
    println!(
        "  repair budget {}, implementation rounds {}",
        view.repair_budget, view.implementation_rounds
    );
    for round in &view.repair_history {
        let checks = if round.failing.is_empty() {
            "checks passed".to_string()
        } else {
            let failing: Vec<String> = round
                .failing
                .iter()
                .map(|(argv, code)| match code {
                    Some(code) => format!("`{}` exit {code}", argv.join(" ")),
                    None => format!("`{}` timed out", argv.join(" ")),
                })
                .collect();
            format!("failing: {}", failing.join(", "))
        };
        println!(
            "  round {} ({}): tree {}, {}",
            round.round,
            round.reason,
            &round.tree[..round.tree.len().min(12)],
            progress::printable(&checks)
        );
    }
    for cycle in &view.cycles {
        let kind = proto::EventKind::Cycle {
            cycle: cycle.clone(),
        };
        if let Some(line) = progress::line(&kind) {
            println!("  {line}");
        }
    }
    if let Some(profile) = &view.waiting_for_profile {
        println!(
            "  waiting for a slot of agent profile {}",
            progress::printable(profile)
        );
    }
    if let Some(usage) = &view.usage {
        println!("  usage: {}", progress::printable(&usage.summary()));
    }
    if let Some(budget) = &view.budget {
        println!("  budget: {budget}");
    }
    if let Some(result) = &view.result {
        if let (Some(branch), Some(commit)) = (&result.branch, &result.commit) {
            println!("  delivered {} at {commit}", progress::printable(branch));
        }
        if let Some(pull) = &result.pull_request {
            println!("  pull request {}", progress::printable(pull));
        }
    }
}

/// `forgepool resume RUN_ID [--wait]`: queues a paused run again from its checkpoint.
pub async fn resume(args: &ClientArgs, run_id: &str, wait: bool) -> i32 {
    let client = Client::new(args);
    let path = format!("/v1/runs/{run_id}/resume");
    let answer: proto::ResumeAnswer = match client
        .call(client.request(reqwest::Method::POST, &path))
        .await
    {
        Ok(answer) => answer,
        Err(failure) => return failure.report(),
    };
    let line = format!("Run {run_id} resumed from checkpoint {}", answer.checkpoint);
    answered(args, &client, run_id, &answer, &line, wait).await
}

/// `forgepool cancel RUN_ID`.
pub async fn cancel(args: &ClientArgs, run_id: &str) -> i32 {
    let client = Client::new(args);
    let path = format!("/v1/runs/{run_id}/cancel");
    match client
        .call::<proto::CancelAnswer>(client.request(reqwest::Method::POST, &path))
        .await
    {
        Ok(answer) if args.output == OutputFormat::Json => {
            json(&answer);
            0
        }
        Ok(answer) => {
            match answer.cancel {
                proto::CancelProgress::Done => println!("Run {run_id} cancelled"),
                proto::CancelProgress::Requested => {
                    println!("Cancel requested for run {run_id}; its worker stops it")
                }
            }
            0
        }
        Err(failure) => failure.report(),
    }
}

/// `forgepool follow-up RUN_ID --feedback TEXT`: a new run continuing a delivered run's
/// branch with the feedback (SPEC 17).
pub async fn follow_up(args: &ClientArgs, run_id: &str, feedback: &str) -> i32 {
    let client = Client::new(args);
    let path = format!("/v1/runs/{run_id}/follow-up");
    let request = client
        .request(reqwest::Method::POST, &path)
        .json(&serde_json::json!({ "feedback": feedback }));
    match client.call::<proto::SubmitResponse>(request).await {
        Ok(answer) if args.output == OutputFormat::Json => {
            json(&answer);
            0
        }
        Ok(answer) => {
            println!(
                "Follow-up of run {run_id} accepted as run {} ({})",
                answer.run_id, answer.state
            );
            0
        }
        Err(failure) => failure.report(),
    }
}
