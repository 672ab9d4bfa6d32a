//! The OpenAPI 3.1 document served at `/v1/openapi.json`.

use serde_json::{json, Value};

/// The document.
pub fn document() -> Value {
    let error = json!({"$ref": "#/components/schemas/Error"});
    let errors = json!({
        "400": {"description": "invalid input; `error.field` names the field", "content": {"application/json": {"schema": error}}},
        "401": {"description": "missing or wrong bearer token", "content": {"application/json": {"schema": error}}},
        "404": {"description": "no such run", "content": {"application/json": {"schema": error}}}
    });
    let id = json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}}]);
    json!({
        "openapi": "3.1.0",
        "info": {"title": "forgepool dispatcher", "version": env!("CARGO_PKG_VERSION")},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/runs": {
                "post": {"summary": "Submit a run request", "requestBody": {"required": true, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RunRequest"}}}},
                         "parameters": [{"name": "Idempotency-Key", "in": "header", "required": false, "description": "1 to 255 visible ASCII characters; a repeat within 24 hours returns the first run instead of creating another", "schema": {"type": "string", "minLength": 1, "maxLength": 255}}],
                         "responses": {"201": {"description": "accepted: run id and warnings"}, "200": {"description": "a repeat of an Idempotency-Key seen in the last 24 hours: the first run, as it stands"}, "413": {"description": "request or brief too large (refused as soon as the size is known)", "content": {"application/json": {"schema": error.clone()}}}, "408": {"description": "the body did not arrive within 15 s", "content": {"application/json": {"schema": error.clone()}}}, "400": errors["400"], "401": errors["401"]}},
                "get": {"summary": "List runs, newest first",
                        "parameters": [
                            {"name": "state", "in": "query", "schema": {"type": "string"}},
                            {"name": "ticket", "in": "query", "schema": {"type": "string"}},
                            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
                            {"name": "cursor", "in": "query", "schema": {"type": "string"}}],
                        "responses": {"200": {"description": "a page of runs"}, "400": errors["400"], "401": errors["401"]}}
            },
            "/v1/runs/{id}": {"get": {"summary": "A run: state, history, rounds, cycles, result, report", "parameters": id, "responses": {"200": {"description": "the run"}, "400": errors["400"], "401": errors["401"], "404": errors["404"]}}},
            "/v1/runs/{id}/events": {"get": {"summary": "The run's events so far, then live (Server-Sent Events)", "parameters": [id[0].clone(), {"name": "Last-Event-ID", "in": "header", "required": false, "description": "continue after this event position", "schema": {"type": "string"}}], "responses": {"200": {"description": "text/event-stream"}, "404": errors["404"], "429": {"description": "the run already has 16 event streams open", "content": {"application/json": {"schema": error.clone()}}}}}},
            "/v1/runs/{id}/cancel": {"post": {"summary": "Cancel a run", "parameters": id, "responses": {"202": {"description": "stored first: `cancel: done` for a queued or paused run (cancelled now), `cancel: requested` for a running one (its worker stops it)"}, "409": {"description": "the run already ended"}, "404": errors["404"], "500": {"description": "the store failed; nothing was stored"}}}},
            "/v1/runs/{id}/resume": {"post": {"summary": "Resume a paused run from its latest checkpoint, with its original frozen job", "parameters": id, "responses": {"202": {"description": "queued again: {run_id, state, checkpoint}"}, "409": {"description": "the run is not paused (not_paused), or has no saved progress (no_checkpoint)"}, "503": {"description": "the broker is unavailable; the run stays paused"}}}},
            "/healthz": {"get": {"summary": "Liveness", "security": [], "responses": {"200": {"description": "alive"}}}},
            "/readyz": {"get": {"summary": "Readiness: store and broker reachable", "security": [], "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "security": [], "responses": {"200": {"description": "text exposition format"}}}}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["code", "message"],
                          "properties": {"code": {"type": "string"}, "message": {"type": "string"}, "field": {"type": "string"}}}}},
                "RunRequest": {"type": "object", "additionalProperties": false, "required": ["ticket", "skill", "brief", "repository"],
                    "properties": {
                        "ticket": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*-[0-9]+$"},
                        "skill": {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]{0,63}$"},
                        "step": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_]{0,63}$"},
                        "brief": {"type": "string", "maxLength": 262144},
                        "repository": {"type": "object", "additionalProperties": false, "required": ["url"], "properties": {"url": {"type": "string"}, "ref": {"type": "string"}}},
                        "commands": {"type": "array", "items": {"type": "object", "additionalProperties": false, "required": ["argv", "timeout"],
                                     "properties": {"argv": {"type": "array", "minItems": 1, "items": {"type": "string"}}, "timeout": {"type": "integer", "minimum": 1}}}},
                        "repair_attempts": {"type": "integer", "minimum": 0, "maximum": 3},
                        "agents": {"type": "object", "additionalProperties": false, "properties": {"implementer": {"type": "string"}, "reviewer": {"type": "string"}}},
                        "assurance": {"type": "object", "additionalProperties": false, "properties": {"review_agent": {"type": "string"}}},
                        "budget": {"type": "object", "additionalProperties": false, "required": ["max_cost_usd"], "properties": {"max_cost_usd": {"type": "number", "exclusiveMinimum": 0}}}
                    }}
            }
        }
    })
}
