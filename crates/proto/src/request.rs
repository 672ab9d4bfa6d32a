//! The run request (SPEC 4): what a submitter sends to the dispatcher, before validation.
//!
//! Unknown fields are refused.

use serde::{Deserialize, Serialize};

/// A run request as submitted through the API, the CLI or the submission queue.
///
/// Unknown fields are refused. Optional numbers are kept as `i64` so that the dispatcher can
/// name the field and its range when a value is out of bounds, instead of a bare parse error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RunRequest {
    /// Set by AMQP producers; absent in API and CLI requests, which are always current.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1))]
    #[serde(deserialize_with = "integral::option")]
    pub schema_version: Option<u32>,
    /// The ticket key, `PROJECT-123`.
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[A-Za-z][A-Za-z0-9_]*-[0-9]+$", max_length = 128)
    )]
    pub ticket: String,
    /// The skill to run, resolved under the skills directory.
    #[cfg_attr(feature = "openapi", schema(pattern = r"^[a-z0-9][a-z0-9-]{0,63}$"))]
    pub skill: String,
    /// The workflow step that names the cycle-file folder; defaults from the skill name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = r"^[a-z0-9][a-z0-9_]{0,63}$"))]
    pub step: Option<String>,
    /// What the implementer must do.
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 262144))]
    pub brief: String,
    /// Where the source lives and which ref to start from.
    pub repository: RepositoryRef,
    /// Verification commands, run in order over the changed source.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub commands: Vec<VerifyCommand>,
    /// Repair rounds after the first implementation round, 0..=3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 3))]
    #[serde(deserialize_with = "integral::option")]
    pub repair_attempts: Option<i64>,
    /// Agent profile names for the implementer and the reviewer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agents: Option<AgentChoice>,
    /// The optional independent final review.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assurance: Option<Assurance>,
    /// The run's spending limit: `{"max_cost_usd": 5.0}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::Budget>,
}

/// The repository a run works on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RepositoryRef {
    /// A git URL the worker can clone from and push to, with a scheme the dispatcher allows
    /// (`FORGEPOOL_ALLOWED_URL_SCHEMES`); a URL it does not allow is refused with `422`.
    #[cfg_attr(feature = "openapi", schema(min_length = 1))]
    pub url: String,
    /// The ref to start from; the remote's default branch when absent.
    #[serde(rename = "ref", default, skip_serializing_if = "Option::is_none")]
    pub git_ref: Option<String>,
}

/// One verification command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct VerifyCommand {
    /// The program and its arguments; never run through a shell by forgepool.
    #[cfg_attr(feature = "openapi", schema(min_items = 1))]
    pub argv: Vec<String>,
    /// The command's time limit in seconds.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 86400))]
    #[serde(deserialize_with = "integral::value")]
    pub timeout: u64,
}

/// Agent profile names chosen by the submitter.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AgentChoice {
    /// Profile for the implement stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub implementer: Option<String>,
    /// Profile for the review stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reviewer: Option<String>,
}

/// The independent final review request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Assurance {
    /// Profile for the final review; absent means `not_requested`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub review_agent: Option<String>,
}

/// Integers as JSON Schema counts them: `600` and `600.0` are the same integer, so a request
/// a schema validator accepts is never refused by the parser for its number's spelling.
pub(crate) mod integral {
    use serde::de::{Deserializer, Error, Visitor};

    struct Integral;

    impl Visitor<'_> for Integral {
        type Value = i128;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an integer")
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<i128, E> {
            Ok(i128::from(v))
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<i128, E> {
            Ok(i128::from(v))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<i128, E> {
            // Beyond 2^63 an f64 has no fraction to lose, and no field here goes that far.
            if v.is_finite() && v.fract() == 0.0 && v.abs() < 9.2e18 {
                Ok(v as i128)
            } else {
                Err(E::custom(format!(
                    "invalid value: {v}, expected an integer"
                )))
            }
        }
    }

    fn read<'de, D: Deserializer<'de>, T: TryFrom<i128>>(d: D) -> Result<T, D::Error> {
        let n = d.deserialize_any(Integral)?;
        T::try_from(n).map_err(|_| D::Error::custom(format!("{n} is out of range")))
    }

    pub fn value<'de, D: Deserializer<'de>, T: TryFrom<i128>>(d: D) -> Result<T, D::Error> {
        read(d)
    }

    pub fn option<'de, D: Deserializer<'de>, T: TryFrom<i128>>(
        d: D,
    ) -> Result<Option<T>, D::Error> {
        struct Maybe<T>(std::marker::PhantomData<T>);
        impl<'de, T: TryFrom<i128>> Visitor<'de> for Maybe<T> {
            type Value = Option<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an integer or null")
            }
            fn visit_none<E: Error>(self) -> Result<Option<T>, E> {
                Ok(None)
            }
            fn visit_unit<E: Error>(self) -> Result<Option<T>, E> {
                Ok(None)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
                read(d).map(Some)
            }
        }
        d.deserialize_option(Maybe(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_example_round_trips() {
        let text = r#"{
          "ticket": "MYPROJECT-123", "skill": "implement-task", "step": "implement_task",
          "brief": "Reject negative quantities in reserve()",
          "repository": {"url": "file:///srv/git/shop.git", "ref": "main"},
          "commands": [{"argv": ["make", "check"], "timeout": 600}],
          "repair_attempts": 2,
          "agents": {"implementer": "claude", "reviewer": "claude"},
          "assurance": {"review_agent": "codex"}
        }"#;
        let request: RunRequest = serde_json::from_str(text).unwrap();
        assert_eq!(request.repository.git_ref.as_deref(), Some("main"));
        assert_eq!(request.commands[0].argv, ["make", "check"]);
        let again: RunRequest =
            serde_json::from_str(&serde_json::to_string(&request).unwrap()).unwrap();
        assert_eq!(again, request);
    }

    /// Catches: `600.0`, an integer to JSON Schema, refused as "expected u64".
    #[test]
    fn integral_numbers_are_integers_whatever_their_spelling() {
        let text = r#"{"ticket": "A-1", "skill": "s", "brief": "b", "repository": {"url": "u"},
                       "commands": [{"argv": ["x"], "timeout": 600.0}], "repair_attempts": 2.0,
                       "schema_version": null, "budget": {"max_tokens": 14029.0}}"#;
        let request: RunRequest = serde_json::from_str(text).unwrap();
        assert_eq!(request.commands[0].timeout, 600);
        assert_eq!(request.repair_attempts, Some(2));
        // schemathesis's ST202 in CI: `budget.max_tokens: 14029.0` refused.
        assert_eq!(request.budget.unwrap().max_tokens, Some(14029));
        assert!(serde_json::from_str::<crate::Budget>(r#"{"max_tokens": 1.5}"#).is_err());
        assert_eq!(request.schema_version, None);
        for bad in [
            r#""timeout": 1.5"#,
            r#""timeout": -1"#,
            r#""timeout": "600""#,
        ] {
            let text = format!(r#"{{"argv": ["x"], {bad}}}"#);
            assert!(
                serde_json::from_str::<VerifyCommand>(&text).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let text = r#"{"ticket": "A-1", "skill": "s", "brief": "b",
                       "repository": {"url": "u"}, "colour": "blue"}"#;
        let error = serde_json::from_str::<RunRequest>(text).unwrap_err();
        assert!(error.to_string().contains("colour"), "{error}");
    }
}
