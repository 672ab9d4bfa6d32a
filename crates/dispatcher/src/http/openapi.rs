//! The OpenAPI 3.1 document served at `/v1/openapi.json`, generated from the API's Rust types
//! (`proto::api`, `proto::RunRequest`, each deriving its schema) and its handlers (each
//! `#[utoipa::path]` beside the handler), so the document cannot drift from the code.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{events, follow_up, glance, health, runs};

/// The document's description: the rules a schema cannot state.
const DESCRIPTION: &str = "forgepool's dispatcher: submit coding-agent runs, follow their \
events, cancel and resume them.\n\nErrors are RFC 9457 problem details \
(`application/problem+json`) with a stable `code` and, where one field is at fault, `field`. \
`400` means a request breaks the shape this document gives it. `422` means it has that shape \
but names something this dispatcher does not have or allow: a skill without a SKILL.md for the \
ticket's project, an agent profile the agents file does not define, a repository URL whose \
scheme is not allowed (`FORGEPOOL_ALLOWED_URL_SCHEMES`) or that is not a git URL, a ref git \
would refuse, a brief of only white space, or a command whose program is empty. `413` means \
the body is over 1 MiB.\n\nWhen the dispatcher has a token (`FORGEPOOL_API_TOKEN`), every \
`/v1` request but this document needs `Authorization: Bearer TOKEN`.";

#[derive(OpenApi)]
#[openapi(
    info(title = "forgepool dispatcher", description = DESCRIPTION),
    paths(
        runs::submit,
        runs::list,
        runs::show,
        events::events,
        glance::timeline,
        glance::transcript,
        glance::pool,
        runs::cancel,
        runs::resume,
        follow_up::follow_up,
        health::healthz,
        health::ready,
        health::metrics,
    ),
    components(schemas(proto::Problem)),
    modifiers(&Bearer),
    security(("bearer" = [])),
    tags(
        (name = "runs", description = "runs and their events"),
        (name = "pool", description = "the pool at a glance"),
        (name = "service", description = "health, readiness and metrics (no token)"),
    )
)]
struct Api;

/// Adds the bearer scheme the `security` requirement names.
struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document, with this build's version.
pub fn document() -> serde_json::Value {
    let mut api = Api::openapi();
    api.info.version = env!("CARGO_PKG_VERSION").to_string();
    serde_json::to_value(&api).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: an operation, a status or a body missing from the generated document.
    #[test]
    fn every_route_status_and_body_is_described() {
        let document = document();
        let paths = &document["paths"];
        let expected: &[(&str, &str, &[&str])] = &[
            (
                "/v1/runs",
                "post",
                &[
                    "200", "201", "400", "401", "403", "408", "413", "415", "422", "500",
                ],
            ),
            ("/v1/runs", "get", &["200", "400", "401", "403", "500"]),
            (
                "/v1/runs/{id}",
                "get",
                &["200", "304", "400", "401", "403", "404", "500"],
            ),
            (
                "/v1/runs/{id}/events",
                "get",
                &["200", "400", "401", "403", "404", "429", "500"],
            ),
            (
                "/v1/runs/{id}/cancel",
                "post",
                &["202", "400", "401", "403", "404", "409", "415", "500"],
            ),
            (
                "/v1/runs/{id}/resume",
                "post",
                &[
                    "202", "400", "401", "403", "404", "409", "415", "500", "503",
                ],
            ),
            (
                "/v1/runs/{id}/timeline",
                "get",
                &["200", "400", "401", "403", "404", "500"],
            ),
            (
                "/v1/runs/{id}/stages/{n}/transcript",
                "get",
                &["200", "400", "401", "403", "404", "500"],
            ),
            ("/v1/pool", "get", &["200", "401", "403"]),
            ("/healthz", "get", &["200"]),
            ("/readyz", "get", &["200", "503"]),
            ("/metrics", "get", &["200"]),
        ];
        for (path, method, statuses) in expected {
            let responses = &paths[path][method]["responses"];
            let mut found: Vec<&str> = responses
                .as_object()
                .unwrap_or_else(|| panic!("{method} {path} is not described: {document}"))
                .keys()
                .map(String::as_str)
                .collect();
            found.sort_unstable();
            assert_eq!(&found, statuses, "{method} {path}");
            for (status, response) in responses.as_object().unwrap() {
                if status.starts_with('4') || status.starts_with('5') {
                    if *path == "/readyz" {
                        continue;
                    }
                    assert!(
                        response["content"]["application/problem+json"]["schema"].is_object(),
                        "{method} {path} {status} is not problem details: {response}"
                    );
                }
            }
        }
        let events = &paths["/v1/runs/{id}/events"]["get"]["responses"]["200"]["content"];
        assert!(events["text/event-stream"].is_object(), "{events}");
        let created = &paths["/v1/runs"]["post"]["responses"]["201"];
        assert!(created["headers"]["Location"].is_object(), "{created}");
        assert!(created["content"]["application/json"]["schema"].is_object());
        let request = &document["components"]["schemas"]["RunRequest"];
        assert_eq!(request["additionalProperties"], false, "{request}");
        assert_eq!(
            request["properties"]["ticket"]["pattern"],
            "^[A-Za-z][A-Za-z0-9_]*-[0-9]+$"
        );
        for schema in [
            "RunView",
            "RunList",
            "SubmitResponse",
            "CancelAnswer",
            "ResumeAnswer",
        ] {
            assert!(
                document["components"]["schemas"][schema].is_object(),
                "{schema} missing"
            );
        }
    }
}
