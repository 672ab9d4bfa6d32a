//! The web view of the pool (SPEC 12): `/` (the runs) and `/runs/{id}` (one run), one page
//! of HTML with its script and style built into the binary. Nothing is fetched from anywhere
//! else, and nothing runs at build time: the script is plain JavaScript, written for the
//! browsers of the last few years, with no framework.
//!
//! The pages hold no data: the script reads the API with the token the user gives it (kept
//! in the tab's `sessionStorage`, sent as a bearer header, never in a URL). Every answer is
//! sent with a Content-Security-Policy that allows only this origin's script, style and
//! connections, and no image, frame, form or plugin: what an agent wrote is put on the page
//! as text, and were a bug ever to let markup through, the browser would still refuse to run
//! or load it.
//!
//! The page, its script (about 800 lines of plain JavaScript) and its style are three files in
//! `crates/dispatcher/assets/`, built in with `include_str!` and addressed by their hash, so they
//! are cached for good. No framework (htmx, Preact, React): it would add a dependency to keep
//! current, a CDN or a vendored bundle, and for React a Node.js build, none of it needed for two
//! pages that read a JSON API. The Markdown renderer is twenty lines that only ever make text
//! nodes: a general-purpose renderer plus a sanitizer would be more code to trust with agent
//! text. The event stream is read with `fetch`, not `EventSource`, which cannot send the token as
//! a header.

use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use sha2::Digest;

const SHELL: &str = include_str!("../../assets/index.html");
const SCRIPT: &str = include_str!("../../assets/view.js");
const STYLE: &str = include_str!("../../assets/view.css");

/// What the pages may do: this origin's script, style and API, nothing else (no image but
/// the inline blank icon).
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
style-src 'self'; connect-src 'self'; img-src data:; base-uri 'none'; \
form-action 'self'; frame-ancestors 'none'";

/// The asset's version in its address: its content's hash, so it can be cached for good.
fn version(content: &str) -> String {
    hex::encode(&sha2::Sha256::digest(content.as_bytes())[..8])
}

/// The page, naming this build's assets.
static PAGE: LazyLock<String> = LazyLock::new(|| {
    SHELL
        .replace(
            "{script}",
            &format!("/assets/view.js?v={}", version(SCRIPT)),
        )
        .replace("{style}", &format!("/assets/view.css?v={}", version(STYLE)))
});

/// The routes of the web view. They need no token: they hold no data.
pub(super) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(page))
        .route("/runs/{id}", get(page))
        .route("/assets/{name}", get(asset))
}

fn guarded(content_type: &'static str, cache: &'static str, body: String) -> Response {
    let headers: [(HeaderName, HeaderValue); 5] = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (header::CACHE_CONTROL, HeaderValue::from_static(cache)),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
    ];
    (headers, body).into_response()
}

async fn page() -> Response {
    guarded("text/html; charset=utf-8", "no-cache", PAGE.clone())
}

async fn asset(Path(name): Path<String>) -> Response {
    let immutable = "public, max-age=31536000, immutable";
    match name.as_str() {
        "view.js" => guarded(
            "text/javascript; charset=utf-8",
            immutable,
            SCRIPT.to_string(),
        ),
        "view.css" => guarded("text/css; charset=utf-8", immutable, STYLE.to_string()),
        _ => super::problem::Failure::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no asset {name:?}"),
            None,
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a page that names an asset the server does not serve (a stale address after
    /// the script changed), and a page without the policy that keeps agent text inert.
    #[tokio::test]
    async fn the_page_names_its_assets_and_carries_the_policy() {
        assert!(PAGE.contains(&format!("/assets/view.js?v={}", version(SCRIPT))));
        assert!(PAGE.contains(&format!("/assets/view.css?v={}", version(STYLE))));
        assert!(!PAGE.contains("{script}") && !PAGE.contains("{style}"));
        let response = page().await;
        let policy = response.headers()[header::CONTENT_SECURITY_POLICY]
            .to_str()
            .unwrap();
        assert!(policy.contains("script-src 'self'") && policy.contains("img-src data:;"));
        assert!(!policy.contains("unsafe-inline"), "{policy}");
        let missing = asset(Path("other.js".into())).await;
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    }
}
