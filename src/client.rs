//! The dispatcher's clients: `submit`, `watch`, `status` and `cancel`. They print the same
//! progress lines and use the same exit codes as `forgepool run`.

use std::path::PathBuf;

use futures_util::StreamExt;
use proto::{Event, EventKind, Problem, RunList, RunView, SubmitResponse};

use crate::config::ClientArgs;
use crate::progress;

/// Exit code for invalid input or configuration.
const EXIT_INVALID: i32 = 2;
/// Exit code when the dispatcher cannot be reached or fails.
const EXIT_FAILED: i32 = 1;

struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    fn new(args: &ClientArgs) -> Client {
        Client {
            http: reqwest::Client::new(),
            base: args.dispatcher_url.trim_end_matches('/').to_string(),
            token: args.api_token.clone(),
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => builder.bearer_auth(token),
            None => builder,
        }
    }

    /// Sends a request and decodes a success or prints the API error; `Err` holds the exit code.
    async fn call<T: serde::de::DeserializeOwned>(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<T, i32> {
        let response = builder.send().await.map_err(|error| {
            eprintln!("error: cannot reach the dispatcher at {}: {error}; start it or set FORGEPOOL_DISPATCHER_URL", self.base);
            EXIT_FAILED
        })?;
        let status = response.status();
        let body = response.bytes().await.unwrap_or_default();
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|error| {
                eprintln!("error: unexpected answer from the dispatcher: {error}");
                EXIT_FAILED
            });
        }
        match serde_json::from_slice::<Problem>(&body) {
            Ok(problem) => eprintln!("error: {} ({})", problem.detail, problem.code),
            Err(_) => eprintln!("error: the dispatcher answered {status}"),
        }
        Err(if status.is_client_error() {
            EXIT_INVALID
        } else {
            EXIT_FAILED
        })
    }
}

/// `forgepool submit FILE [--wait]`.
pub async fn submit(args: &ClientArgs, file: &PathBuf, wait: bool) -> i32 {
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
    let accepted: SubmitResponse = match client
        .call(
            client
                .request(reqwest::Method::POST, "/v1/runs")
                .json(&request),
        )
        .await
    {
        Ok(accepted) => accepted,
        Err(code) => return code,
    };
    for warning in &accepted.warnings {
        eprintln!("warning: {warning}");
    }
    println!("Run {} accepted", accepted.run_id);
    if wait {
        watch_run(&client, &accepted.run_id.to_string()).await
    } else {
        0
    }
}

/// `forgepool watch RUN_ID`.
pub async fn watch(args: &ClientArgs, run_id: &str) -> i32 {
    watch_run(&Client::new(args), run_id).await
}

async fn watch_run(client: &Client, run_id: &str) -> i32 {
    let response = match client
        .request(reqwest::Method::GET, &format!("/v1/runs/{run_id}/events"))
        .send()
        .await
    {
        Ok(response) if response.status().is_success() => response,
        Ok(response) => {
            let status = response.status();
            match response.json::<Problem>().await {
                Ok(problem) => eprintln!("error: {}", problem.detail),
                Err(_) => eprintln!("error: the dispatcher answered {status}"),
            }
            return if status.is_client_error() {
                EXIT_INVALID
            } else {
                EXIT_FAILED
            };
        }
        Err(error) => {
            eprintln!(
                "error: cannot reach the dispatcher at {}: {error}",
                client.base
            );
            return EXIT_FAILED;
        }
    };
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    // The dispatcher ends the stream while the run is paused; a paused state seen in the replay
    // of a resumed run is followed by more events.
    let mut paused = false;
    while let Some(chunk) = stream.next().await {
        let Ok(chunk) = chunk else { break };
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let message: String = buffer.drain(..end + 2).collect();
            let data: String = message
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect::<Vec<_>>()
                .join("\n");
            let Ok(event) = serde_json::from_str::<Event>(&data) else {
                continue;
            };
            if let Some(line) = progress::line(&event.kind) {
                println!("{line}");
            }
            if let EventKind::State { state, .. } = event.kind {
                if state.is_terminal() {
                    return state.exit_code().unwrap_or(EXIT_FAILED);
                }
                paused = state == proto::RunState::Paused;
            }
        }
    }
    if paused {
        println!("Resume it with `forgepool resume {run_id}`");
        return proto::RunState::Paused.exit_code().unwrap_or(EXIT_FAILED);
    }
    eprintln!(
        "error: the event stream ended before the run did; run `forgepool watch {run_id}` again"
    );
    EXIT_FAILED
}

/// `forgepool status [RUN_ID]`.
pub async fn status(args: &ClientArgs, run_id: Option<&str>) -> i32 {
    let client = Client::new(args);
    match run_id {
        Some(run_id) => {
            let view: RunView = match client
                .call(client.request(reqwest::Method::GET, &format!("/v1/runs/{run_id}")))
                .await
            {
                Ok(view) => view,
                Err(code) => return code,
            };
            println!(
                "Run {} ({}, skill {}): {}",
                view.run_id, view.ticket, view.skill, view.state
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
                    "  round {} ({}): tree {}, {checks}",
                    round.round,
                    round.reason,
                    &round.tree[..round.tree.len().min(12)]
                );
            }
            for cycle in &view.cycles {
                if let Some(line) = progress::line(&EventKind::Cycle {
                    cycle: cycle.clone(),
                }) {
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
                println!("  budget: ${:.2}", budget.max_cost_usd);
            }
            if let Some(result) = &view.result {
                if let (Some(branch), Some(commit)) = (&result.branch, &result.commit) {
                    println!("  delivered {} at {commit}", progress::printable(branch));
                }
                if let Some(pull) = &result.pull_request {
                    println!("  pull request {}", progress::printable(pull));
                }
            }
            0
        }
        None => {
            let list: RunList = match client
                .call(client.request(reqwest::Method::GET, "/v1/runs"))
                .await
            {
                Ok(list) => list,
                Err(code) => return code,
            };
            for run in list.runs {
                println!(
                    "{}  {:<24} {:<12} {}",
                    run.run_id,
                    run.state.as_str(),
                    run.ticket,
                    run.updated_at
                );
            }
            0
        }
    }
}

/// `forgepool resume RUN_ID [--wait]`: queues a paused run again from its checkpoint.
pub async fn resume(args: &ClientArgs, run_id: &str, wait: bool) -> i32 {
    let client = Client::new(args);
    match client
        .call::<serde_json::Value>(
            client.request(reqwest::Method::POST, &format!("/v1/runs/{run_id}/resume")),
        )
        .await
    {
        Ok(answer) => {
            println!(
                "Run {run_id} resumed from checkpoint {}",
                answer["checkpoint"]
            );
            if wait {
                watch_run(&client, run_id).await
            } else {
                0
            }
        }
        Err(code) => code,
    }
}

/// `forgepool cancel RUN_ID`.
pub async fn cancel(args: &ClientArgs, run_id: &str) -> i32 {
    let client = Client::new(args);
    match client
        .call::<serde_json::Value>(
            client.request(reqwest::Method::POST, &format!("/v1/runs/{run_id}/cancel")),
        )
        .await
    {
        Ok(_) => {
            println!("Cancel requested for run {run_id}");
            0
        }
        Err(code) => code,
    }
}
