//! What a web page must not make a browser do to the dispatcher (SPEC 15).
//!
//! - A request with a body must say `Content-Type: application/json`. A page can send a
//!   cross-site `text/plain` or form POST without asking; a JSON one needs a CORS preflight,
//!   which the dispatcher never grants.
//! - A dispatcher without an API token answers only requests addressed to a loopback name,
//!   from its own origin: a `Host` that is not `127.0.0.1`, `[::1]` or `localhost` (DNS
//!   rebinding: a page's own name resolved to the dispatcher) and a cross-site `Origin` or
//!   `Sec-Fetch-Site` are refused, on every route (cancel and resume included) but the
//!   liveness and readiness probes, which read nothing. With a token
//!   a page cannot add it to a forged request, so these checks are left to the token.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::problem::Failure;
use crate::dispatcher::Dispatcher;

/// Refuses what [`refusal`] refuses, before the route sees the request.
pub(super) async fn guard(
    State(dispatcher): State<Arc<Dispatcher>>,
    request: Request,
    next: Next,
) -> Response {
    // A probe of liveness or readiness reads nothing and changes nothing; an orchestrator
    // sends it to the pod's address.
    let probe = matches!(request.uri().path(), "/healthz" | "/readyz")
        // A tracker's webhook comes from the tracker's address under the public name, and is
        // signed: its signature stands for the token (SPEC 17).
        || request.uri().path().starts_with("/v1/trackers/");
    let tokenless = dispatcher.api_token.is_none() && !probe;
    match refusal(request.method(), request.headers(), tokenless) {
        Some(failure) => failure.into_response(),
        None => next.run(request).await,
    }
}

/// Why a request is refused, if it is.
fn refusal(method: &Method, headers: &HeaderMap, tokenless: bool) -> Option<Failure> {
    let text = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let has_body = text(header::CONTENT_LENGTH).is_some_and(|length| length.trim() != "0")
        || headers.contains_key(header::TRANSFER_ENCODING);
    let json = text(header::CONTENT_TYPE).is_some_and(|value| {
        value
            .split(';')
            .next()
            .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
    });
    if has_body && *method != Method::GET && !json {
        return Some(Failure::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "a request body must be JSON, sent with `Content-Type: application/json`",
            None,
        ));
    }
    if !tokenless {
        return None;
    }
    let forbidden = |why: String| {
        Some(Failure::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("{why}; this dispatcher has no API token (FORGEPOOL_API_TOKEN), so it answers only requests to a loopback name from its own pages"),
            None,
        ))
    };
    let host = text(header::HOST).unwrap_or_default();
    if !host.is_empty() && !loopback(host) {
        return forbidden(format!("the request is addressed to {host:?}"));
    }
    if let Some(origin) = text(header::ORIGIN) {
        let same = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|origin_host| origin_host.eq_ignore_ascii_case(host));
        if !same {
            return forbidden(format!("the request comes from the page of {origin:?}"));
        }
    }
    if let Some(site) = text(header::HeaderName::from_static("sec-fetch-site")) {
        if site != "same-origin" && site != "none" {
            return forbidden(format!("the browser says the request is {site}"));
        }
    }
    None
}

/// Whether a `Host` value (a name or address, with an optional port) names this machine's
/// loopback interface.
fn loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                name
            } else {
                host
            }
        }),
    };
    match name.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => name.eq_ignore_ascii_case("localhost"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    /// Catches: a cross-site `text/plain` POST that a page sends without a preflight, a
    /// rebound name reaching a tokenless dispatcher, a cross-site page driving it, and a
    /// refusal of the dispatcher's own pages, its CLI or a token-holding client.
    #[test]
    fn only_json_bodies_and_only_local_same_origin_requests_without_a_token() {
        let post = Method::POST;
        let plain = headers(&[
            ("host", "127.0.0.1:8080"),
            ("content-type", "text/plain"),
            ("content-length", "12"),
        ]);
        for tokenless in [true, false] {
            let refused = refusal(&post, &plain, tokenless).expect("text/plain refused");
            assert_eq!(refused.0, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        }
        let json = headers(&[
            ("host", "127.0.0.1:8080"),
            ("content-type", "application/json; charset=utf-8"),
            ("content-length", "12"),
        ]);
        assert!(refusal(&post, &json, true).is_none());
        let empty_cancel = headers(&[("host", "localhost:8080"), ("content-length", "0")]);
        assert!(refusal(&post, &empty_cancel, true).is_none());

        for (pairs, allowed) in [
            (vec![("host", "127.0.0.1:8080")], true),
            (vec![("host", "[::1]:8080")], true),
            (vec![("host", "localhost")], true),
            (
                vec![
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                ],
                true,
            ),
            (
                vec![
                    ("host", "127.0.0.1:8080"),
                    ("sec-fetch-site", "same-origin"),
                ],
                true,
            ),
            (
                vec![("host", "127.0.0.1:8080"), ("sec-fetch-site", "none")],
                true,
            ),
            (vec![("host", "attacker.example:8080")], false),
            (vec![("host", "127.0.0.1.nip.io:8080")], false),
            (vec![("host", "10.0.0.5:8080")], false),
            (
                vec![
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://attacker.example"),
                ],
                false,
            ),
            (vec![("host", "127.0.0.1:8080"), ("origin", "null")], false),
            (
                vec![("host", "127.0.0.1:8080"), ("sec-fetch-site", "cross-site")],
                false,
            ),
            (
                vec![("host", "127.0.0.1:8080"), ("sec-fetch-site", "same-site")],
                false,
            ),
        ] {
            let map = headers(&pairs);
            let refused = refusal(&Method::GET, &map, true);
            assert_eq!(refused.is_none(), allowed, "{pairs:?}");
            if let Some(refused) = refused {
                assert_eq!(refused.0, StatusCode::FORBIDDEN);
            }
            assert!(
                refusal(&Method::GET, &map, false).is_none(),
                "with a token: {pairs:?}"
            );
        }
    }
}
