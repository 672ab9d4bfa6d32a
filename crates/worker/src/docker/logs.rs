//! A stage's output as it is read: captured, redacted, capped, and forwarded in chunks.
//!
//! A stopped container's log stream gets `LOG_DRAIN` (5 s) for each read: a follow request that
//! races the container's exit can stay open for ever on Docker 20.10, and must not hold a finished
//! stage. Forwarding what was read is never cut short.

use bollard::query_parameters::LogsOptions;
use bollard::Docker;
use futures_util::StreamExt;

use super::LOG_DRAIN;
use crate::agents::{AgentReader, AgentReport};
use crate::runtime::{tail, TAIL_BYTES};
use bollard::container::LogOutput;
use proto::LogStream;
use tokio::sync::mpsc;

use crate::runtime::{
    redact, LogChunk, MAX_CAPTURED_STDOUT, MAX_LOG_BYTES, MAX_LOG_LINES, MAX_PARTIAL_LINE,
};

/// A stage's output as it is read: the captured stdout and the combined tail (both redacted),
/// and the partial lines of each stream not yet forwarded as chunks.
#[derive(Debug, Default)]
pub(super) struct Collected {
    /// For an agent kind's stage: reads its stdout into readable lines and its report.
    reader: Option<AgentReader>,
    stdout: String,
    combined: String,
    pending: [String; 2],
    /// Bytes and lines forwarded as log chunks so far.
    forwarded_bytes: usize,
    forwarded_lines: usize,
    /// Bytes and lines past the caps: counted, never forwarded.
    dropped_bytes: usize,
    dropped_lines: usize,
}

impl Collected {
    /// A collector for a stage of `agent`'s kind (`None`: output is logged as it is).
    pub(super) fn new(agent: Option<proto::AgentKind>) -> Collected {
        Collected {
            reader: agent.and_then(AgentReader::new),
            ..Collected::default()
        }
    }

    /// Reads the container's output until the stream ends, forwarding whole lines.
    pub(super) async fn follow(
        &mut self,
        docker: &Docker,
        id: &str,
        secrets: &[String],
        logs: &mpsc::Sender<LogChunk>,
        mut stopped: tokio::sync::watch::Receiver<bool>,
    ) {
        let options = LogsOptions {
            follow: true,
            stdout: true,
            stderr: true,
            tail: "all".into(),
            ..Default::default()
        };
        let mut stream = docker.logs(id, Some(options));
        let mut container_stopped = *stopped.borrow();
        loop {
            let item = if container_stopped {
                match tokio::time::timeout(LOG_DRAIN, stream.next()).await {
                    Ok(item) => item,
                    Err(_) => {
                        tracing::warn!(container = %id, "the log stream stayed open after the container stopped; it was closed");
                        break;
                    }
                }
            } else {
                tokio::select! {
                    item = stream.next() => item,
                    // A dropped sender means the same: the container is done.
                    _ = stopped.changed() => {
                        container_stopped = true;
                        continue;
                    }
                }
            };
            let Some(item) = item else {
                break;
            };
            let (stream_kind, bytes) = match item {
                Ok(LogOutput::StdOut { message }) => (LogStream::Stdout, message),
                Ok(LogOutput::StdErr { message }) => (LogStream::Stderr, message),
                Ok(LogOutput::Console { message }) => (LogStream::Stdout, message),
                Ok(LogOutput::StdIn { .. }) => continue,
                Err(_) => break,
            };
            let text = String::from_utf8_lossy(&bytes);
            let slot = &mut self.pending[usize::from(stream_kind == LogStream::Stderr)];
            slot.push_str(&text);
            if let Some(end) = slot.rfind('\n') {
                let lines: String = slot.drain(..=end).collect();
                self.emit(&lines, stream_kind, secrets, logs).await;
            } else if slot.len() > MAX_PARTIAL_LINE {
                // A line without end is forwarded in pieces: the buffer stays bounded. The
                // last bytes stay behind, so that a secret is never cut in two pieces that
                // redaction would each miss.
                let redacted = redact(slot, secrets);
                let keep = secrets
                    .iter()
                    .map(String::len)
                    .max()
                    .unwrap_or(1)
                    .saturating_sub(1);
                let mut cut = redacted.len().saturating_sub(keep);
                while !redacted.is_char_boundary(cut) {
                    cut -= 1;
                }
                *slot = redacted[cut..].to_string();
                let piece = redacted[..cut].to_string();
                self.emit(&piece, stream_kind, secrets, logs).await;
            }
        }
    }

    /// Forwards the partial lines left, and returns the captured stdout and combined output,
    /// and the agent's report for an agent kind's stage.
    pub(super) async fn finish(
        mut self,
        secrets: &[String],
        logs: &mpsc::Sender<LogChunk>,
    ) -> (String, String, Option<AgentReport>) {
        for (index, rest) in std::mem::take(&mut self.pending).into_iter().enumerate() {
            if !rest.is_empty() {
                let kind = if index == 0 {
                    LogStream::Stdout
                } else {
                    LogStream::Stderr
                };
                self.emit(&rest, kind, secrets, logs).await;
            }
        }
        let report = match self.reader.take() {
            Some(reader) => {
                let (report, rest) = reader.finish();
                self.forward(rest, LogStream::Stdout, logs).await;
                Some(report)
            }
            None => None,
        };
        if self.dropped_bytes > 0 {
            let summary = format!(
                "[forgepool: {} more bytes in {} lines of output were not stored; a stage keeps at most {} bytes and {} lines of its log]\n",
                self.dropped_bytes, self.dropped_lines, MAX_LOG_BYTES, MAX_LOG_LINES
            );
            let _ = logs
                .send(LogChunk {
                    stream: LogStream::Stderr,
                    text: summary,
                })
                .await;
        }
        (self.stdout, self.combined, report)
    }

    async fn emit(
        &mut self,
        text: &str,
        stream: LogStream,
        secrets: &[String],
        logs: &mpsc::Sender<LogChunk>,
    ) {
        let mut text = redact(text, secrets);
        if let Some(reader) = &mut self.reader {
            // The CLI's record is read whole, before any cap; what is logged and kept is its
            // readable form.
            match stream {
                LogStream::Stdout => text = reader.stdout(&text),
                LogStream::Stderr => reader.stderr(&text),
            }
        }
        self.forward(text, stream, logs).await;
    }

    /// Keeps and forwards text read from the stage, within the caps.
    async fn forward(&mut self, text: String, stream: LogStream, logs: &mpsc::Sender<LogChunk>) {
        if text.is_empty() {
            return;
        }
        if stream == LogStream::Stdout && self.stdout.len() < MAX_CAPTURED_STDOUT {
            let room = MAX_CAPTURED_STDOUT - self.stdout.len();
            self.stdout.push_str(head(&text, room));
        }
        self.combined.push_str(&text);
        if self.combined.len() > 4 * TAIL_BYTES {
            self.combined = tail(&self.combined, TAIL_BYTES).to_string();
        }
        let lines = text.matches('\n').count().max(1);
        if self.forwarded_bytes + text.len() > MAX_LOG_BYTES
            || self.forwarded_lines + lines > MAX_LOG_LINES
        {
            self.dropped_bytes += text.len();
            self.dropped_lines += lines;
            return;
        }
        self.forwarded_bytes += text.len();
        self.forwarded_lines += lines;
        // The receiver is gone only when the engine stopped listening; output is still
        // captured.
        let _ = logs.send(LogChunk { stream, text }).await;
    }
}

/// The first `limit` bytes of `text` on a character boundary.
fn head(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}
