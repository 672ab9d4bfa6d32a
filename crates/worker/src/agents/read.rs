//! What every kind's reader shares: bounded text, JSON lookups that never fail, the readable
//! forms of messages and tool calls, and the wait a provider's message names.
//!
//! `Transcript` entries are cut at 8 KiB; the rate-limit and reset phrases every reader looks for
//! are here.

use std::time::Duration;

use serde_json::Value;

use super::AgentReport;

/// The most characters of a message shown in one log line.
const LOG_TEXT: usize = 2000;
/// The most characters of a tool's input or output shown in one log line.
const LOG_TOOL: usize = 240;

/// `text` cut to at most `limit` bytes on a character boundary, marked when cut.
pub(crate) fn cut(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Parses one line as a JSON object; anything else is `None`.
pub(crate) fn object(line: &str) -> Option<Value> {
    let value: Value = serde_json::from_str(line.trim()).ok()?;
    value.is_object().then_some(value)
}

/// The string at a JSON pointer, or "".
pub(crate) fn text<'v>(value: &'v Value, pointer: &str) -> &'v str {
    value.pointer(pointer).and_then(Value::as_str).unwrap_or("")
}

/// The most a count read from a CLI's output may be: far above any real one, and small
/// enough that sums of them never overflow.
const MAX_COUNT: u64 = 1 << 40;
/// The most a cost read from a CLI's output may be, in USD.
const MAX_AMOUNT: f64 = 1e6;

/// The unsigned number at a JSON pointer, or 0 (a float is truncated; a negative is 0), at
/// most [`MAX_COUNT`].
pub(crate) fn count(value: &Value, pointer: &str) -> u64 {
    let number = match value.pointer(pointer) {
        Some(Value::Number(n)) => n
            .as_u64()
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .map(|f| f as u64)
            })
            .unwrap_or(0),
        _ => 0,
    };
    number.min(MAX_COUNT)
}

/// The number at a JSON pointer, if it is a finite non-negative one, at most
/// [`MAX_AMOUNT`].
pub(crate) fn amount(value: &Value, pointer: &str) -> Option<f64> {
    value
        .pointer(pointer)
        .and_then(Value::as_f64)
        .filter(|f| f.is_finite() && *f >= 0.0)
        .map(|f| f.min(MAX_AMOUNT))
}

/// Adds `more` to a running sum read from agent output, never overflowing.
pub(crate) fn add(sum: &mut u64, more: u64) {
    *sum = sum.saturating_add(more);
}

/// A JSON value as compact text (strings as they are).
pub(crate) fn compact(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Logs a line that is not one of the CLI's events (its own text, a stray print) as it is,
/// cut to [`LOG_TEXT`].
pub(crate) fn plain(readable: &mut String, line: &str) {
    readable.push_str(&cut(line, LOG_TEXT));
    readable.push('\n');
}

/// Adds an assistant message: to the transcript and as log text.
pub(crate) fn said(report: &mut AgentReport, readable: &mut String, message: &str) {
    let message = message.trim();
    if message.is_empty() {
        return;
    }
    report.transcript.push("assistant", None, message, false);
    readable.push_str(&cut(message, LOG_TEXT));
    readable.push('\n');
}

/// Adds a tool call: `→ Tool input`.
pub(crate) fn called(report: &mut AgentReport, readable: &mut String, tool: &str, input: &str) {
    report
        .transcript
        .push("tool_call", Some(tool), input, false);
    let input = one_line(&gist(input));
    readable.push_str(&format!(
        "→ {} {}\n",
        printable_name(tool),
        cut(&input, LOG_TOOL)
    ));
}

/// The arguments whose value says what a tool call does, in the order they are looked for:
/// the file, the command, the search.
const GIST_KEYS: [&str; 9] = [
    "file_path",
    "filePath",
    "absolute_path",
    "path",
    "command",
    "cmd",
    "pattern",
    "url",
    "query",
];

/// What a log line shows of a tool's input: the value of its first [`GIST_KEYS`] argument
/// (a command given as a list is joined), else the input as it is. The transcript keeps the
/// whole input.
pub(crate) fn gist(input: &str) -> String {
    if input.len() > 64 * 1024 {
        return input.to_string();
    }
    let Ok(Value::Object(arguments)) = serde_json::from_str::<Value>(input) else {
        return input.to_string();
    };
    GIST_KEYS
        .iter()
        .find_map(|key| match arguments.get(*key)? {
            Value::String(text) => Some(text.clone()),
            Value::Array(parts) => Some(parts.iter().map(compact).collect::<Vec<_>>().join(" ")),
            _ => None,
        })
        .unwrap_or_else(|| input.to_string())
}

/// Adds a tool's result: `← Tool: first line (N lines)`.
pub(crate) fn answered(
    report: &mut AgentReport,
    readable: &mut String,
    tool: Option<&str>,
    output: &str,
    is_error: bool,
) {
    report
        .transcript
        .push("tool_result", tool, output, is_error);
    let lines = output.lines().count();
    let first = one_line(output.lines().find(|l| !l.trim().is_empty()).unwrap_or(""));
    let name = tool.map(printable_name).unwrap_or_else(|| "result".into());
    let mark = if is_error { " (error)" } else { "" };
    let more = if lines > 1 {
        format!(" ({lines} lines)")
    } else {
        String::new()
    };
    readable.push_str(&format!(
        "← {name}{mark}: {}{more}\n",
        cut(&first, LOG_TOOL)
    ));
}

/// Adds a note of the CLI's own (its start, a retry, an error): to the transcript as
/// `system` and as log text.
pub(crate) fn noted(report: &mut AgentReport, readable: &mut String, role: &str, note: &str) {
    report.transcript.push(role, None, note, role == "error");
    readable.push_str(&format!("· {}\n", cut(&one_line(note), LOG_TEXT)));
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn printable_name(tool: &str) -> String {
    cut(tool, 64)
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// The wait a provider's or a CLI's message names: "try again in 7s", "Please retry in
/// 27.3s", "retry after 30 seconds", "retry-after: 7", "resets in 2m". The first one found.
pub fn retry_hint(message: &str) -> Option<Duration> {
    let lower = message.to_ascii_lowercase();
    for key in [
        "try again in",
        "retry in",
        "retry after",
        "retry-after:",
        "retry-after\":\"",
        "retry-after\": \"",
        "resets in",
        "reset in",
    ] {
        let mut from = 0;
        while let Some(at) = lower[from..].find(key) {
            let start = from + at + key.len();
            if let Some(wait) = duration_at(&lower[start..]) {
                return Some(wait);
            }
            from = start;
        }
    }
    None
}

/// A duration at the start of `text` (after spaces): a number and an optional unit
/// (`ms`, `s`, `sec`, `seconds`, `m`, `min`, `minutes`, `h`, `hours`; none means seconds),
/// optionally followed by more parts (`1m30s`). At most a day.
fn duration_at(text: &str) -> Option<Duration> {
    let mut rest = text.trim_start();
    let mut total = 0.0f64;
    let mut parts = 0;
    loop {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if digits == 0 || digits > 12 {
            break;
        }
        let Ok(number) = rest[..digits].parse::<f64>() else {
            break;
        };
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(rest.len());
        let unit = rest[..unit_len].trim();
        let scale = match unit {
            "ms" => 0.001,
            "" | "s" | "sec" | "secs" | "second" | "seconds" => 1.0,
            "m" | "min" | "mins" | "minute" | "minutes" => 60.0,
            "h" | "hr" | "hour" | "hours" => 3600.0,
            _ => break,
        };
        total += number * scale;
        parts += 1;
        rest = &rest[unit_len..];
        if unit.is_empty() || !rest.starts_with(|c: char| c.is_ascii_digit()) {
            break;
        }
    }
    (parts > 0 && total.is_finite() && total >= 0.0)
        .then(|| Duration::from_secs_f64(total.min(86_400.0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_read_from_the_words_providers_use() {
        let cases = [
            ("Rate limit reached. Please try again in 7s.", Some(7.0)),
            ("Please retry in 27.3s.", Some(27.3)),
            ("retry after 30 seconds", Some(30.0)),
            ("\"retry-after\":\"3\"", Some(3.0)),
            ("try again in 1m30s", Some(90.0)),
            ("try again in 250ms", Some(0.25)),
            ("try again in a moment", None),
            ("try again later", None),
            ("no hint at all", None),
            ("try again in 99999999 hours", Some(86_400.0)),
        ];
        for (message, expected) in cases {
            let got = retry_hint(message).map(|d| d.as_secs_f64());
            match (got, expected) {
                (Some(g), Some(e)) => assert!((g - e).abs() < 0.01, "{message}: {g} != {e}"),
                (g, e) => assert_eq!(g, e, "{message}"),
            }
        }
    }

    /// Catches: log lines that show a tool call as raw JSON (a whole file's content for a
    /// write) instead of what it acts on, and a gist that loses an input it cannot read.
    #[test]
    fn a_tool_call_is_logged_by_what_it_acts_on() {
        let cases = [
            (
                r#"{"file_path":"/workspace/a.py","content":"x = 1"}"#,
                "/workspace/a.py",
            ),
            (r#"{"command":["bash","-lc","ls -la"]}"#, "bash -lc ls -la"),
            (r#"{"cmd":"cargo test","timeout":10}"#, "cargo test"),
            (r#"{"pattern":"TODO","path":"src"}"#, "src"),
            (
                r#"{"content":"no known key"}"#,
                r#"{"content":"no known key"}"#,
            ),
            ("not json", "not json"),
            ("[1, 2]", "[1, 2]"),
        ];
        for (input, shown) in cases {
            assert_eq!(gist(input), shown, "{input}");
        }
        let mut report = AgentReport::new(proto::AgentKind::ClaudeCode);
        let mut readable = String::new();
        called(&mut report, &mut readable, "Write", cases[0].0);
        assert_eq!(readable, "→ Write /workspace/a.py\n");
        assert_eq!(
            report.transcript.entries[0].text, cases[0].0,
            "the transcript keeps it all"
        );
    }

    #[test]
    fn cuts_keep_characters_whole() {
        assert_eq!(cut("héllo", 2), "h…");
        assert_eq!(cut("hello", 9), "hello");
    }
}
