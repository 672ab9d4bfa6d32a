//! Metering on the wire: the bytes of an answer pass through a [`Meter`] on their way to the
//! stage, unchanged and undelayed; the meter keeps the usage the answer states. A stream
//! (`text/event-stream`) is read one `data:` line at a time, a line held up to
//! [`MAX_EVENT_LINE`]; any other body is copied up to [`MAX_METERED_BODY`] and read whole at
//! its end. Past either bound the meter stops reading (the answer still flows) and says so,
//! so a hostile or huge answer costs bounded memory.

use serde_json::Value;

use crate::api::Api;
use crate::Counts;

/// The longest stream line the meter holds.
pub const MAX_EVENT_LINE: usize = 1024 * 1024;
/// The largest non-stream answer the meter reads.
pub const MAX_METERED_BODY: usize = 8 * 1024 * 1024;

/// Reads one answer's usage as its bytes pass.
#[derive(Debug)]
pub struct Meter {
    api: Api,
    stream: bool,
    held: Vec<u8>,
    /// A stream line past the bound: skipped up to its end.
    skipping: bool,
    /// A body past the bound: nothing more is read.
    overflowed: bool,
    /// Whether the answer stated its final usage ([`Api::observe`]).
    stated: bool,
    counts: Counts,
}

/// What a finished meter read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metered {
    /// The usage the answer stated.
    pub counts: Counts,
    /// Whether part of the answer was too large to read.
    pub overflowed: bool,
    /// Whether the answer stated its final usage: one that did not (cut short, or never
    /// asked to) is settled at its reservation.
    pub stated: bool,
}

impl Meter {
    /// A meter for an answer of `api`; `stream` when its content type is an event stream.
    pub fn new(api: Api, stream: bool) -> Meter {
        Meter {
            api,
            stream,
            held: Vec::new(),
            skipping: false,
            overflowed: false,
            stated: false,
            counts: Counts::default(),
        }
    }

    /// Reads the next bytes of the answer.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        if !self.stream {
            if self.overflowed {
                return;
            }
            if self.held.len() + bytes.len() > MAX_METERED_BODY {
                self.overflowed = true;
                self.held = Vec::new();
                return;
            }
            self.held.extend_from_slice(bytes);
            return;
        }
        while let Some(end) = bytes.iter().position(|&b| b == b'\n') {
            let (line, rest) = bytes.split_at(end);
            if self.skipping {
                self.skipping = false;
            } else if self.held.is_empty() {
                self.line(line);
            } else {
                self.held.extend_from_slice(line);
                let held = std::mem::take(&mut self.held);
                self.line(&held);
            }
            bytes = &rest[1..];
        }
        if self.skipping {
            return;
        }
        if self.held.len() + bytes.len() > MAX_EVENT_LINE {
            self.held = Vec::new();
            self.skipping = true;
            self.overflowed = true;
        } else {
            self.held.extend_from_slice(bytes);
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        let data = data.strip_prefix(b" ").unwrap_or(data);
        if let Ok(value) = serde_json::from_slice::<Value>(data) {
            self.stated |= self.api.observe(&value, &mut self.counts);
        }
    }

    /// What the answer stated.
    pub fn finish(mut self) -> Metered {
        if self.stream {
            if !self.held.is_empty() && !self.skipping {
                let held = std::mem::take(&mut self.held);
                self.line(&held);
            }
        } else if !self.overflowed {
            if let Ok(value) = serde_json::from_slice::<Value>(&self.held) {
                self.stated |= self.api.observe(&value, &mut self.counts);
            }
        }
        Metered {
            counts: self.counts,
            overflowed: self.overflowed,
            stated: self.stated,
        }
    }

    /// The usage read so far (an answer cut short is settled with it).
    pub fn counts(&self) -> &Counts {
        &self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"m\",\"usage\":{\"input_tokens\":321,\"output_tokens\":1}}}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\"}\n\nevent: message_delta\r\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":45}}\r\n\r\n";

    /// Catches: usage lost when an event is split across chunks at any byte (the network
    /// decides where), or CRLF lines not read.
    #[test]
    fn a_stream_is_metered_whatever_its_chunks() {
        for cut in 0..STREAM.len() {
            for second in cut..STREAM.len() {
                if second % 7 != 0 {
                    continue;
                }
                let mut meter = Meter::new(Api::AnthropicMessages, true);
                meter.feed(&STREAM.as_bytes()[..cut]);
                meter.feed(&STREAM.as_bytes()[cut..second]);
                meter.feed(&STREAM.as_bytes()[second..]);
                let metered = meter.finish();
                assert_eq!(
                    (metered.counts.input, metered.counts.output),
                    (321, 45),
                    "cut at {cut}, {second}"
                );
                assert!(!metered.overflowed && metered.stated);
            }
        }
    }

    /// Catches: unbounded memory for an endless line or body, and a line past the bound
    /// that poisons the lines after it.
    #[test]
    fn memory_is_bounded_and_later_lines_still_count() {
        let mut meter = Meter::new(Api::AnthropicMessages, true);
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..64 {
            meter.feed(&chunk);
        }
        assert!(meter.held.len() <= MAX_EVENT_LINE);
        meter.feed(b"\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":5}}\n");
        let metered = meter.finish();
        assert_eq!(metered.counts.output, 5);
        assert!(metered.overflowed);

        let mut meter = Meter::new(Api::OpenaiChat, false);
        for _ in 0..200 {
            meter.feed(&chunk);
        }
        assert!(meter.held.capacity() <= MAX_METERED_BODY * 2);
        assert!(meter.finish().overflowed);
    }

    /// Catches: a whole JSON answer not metered.
    #[test]
    fn a_body_is_read_at_its_end() {
        let mut meter = Meter::new(Api::OpenaiChat, false);
        meter.feed(b"{\"model\":\"gpt\",\"usage\":{\"prompt_tokens\":7,");
        meter.feed(b"\"completion_tokens\":3}}");
        let metered = meter.finish();
        let counts = &metered.counts;
        assert_eq!(
            (counts.input, counts.output, counts.model.as_deref()),
            (7, 3, Some("gpt"))
        );
        assert!(metered.stated);
    }

    /// Catches: an answer cut before its final usage taken as complete (the 10 Anthropic
    /// streams dropped after `content_block_stop` recorded $0.0005 of $2.25 billed).
    #[test]
    fn a_stream_cut_before_its_usage_has_not_stated_it() {
        let end = STREAM.find("event: message_delta").unwrap();
        for cut in 0..end {
            let mut meter = Meter::new(Api::AnthropicMessages, true);
            meter.feed(&STREAM.as_bytes()[..cut]);
            assert!(!meter.finish().stated, "cut at {cut}");
        }
        let mut meter = Meter::new(Api::OpenaiChat, true);
        meter.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n");
        assert!(
            !meter.finish().stated,
            "a chat stream without a usage chunk"
        );
    }
}
