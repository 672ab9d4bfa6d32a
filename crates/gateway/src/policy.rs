//! What crosses the gateway, by allowlist: the request headers each API needs (Anthropic's
//! betas only as the providers file lists them, an organization or project only as the
//! operator set it), the answer headers a CLI reads, and never the provider's key in an
//! answer: [`Redactor`] masks it in every byte passed back, however the answer's chunks cut it.

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::api::Api;
use crate::providers::Provider;

/// Request headers forwarded for every API: what the body is and what the client takes.
const REQUEST_HEADERS: [&str; 3] = ["content-type", "accept", "user-agent"];

/// Beta families that reach addresses a request names, or are priced apart from the price
/// table: a request naming one the providers file does not list is refused, not stripped.
const REFUSED_BETAS: [&str; 12] = [
    "mcp-",
    "web-fetch-",
    "web-search-",
    "files-api-",
    "code-execution-",
    "context-1m-",
    "fast-mode-",
    "extended-cache-ttl-",
    "computer-use-",
    "managed-agents-",
    "environments-",
    "skills-",
];

/// Request headers that choose the account a key acts for: refused from a stage.
const CHOSEN_BY_THE_OPERATOR: [&str; 3] = [
    "openai-organization",
    "openai-project",
    "x-goog-user-project",
];

/// Answer headers passed back: the body's type and length, and what a CLI reads to back off.
const ANSWER_HEADERS: [&str; 7] = [
    "content-type",
    "content-length",
    "retry-after",
    "request-id",
    "x-request-id",
    "x-should-retry",
    "openai-processing-ms",
];
/// Prefixes of answer headers passed back: the providers' rate-limit states.
const ANSWER_PREFIXES: [&str; 2] = ["anthropic-ratelimit-", "x-ratelimit-"];

/// Why a request's headers are refused.
#[derive(Debug, PartialEq)]
pub struct Refused(pub String);

/// The headers forwarded for a request of `provider`, before the key is added: the allowed
/// ones of `headers`, and the operator's organization and project.
pub fn request_headers(provider: &Provider, headers: &HeaderMap) -> Result<HeaderMap, Refused> {
    for name in CHOSEN_BY_THE_OPERATOR {
        if headers.contains_key(name) {
            return Err(Refused(format!(
                "a stage may not send {name}: the account the key acts for is the operator's choice (provider.organization, provider.project in the providers file)"
            )));
        }
    }
    let mut forwarded = HeaderMap::new();
    for name in REQUEST_HEADERS {
        for value in headers.get_all(name) {
            forwarded.append(HeaderName::from_static(name), value.clone());
        }
    }
    if provider.api == Api::AnthropicMessages {
        for value in headers.get_all("anthropic-version") {
            forwarded.append(HeaderName::from_static("anthropic-version"), value.clone());
        }
        let mut betas = Vec::new();
        for value in headers.get_all("anthropic-beta") {
            let text = value
                .to_str()
                .map_err(|_| Refused("the anthropic-beta header is not text".into()))?;
            for beta in text.split(',').map(str::trim).filter(|b| !b.is_empty()) {
                if provider.betas.iter().any(|allowed| allowed == beta) {
                    betas.push(beta);
                } else if REFUSED_BETAS.iter().any(|family| beta.starts_with(family)) {
                    return Err(Refused(format!(
                        "the beta feature {beta:?} reaches other addresses or is priced apart; the providers file does not allow it for {} (provider.betas)",
                        provider.name
                    )));
                }
                // Any other beta is left out: it does not reach the provider.
            }
        }
        if !betas.is_empty() {
            let joined = HeaderValue::from_str(&betas.join(","))
                .map_err(|_| Refused("the anthropic-beta header is not text".into()))?;
            forwarded.insert(HeaderName::from_static("anthropic-beta"), joined);
        }
    }
    for (name, value) in [
        (organization_header(provider.api), &provider.organization),
        (project_header(provider.api), &provider.project),
    ] {
        if let (Some(name), Some(value)) = (name, value) {
            let value = HeaderValue::from_str(value)
                .map_err(|_| Refused(format!("provider {}: {name} is not text", provider.name)))?;
            forwarded.insert(HeaderName::from_static(name), value);
        }
    }
    Ok(forwarded)
}

/// Where an API takes the account's organization.
fn organization_header(api: Api) -> Option<&'static str> {
    matches!(api, Api::OpenaiResponses | Api::OpenaiChat).then_some("openai-organization")
}

fn project_header(api: Api) -> Option<&'static str> {
    matches!(api, Api::OpenaiResponses | Api::OpenaiChat).then_some("openai-project")
}

/// Whether an answer header is passed back to the stage.
pub fn answer_header(name: &HeaderName) -> bool {
    let name = name.as_str();
    ANSWER_HEADERS.contains(&name) || ANSWER_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Masks every occurrence of a key in the bytes of an answer as they pass: a match is
/// replaced by as many `*` (so a `content-length` stays true), and the end of a chunk that
/// could begin a key is held back until the next chunk says whether it does.
#[derive(Debug)]
pub struct Redactor {
    key: Vec<u8>,
    held: Vec<u8>,
}

impl Redactor {
    /// A redactor of `key`; `None` for a key too short to mask safely.
    pub fn new(key: &str) -> Option<Redactor> {
        (key.len() >= 8).then(|| Redactor {
            key: key.as_bytes().to_vec(),
            held: Vec::new(),
        })
    }

    /// Whether `chunk` can pass as it is: nothing is held, it holds no key, and it ends with
    /// no beginning of one (the usual case: no copy on the way).
    pub fn passes(&self, chunk: &[u8]) -> bool {
        self.held.is_empty()
            && !chunk
                .windows(self.key.len())
                .any(|w| w == self.key.as_slice())
            && !(1..self.key.len()).any(|n| chunk.ends_with(&self.key[..n]))
    }

    /// The next bytes to pass on for `chunk`.
    pub fn feed(&mut self, chunk: &[u8]) -> Vec<u8> {
        let mut bytes = std::mem::take(&mut self.held);
        bytes.extend_from_slice(chunk);
        mask(&mut bytes, &self.key);
        // The longest end of the bytes that is a beginning of the key waits.
        let keep = (1..self.key.len().min(bytes.len() + 1))
            .rev()
            .find(|&n| bytes.ends_with(&self.key[..n]))
            .unwrap_or(0);
        self.held = bytes.split_off(bytes.len() - keep);
        bytes
    }

    /// What is held at the answer's end.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }

    /// Masks the key in a header value; `None` when it held none.
    pub fn header(&self, value: &HeaderValue) -> Option<HeaderValue> {
        let mut bytes = value.as_bytes().to_vec();
        if !mask(&mut bytes, &self.key) {
            return None;
        }
        HeaderValue::from_bytes(&bytes).ok()
    }
}

/// Replaces every occurrence of `key` in `bytes` with `*`s; whether there was one.
fn mask(bytes: &mut [u8], key: &[u8]) -> bool {
    let mut found = false;
    let mut at = 0;
    while at + key.len() <= bytes.len() {
        if bytes[at..].starts_with(key) {
            bytes[at..at + key.len()].fill(b'*');
            found = true;
            at += key.len();
        } else {
            at += 1;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sk-ant-real-KEY-0123456789";

    /// Catches: a key echoed by the provider passed to the stage when a chunk boundary cuts
    /// it (at any byte), or a stream's ordinary bytes held back.
    #[test]
    fn an_echoed_key_is_masked_however_the_chunks_cut_it() {
        let answer = format!("data: {{\"error\":\"bad key {KEY}\"}}\n\nx-api-key: Bearer {KEY}\n");
        for cut in 0..answer.len() {
            for second in (cut..answer.len()).step_by(5) {
                let mut redactor = Redactor::new(KEY).unwrap();
                let mut out = redactor.feed(&answer.as_bytes()[..cut]);
                out.extend(redactor.feed(&answer.as_bytes()[cut..second]));
                out.extend(redactor.feed(&answer.as_bytes()[second..]));
                out.extend(redactor.finish());
                let text = String::from_utf8(out).unwrap();
                assert!(!text.contains(KEY), "cut at {cut}, {second}: {text}");
                assert_eq!(text.len(), answer.len());
            }
        }
        let mut redactor = Redactor::new(KEY).unwrap();
        assert!(redactor.passes(b"data: {}\n\n"));
        assert!(!redactor.passes(format!("x{KEY}").as_bytes()));
        assert!(!redactor.passes(b"data: sk-ant"));
        assert_eq!(redactor.feed(b"data: {}\n\n"), b"data: {}\n\n");
        let value = HeaderValue::from_str(&format!("Bearer {KEY}")).unwrap();
        assert!(!redactor
            .header(&value)
            .unwrap()
            .to_str()
            .unwrap()
            .contains(KEY));
    }
}
