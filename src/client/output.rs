//! What the clients print, and how: plain lines off a terminal (or with `NO_COLOR`), lines
//! with colour and a spinner on one, JSON for scripts. Everything an agent wrote goes through
//! [`progress::printable`] first, so no escape sequence of its own reaches the terminal.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::{Event, EventKind, RunState};

use crate::config::{ClientArgs, OutputFormat};
use crate::progress;

/// How lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// Plain text: no escape code at all.
    Plain,
    /// A terminal: colour, and a spinner line on stderr.
    Terminal,
    /// JSON documents.
    Json,
}

impl Style {
    /// The style the arguments and the environment ask for: JSON when asked; a terminal's
    /// only when stdout is one and `NO_COLOR` is unset (or empty).
    pub fn of(args: &ClientArgs) -> Style {
        if args.output == OutputFormat::Json {
            return Style::Json;
        }
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        if !no_color && std::io::stdout().is_terminal() && std::io::stderr().is_terminal() {
            Style::Terminal
        } else {
            Style::Plain
        }
    }
}

/// What the spinner shows.
#[derive(Debug, Default)]
struct Status {
    /// The stage running, or the run's state, in words.
    doing: String,
    /// Since when.
    since: Option<Instant>,
    /// Runs ahead of this one while it is queued.
    queue_position: Option<usize>,
    /// Whether the spinner's line is on the screen now.
    shown: bool,
}

/// Prints a run's progress while it is watched.
#[derive(Debug, Clone)]
pub struct Printer {
    style: Style,
    timestamps: bool,
    status: Arc<Mutex<Status>>,
}

const FRAMES: [&str; 10] = ["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧", "⠇", "⠏"];
const CLEAR_LINE: &str = "\r\x1b[2K";

impl Printer {
    /// A printer for `args`.
    pub fn new(args: &ClientArgs) -> Printer {
        Printer {
            style: Style::of(args),
            timestamps: args.timestamps,
            status: Arc::default(),
        }
    }

    /// The style in use.
    pub fn style(&self) -> Style {
        self.style
    }

    /// Prints one event: its JSON line, or its progress line (if it has one); on a terminal
    /// the spinner then shows what the run is doing.
    pub fn event(&self, event: &Event, raw: &str) {
        if self.style == Style::Json {
            println!("{raw}");
            return;
        }
        self.follow_status(&event.kind);
        let Some(line) = progress::line(&event.kind) else {
            return;
        };
        let line = if self.timestamps {
            format!("{} {line}", event.time)
        } else {
            line
        };
        self.line(&self.colour(&event.kind, line));
    }

    /// Prints a line of text on stdout (clearing the spinner's line first on a terminal).
    pub fn line(&self, text: &str) {
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if status.shown {
            eprint!("{CLEAR_LINE}");
            status.shown = false;
        }
        println!("{text}");
    }

    /// Starts a watch of `view`: the spinner shows its state, and a run still waiting for a
    /// slot says so in a line (it has no event to print yet).
    pub fn begin(&self, view: &proto::RunView) {
        {
            let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
            status.doing = view.state.as_str().to_string();
            status.since = Some(Instant::now());
        }
        if view.state == RunState::Queued && self.style != Style::Json {
            let waiting = match &view.waiting_for_profile {
                Some(profile) => format!(
                    " (its agent profile {} is at its cap)",
                    progress::printable(profile)
                ),
                None => String::new(),
            };
            self.line(&format!(
                "Run {} is queued, waiting for a free slot{waiting}",
                view.run_id
            ));
        }
    }

    /// Sets how many runs are ahead of this one in the queue.
    pub fn set_queue_position(&self, position: Option<usize>) {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .queue_position = position;
    }

    /// Whether the run is queued now, as the events told.
    pub fn queued(&self) -> bool {
        let status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        status.doing == "queued"
    }

    fn follow_status(&self, kind: &EventKind) {
        let doing = match kind {
            EventKind::StageStarted {
                stage,
                round,
                cycle,
            } => Some(match cycle {
                Some(cycle) => format!("{} (round {round}, cycle {cycle})", stage.as_str()),
                None => format!("{} (round {round})", stage.as_str()),
            }),
            EventKind::State { state, .. } => Some(state.as_str().to_string()),
            _ => None,
        };
        if let Some(doing) = doing {
            let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
            status.doing = doing;
            status.since = Some(Instant::now());
        }
    }

    fn colour(&self, kind: &EventKind, line: String) -> String {
        if self.style != Style::Terminal {
            return line;
        }
        let code = match kind {
            EventKind::Cycle { cycle } if cycle.verdict == "approved" => "32",
            EventKind::Cycle { .. } => "31",
            EventKind::State { state, .. } => match state {
                RunState::Delivered => "32",
                RunState::DeliveredWithWarnings | RunState::Paused => "33",
                RunState::Blocked | RunState::Failed | RunState::Cancelled => "31",
                _ => return line,
            },
            EventKind::Check { result } if result.exit_code == Some(0) => "32",
            EventKind::Check { .. } => "31",
            _ => return line,
        };
        format!("\x1b[{code}m{line}\x1b[0m")
    }

    /// Draws the spinner on stderr every 100 ms until the returned guard is dropped; only on
    /// a terminal.
    pub fn spin(&self) -> Option<tokio::task::JoinHandle<()>> {
        if self.style != Style::Terminal {
            return None;
        }
        let status = Arc::clone(&self.status);
        Some(tokio::spawn(async move {
            let mut frame = 0;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let mut status = status.lock().unwrap_or_else(|e| e.into_inner());
                if status.doing.is_empty() {
                    continue;
                }
                let elapsed = status.since.map_or(0, |s| s.elapsed().as_secs());
                let queue = match status.queue_position {
                    Some(0) => ", next in the queue".to_string(),
                    Some(ahead) => format!(", {ahead} ahead in the queue"),
                    None => String::new(),
                };
                let mut stderr = std::io::stderr().lock();
                let _ = write!(
                    stderr,
                    "{CLEAR_LINE}{} {} {}m{:02}s{queue}",
                    FRAMES[frame % FRAMES.len()],
                    status.doing,
                    elapsed / 60,
                    elapsed % 60
                );
                let _ = stderr.flush();
                status.shown = true;
                frame += 1;
            }
        }))
    }

    /// Clears the spinner's line, if it is shown.
    pub fn finish(&self, spinner: Option<tokio::task::JoinHandle<()>>) {
        if let Some(spinner) = spinner {
            spinner.abort();
        }
        let mut status = self.status.lock().unwrap_or_else(|e| e.into_inner());
        if status.shown {
            eprint!("{CLEAR_LINE}");
            status.shown = false;
        }
    }
}

/// Prints a JSON document on stdout.
pub fn json<T: serde::Serialize>(document: &T) {
    match serde_json::to_string_pretty(document) {
        Ok(text) => println!("{text}"),
        Err(error) => eprintln!("error: cannot write JSON: {error}"),
    }
}
