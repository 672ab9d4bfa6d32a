//! Problem details (RFC 9457): every error answer of the API, the framework's own included.
//!
//! `Failure` renders them, and a response layer (`problems_everywhere`) turns every other error
//! answer (the router's 404 and 405, an extractor's plain-text refusal) into one, keeping its
//! status and headers. `400` is a request that breaks its documented shape; `422` one that has it
//! but names what this dispatcher does not have or allow, which a schema cannot say (SPEC 12 asks
//! only for a 4xx).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use proto::{Problem, PROBLEM_CONTENT_TYPE};

use crate::SubmitError;

/// An API error: its status and the problem document answered.
#[derive(Debug)]
pub struct Failure(pub(super) StatusCode, Box<Problem>);

impl Failure {
    pub(super) fn new(
        status: StatusCode,
        code: &str,
        detail: impl Into<String>,
        field: Option<&str>,
    ) -> Failure {
        let title = status.canonical_reason().unwrap_or("Error");
        Failure(
            status,
            Box::new(Problem::new(status.as_u16(), title, code, detail, field)),
        )
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let unread = matches!(
            self.0,
            StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT
        );
        let body = serde_json::to_vec(&self.1).unwrap_or_default();
        let mut response =
            (self.0, [(header::CONTENT_TYPE, PROBLEM_CONTENT_TYPE)], body).into_response();
        if unread {
            // The body was not read to its end: the connection cannot carry another request,
            // and the client must not try.
            response.headers_mut().insert(
                header::CONNECTION,
                header::HeaderValue::from_static("close"),
            );
        }
        if self.0 == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// The code of an error answer that was not made by a handler (the router's 404 and 405, an
/// extractor's refusal), from its status.
fn framework_code(status: StatusCode) -> &'static str {
    match status {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
        status if status.is_server_error() => "internal",
        _ => "error",
    }
}

/// The most of a framework error's own text kept as the problem's `detail`.
const FRAMEWORK_DETAIL_BYTES: usize = 1024;

/// Turns every error answer that is not JSON (the router's 404 and 405, an extractor's
/// plain-text refusal) into problem details, keeping its status and headers
/// (`Allow` on a 405) and its text as the detail.
pub(super) async fn problems_everywhere(response: Response) -> Response {
    let status = response.status();
    // A handler's own JSON answer stands: problem details, or a documented body such as
    // `/readyz`'s 503.
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| {
            v.as_bytes() == PROBLEM_CONTENT_TYPE.as_bytes() || v.as_bytes() == b"application/json"
        });
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, FRAMEWORK_DETAIL_BYTES)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let detail = match status {
        StatusCode::NOT_FOUND => "no such route; the API is described at /v1/openapi.json".into(),
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = parts
                .headers
                .get(header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            format!("this route does not take that method; it takes: {allowed}")
        }
        _ if text.is_empty() => status.canonical_reason().unwrap_or("error").to_string(),
        _ => text,
    };
    let mut answer = Failure::new(status, framework_code(status), detail, None).into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            answer.headers_mut().insert(name.clone(), value.clone());
        }
    }
    answer
}

impl From<SubmitError> for Failure {
    fn from(error: SubmitError) -> Failure {
        // 400: the request breaks its documented shape (the OpenAPI schema says the same);
        // 422: it has the shape, but names what this dispatcher does not have or allow (a
        // skill, a profile, a URL scheme) or a value only the rules below the schema refuse;
        // 413: the body itself is over its limit.
        let status = match &error {
            SubmitError::TooLarge { field, .. } if field == "body" => StatusCode::PAYLOAD_TOO_LARGE,
            SubmitError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            SubmitError::UnknownSkill { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            SubmitError::Invalid { field, .. } if semantic(field) => {
                StatusCode::UNPROCESSABLE_ENTITY
            }
            _ => StatusCode::BAD_REQUEST,
        };
        Failure::new(status, error.code(), error.to_string(), error.field())
    }
}

/// Whether a refusal of `field` is one the request's schema cannot state: the field has the
/// documented shape, and the dispatcher's own skills, profiles or rules refuse its value.
fn semantic(field: &str) -> bool {
    matches!(
        field,
        "agents.implementer"
            | "agents.reviewer"
            | "assurance.review_agent"
            | "repository.url"
            | "repository.ref"
            | "brief"
            | "Idempotency-Key"
    ) || (field.starts_with("commands[") && field.ends_with("].argv"))
}

/// A failure of the service's own (its store, mostly): the cause goes to the log, the caller
/// gets a sentence that shows nothing of the store (a server's refusal can name its users).
/// A whole-number query parameter `field` within `range`, `default` when absent; a `400`
/// naming it otherwise.
pub(super) fn query_number(
    text: Option<&str>,
    field: &str,
    range: std::ops::RangeInclusive<u32>,
    default: u32,
) -> Result<u32, Failure> {
    let Some(text) = text else {
        return Ok(default);
    };
    text.parse::<u32>()
        .ok()
        .filter(|n| range.contains(n))
        .ok_or_else(|| {
            Failure::new(
                StatusCode::BAD_REQUEST,
                "invalid_field",
                format!(
                    "{field}: must be {}..={}, got {text:?}",
                    range.start(),
                    range.end()
                ),
                Some(field),
            )
        })
}

pub(super) fn internal(error: impl std::fmt::Display) -> Failure {
    tracing::error!(%error, "an API request failed");
    Failure::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "the dispatcher could not answer (its run store failed); try again, and see the dispatcher's log for the cause",
        None,
    )
}

pub(super) async fn unknown_route() -> Failure {
    Failure::new(
        StatusCode::NOT_FOUND,
        "not_found",
        "no such route; the API is described at /v1/openapi.json",
        None,
    )
}
