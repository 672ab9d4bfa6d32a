//! Reading run requests from JSON (API, AMQP) and from TOML or JSON files (CLI).
//!
//! A parse error names the field's path.

use proto::RunRequest;

use crate::freeze::MAX_REQUEST_BYTES;
use crate::SubmitError;

/// Parses a JSON request body; errors name the field path where parsing failed.
pub fn from_json(body: &[u8]) -> Result<RunRequest, SubmitError> {
    check_size(body.len())?;
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let field = if path == "." {
            "body".to_string()
        } else {
            path
        };
        SubmitError::Parse {
            field,
            message: error.into_inner().to_string(),
        }
    })
}

/// Parses a request file: JSON when it starts with `{`, TOML otherwise.
pub fn from_file_text(text: &str) -> Result<RunRequest, SubmitError> {
    if text.trim_start().starts_with('{') {
        return from_json(text.as_bytes());
    }
    check_size(text.len())?;
    let deserializer = toml::Deserializer::new(text);
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let path = error.path().to_string();
        let field = if path == "." {
            "body".to_string()
        } else {
            path
        };
        let message = error.into_inner().message().to_string();
        SubmitError::Parse { field, message }
    })
}

fn check_size(size: usize) -> Result<(), SubmitError> {
    if size > MAX_REQUEST_BYTES {
        return Err(SubmitError::TooLarge {
            field: "body".into(),
            limit: MAX_REQUEST_BYTES,
            size,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_errors_name_the_field() {
        let error = from_json(
            br#"{"ticket": "A-1", "skill": "s", "brief": "b", "repository": {"url": 5}}"#,
        )
        .unwrap_err();
        assert_eq!(error.field(), Some("repository.url"), "{error}");
        let error = from_json(
            br#"{"ticket": "A-1", "skill": "s", "brief": "b", "repository": {"url": "u"}, "x": 1}"#,
        )
        .unwrap_err();
        assert!(error.to_string().contains("unknown field `x`"), "{error}");
        let error = from_json(b"{\"ticket\": \"A-1\"}").unwrap_err();
        assert!(
            error.to_string().contains("missing field `skill`"),
            "{error}"
        );
    }

    #[test]
    fn toml_files_parse() {
        let request = from_file_text(
            "ticket = \"SHOP-1\"\nskill = \"implement-task\"\nbrief = \"b\"\n[repository]\nurl = \"file:///r.git\"\nref = \"main\"\n[[commands]]\nargv = [\"make\"]\ntimeout = 60\n",
        )
        .unwrap();
        assert_eq!(request.repository.git_ref.as_deref(), Some("main"));
        assert_eq!(request.commands.len(), 1);
        let error = from_file_text("ticket = 5\n").unwrap_err();
        assert_eq!(error.field(), Some("ticket"), "{error}");
    }

    #[test]
    fn oversized_bodies_are_refused() {
        let body = vec![b' '; MAX_REQUEST_BYTES + 1];
        let error = from_json(&body).unwrap_err();
        assert!(matches!(error, SubmitError::TooLarge { .. }), "{error}");
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn any_body_is_a_request_or_an_error_that_names_something(body in proptest::collection::vec(any::<u8>(), 0..4096)) {
                if let Err(error) = from_json(&body) {
                    prop_assert!(!error.to_string().is_empty());
                }
            }

            #[test]
            fn any_file_text_is_a_request_or_an_error(text in "\\PC{0,400}") {
                let _ = from_file_text(&text);
            }

            #[test]
            fn requests_round_trip_through_json(
                ticket in "[A-Z]{1,6}-[0-9]{1,4}",
                brief in "\\PC{0,200}",
                repair in proptest::option::of(0i64..4),
                reference in proptest::option::of("[a-z]{1,10}"),
            ) {
                let request = proto::RunRequest { budget: None,
                    schema_version: None,
                    ticket,
                    skill: "implement-task".into(),
                    step: None,
                    brief,
                    repository: proto::RepositoryRef { url: "file:///srv/r.git".into(), git_ref: reference },
                    commands: vec![],
                    repair_attempts: repair,
                    agents: None,
                    assurance: None,
                };
                let body = serde_json::to_vec(&request).unwrap();
                prop_assert_eq!(from_json(&body).unwrap(), request);
            }
        }
    }
}
