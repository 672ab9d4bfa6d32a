//! `forgepool watch`: a run's event stream, followed until the run ends. A stream that breaks
//! (the dispatcher restarted, a proxy cut it) is opened again with `Last-Event-ID`, and an
//! event at or before the last one printed is never printed again.

use std::time::Duration;

use futures_util::StreamExt;
use proto::{Event, EventKind, RunList, RunState};

use super::output::Printer;
use super::{Client, Failure, EXIT_FAILED};

/// How often a broken stream is opened again before giving up, counted since the last event.
const RECONNECTS: u32 = 20;
/// The longest a client waits for anything on an open stream: the dispatcher sends a comment
/// every 15 s at least.
const STREAM_IDLE: Duration = Duration::from_secs(45);

/// Where a watch is.
struct Watch<'a> {
    client: &'a Client,
    run_id: &'a str,
    printer: &'a Printer,
    /// The position of the last event printed.
    last: Option<i64>,
    paused: bool,
}

/// How one connection of the stream ended.
enum Ended {
    /// The run reached a terminal state: its exit code.
    Terminal(i32),
    /// The dispatcher closed the stream (a paused run, or a shutdown).
    Closed,
    /// The connection broke.
    Broken(String),
}

/// Follows `run_id`'s events until it ends; returns its exit code. The run is read first: a
/// queued run has no events yet, and its watcher is told where it stands at once.
pub async fn watch_run(client: &Client, run_id: &str, printer: &Printer) -> i32 {
    let view = match client
        .get_json::<proto::RunView>(&format!("/v1/runs/{run_id}"))
        .await
    {
        Ok(view) => view,
        Err(failure) => return failure.report(),
    };
    printer.begin(&view);
    let spinner = printer.spin();
    let mut watch = Watch {
        client,
        run_id,
        printer,
        last: None,
        paused: false,
    };
    let code = watch.follow().await;
    printer.finish(spinner);
    code
}

impl Watch<'_> {
    async fn follow(&mut self) -> i32 {
        let mut attempts = 0;
        loop {
            let before = self.last;
            let ended = match self.connect().await {
                Ok(response) => self.read(response).await,
                Err(failure) if self.last.is_none() && attempts == 0 => return failure.report(),
                Err(failure) => Ended::Broken(failure.message()),
            };
            match ended {
                Ended::Terminal(code) => return code,
                Ended::Closed if self.paused && self.still_paused().await => {
                    self.printer.line(&format!(
                        "Resume it with `forgepool resume {}`",
                        self.run_id
                    ));
                    return RunState::Paused.exit_code().unwrap_or(EXIT_FAILED);
                }
                Ended::Closed | Ended::Broken(_) => {
                    if self.last != before {
                        attempts = 0;
                    }
                    attempts += 1;
                    if attempts > RECONNECTS {
                        let why = match ended {
                            Ended::Broken(why) => why,
                            _ => "the dispatcher kept closing the stream".into(),
                        };
                        eprintln!(
                            "error: the event stream of run {} broke {RECONNECTS} times ({why}); run `forgepool watch {}` again",
                            self.run_id, self.run_id
                        );
                        return EXIT_FAILED;
                    }
                    let pause = Duration::from_millis(250 * u64::from(attempts.min(20)));
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Opens the stream after the last event printed.
    async fn connect(&self) -> Result<reqwest::Response, Failure> {
        let mut request = self
            .client
            .request(
                reqwest::Method::GET,
                &format!("/v1/runs/{}/events", self.run_id),
            )
            .header(reqwest::header::ACCEPT, "text/event-stream");
        if let Some(last) = self.last {
            request = request.header("Last-Event-ID", last.to_string());
        }
        self.client.open(request).await
    }

    /// Prints the stream's events until it ends.
    async fn read(&mut self, response: reqwest::Response) -> Ended {
        let mut stream = response.bytes_stream();
        let mut buffer = String::new();
        loop {
            let queued = self.printer.queued();
            let wait = if queued {
                Duration::from_secs(5)
            } else {
                STREAM_IDLE
            };
            let chunk = match tokio::time::timeout(wait, stream.next()).await {
                Ok(Some(Ok(chunk))) => chunk,
                Ok(Some(Err(error))) => return Ended::Broken(error.to_string()),
                Ok(None) => return Ended::Closed,
                Err(_) if queued => {
                    self.show_queue_position().await;
                    continue;
                }
                Err(_) => return Ended::Broken(format!("nothing for {STREAM_IDLE:?}")),
            };
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buffer.find("\n\n") {
                let message: String = buffer.drain(..end + 2).collect();
                if let Some(code) = self.take(&message) {
                    return Ended::Terminal(code);
                }
            }
            if self.printer.queued() {
                self.show_queue_position().await;
            }
        }
    }

    /// Prints one Server-Sent Event; returns the exit code once the run ended.
    fn take(&mut self, message: &str) -> Option<i32> {
        let mut id = None;
        let mut data = Vec::new();
        for line in message.lines() {
            if let Some(value) = line.strip_prefix("id:") {
                id = value.trim().parse::<i64>().ok();
            } else if let Some(value) = line.strip_prefix("data:") {
                data.push(value.strip_prefix(' ').unwrap_or(value));
            }
        }
        let data = data.join("\n");
        let event = serde_json::from_str::<Event>(&data).ok()?;
        if let (Some(id), Some(last)) = (id, self.last) {
            if id <= last {
                return None;
            }
        }
        if id.is_some() {
            self.last = id;
        }
        self.printer.event(&event, &data);
        if let EventKind::State { state, .. } = event.kind {
            if state.is_terminal() {
                return Some(state.exit_code().unwrap_or(EXIT_FAILED));
            }
            self.paused = state == RunState::Paused;
        }
        None
    }

    async fn still_paused(&self) -> bool {
        let path = format!("/v1/runs/{}", self.run_id);
        self.client
            .get_json::<proto::RunView>(&path)
            .await
            .is_ok_and(|view| view.state == RunState::Paused)
    }

    /// On a terminal, how many queued runs are ahead of this one (older and still queued).
    async fn show_queue_position(&self) {
        if self.printer.style() != super::output::Style::Terminal {
            return;
        }
        let Ok(list) = self
            .client
            .get_json::<RunList>("/v1/runs?state=queued&limit=500")
            .await
        else {
            return;
        };
        let position = list
            .runs
            .iter()
            .position(|run| run.run_id.to_string() == self.run_id)
            .map(|index| list.runs.len() - index - 1);
        self.printer.set_queue_position(position);
    }
}
