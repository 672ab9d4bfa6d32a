//! A scripted [`ContainerRuntime`] for the engine's unit tests: each stage kind plays a queue
//! of acts (files written into its mounts, output, an exit code, or a hang until its time
//! limit or cancellation), and every spec it was given is kept for the assertions.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use proto::{LogStream, Stage};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::agents::AgentReader;
use crate::runtime::{
    ContainerRuntime, LogChunk, RuntimeError, StageExit, StageOutput, StageSpec, LABEL_STAGE,
};

/// What one stage container does.
#[derive(Debug, Clone)]
pub enum Act {
    /// Writes `files` (container path, content) into its mounts, prints `stdout`, then exits
    /// with `code`.
    Exit {
        /// The exit code.
        code: i64,
        /// What it prints.
        stdout: String,
        /// Files written before it exits.
        files: Vec<(String, String)>,
    },
    /// Runs until its time limit or its run's cancellation.
    Hang,
    /// Works for this long (unless its run is cancelled first), then does the other act.
    Slow(Duration, Box<Act>),
    /// The engine cannot create it.
    Unstartable(String),
}

impl Act {
    /// Prints `stdout` and exits 0.
    pub fn prints(stdout: &str) -> Act {
        Act::exits(0, stdout)
    }

    /// Prints `stdout` and exits with `code`.
    pub fn exits(code: i64, stdout: &str) -> Act {
        Act::Exit {
            code,
            stdout: stdout.to_string(),
            files: Vec::new(),
        }
    }

    /// Writes one file and exits 0.
    pub fn writes(path: &str, content: &str) -> Act {
        Act::Exit {
            code: 0,
            stdout: String::new(),
            files: vec![(path.to_string(), content.to_string())],
        }
    }
}

/// The fake runtime.
#[derive(Debug, Default)]
pub struct FakeRuntime {
    script: Mutex<HashMap<&'static str, VecDeque<Act>>>,
    /// The last act of each stage kind, repeated when its queue runs out.
    last: Mutex<HashMap<&'static str, Act>>,
    started: Mutex<Vec<StageSpec>>,
    /// The prompt each stage found in `/forge/input/prompt.md` (empty without one).
    prompts: Mutex<Vec<String>>,
}

impl FakeRuntime {
    /// A runtime where `stage` plays `acts` in order, then repeats the last one.
    pub fn with(self, stage: Stage, acts: impl IntoIterator<Item = Act>) -> FakeRuntime {
        self.script
            .lock()
            .unwrap()
            .entry(stage.as_str())
            .or_default()
            .extend(acts);
        self
    }

    /// Every stage started so far, in order.
    pub fn started(&self) -> Vec<StageSpec> {
        self.started.lock().unwrap().clone()
    }

    /// The prompt each started stage was given, in order.
    pub fn prompts(&self) -> Vec<String> {
        self.prompts.lock().unwrap().clone()
    }

    /// The stage kinds started so far, in order.
    pub fn stages(&self) -> Vec<String> {
        self.started()
            .iter()
            .map(|spec| spec.labels.get(LABEL_STAGE).cloned().unwrap_or_default())
            .collect()
    }

    fn next_act(&self, stage: &str) -> Act {
        let key = [
            Stage::Implement,
            Stage::Verify,
            Stage::Review,
            Stage::FinalReview,
        ]
        .into_iter()
        .map(Stage::as_str)
        .find(|known| *known == stage)
        .unwrap_or("unknown");
        let next = self
            .script
            .lock()
            .unwrap()
            .get_mut(key)
            .and_then(VecDeque::pop_front);
        let mut last = self.last.lock().unwrap();
        match next {
            Some(act) => {
                last.insert(key, act.clone());
                act
            }
            None => last
                .get(key)
                .cloned()
                .unwrap_or_else(|| Act::exits(70, &format!("no act scripted for {stage}"))),
        }
    }
}

/// The host path a container path lands on through `spec`'s mounts.
fn host_path(spec: &StageSpec, path: &str) -> Result<PathBuf, String> {
    for mount in &spec.mounts {
        let target = mount.target.trim_end_matches('/');
        if let Some(rest) = path.strip_prefix(target) {
            if let Some(relative) = rest.strip_prefix('/') {
                if mount.read_only {
                    return Err(format!("{path}: read-only file system"));
                }
                return Ok(mount.source.join(relative));
            }
        }
    }
    Err(format!("{path}: no such mount"))
}

impl ContainerRuntime for FakeRuntime {
    type Created = (StageSpec, Act);

    async fn create_stage(&self, spec: StageSpec) -> Result<Self::Created, RuntimeError> {
        let stage = spec.labels.get(LABEL_STAGE).cloned().unwrap_or_default();
        match self.next_act(&stage) {
            Act::Unstartable(detail) => Err(RuntimeError::ImageMissing {
                image: spec.image.clone(),
                detail,
            }),
            act => Ok((spec, act)),
        }
    }

    async fn run_created(
        &self,
        (spec, act): Self::Created,
        logs: mpsc::Sender<LogChunk>,
        cancel: CancellationToken,
    ) -> Result<StageOutput, RuntimeError> {
        self.started.lock().unwrap().push(spec.clone());
        let prompt = spec
            .mounts
            .iter()
            .find(|m| m.target == "/forge/input")
            .and_then(|m| std::fs::read_to_string(m.source.join("prompt.md")).ok());
        self.prompts
            .lock()
            .unwrap()
            .push(prompt.unwrap_or_default());
        let began = tokio::time::Instant::now();
        let act = match act {
            Act::Slow(work, then) => tokio::select! {
                () = tokio::time::sleep(work) => *then,
                () = cancel.cancelled() => Act::Hang,
            },
            act => act,
        };
        let (exit, stdout, agent) = match act {
            Act::Exit {
                code,
                stdout,
                files,
            } => {
                let mut code = code;
                let mut stdout = stdout;
                for (path, content) in files {
                    let written = host_path(&spec, &path).and_then(|host| {
                        if let Some(parent) = host.parent() {
                            std::fs::create_dir_all(parent).map_err(|e| e.to_string())?;
                        }
                        std::fs::write(&host, content).map_err(|e| e.to_string())
                    });
                    if let Err(error) = written {
                        stdout.push_str(&format!("\n{error}\n"));
                        code = 1;
                    }
                }
                // An agent kind's output is read as the Docker runtime reads it.
                let (logged, agent) = match spec
                    .agent
                    .and_then(|kind| AgentReader::read_all(kind, &stdout))
                {
                    Some((report, readable)) => (readable, Some(report)),
                    None => (stdout, None),
                };
                if !logged.is_empty() {
                    let chunk = LogChunk {
                        stream: LogStream::Stdout,
                        text: logged.clone(),
                    };
                    let _ = logs.send(chunk).await;
                }
                (StageExit::Exited(code), logged, agent)
            }
            Act::Hang => tokio::select! {
                () = tokio::time::sleep(spec.timeout) => (StageExit::TimedOut, String::new(), None),
                () = cancel.cancelled() => (StageExit::Cancelled, String::new(), None),
            },
            Act::Unstartable(_) => unreachable!("refused at creation"),
            Act::Slow(..) => unreachable!("a slow act is done above"),
        };
        Ok(StageOutput {
            exit,
            tail: stdout.clone(),
            stdout,
            duration: began.elapsed().max(Duration::from_millis(1)),
            agent,
        })
    }

    async fn remove_orphans(&self) -> Result<usize, RuntimeError> {
        Ok(0)
    }

    fn instance(&self) -> &str {
        "fake"
    }

    async fn other_instances(&self) -> Result<HashSet<String>, RuntimeError> {
        Ok(HashSet::new())
    }

    async fn remove_instance(&self, _instance: &str) -> Result<usize, RuntimeError> {
        Ok(0)
    }

    async fn close(&self) {}
}
