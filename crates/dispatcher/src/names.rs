//! Name rules (SPEC 2): tickets, projects, skills and steps, checked before anything is resolved.
//!
//! The rules are written by hand: no regex crate.

use crate::SubmitError;

/// Checks a ticket key against `^[A-Za-z][A-Za-z0-9_]*-[0-9]+$` and returns its project key.
pub fn project_of(ticket: &str) -> Result<String, SubmitError> {
    let invalid = || {
        SubmitError::invalid(
            "ticket",
            "must match ^[A-Za-z][A-Za-z0-9_]*-[0-9]+$, like MYPROJECT-123",
            ticket,
        )
    };
    proto::names::project_of(ticket).ok_or_else(invalid)
}

/// Checks a skill name against `^[a-z0-9][a-z0-9-]{0,63}$`.
pub fn check_skill(skill: &str) -> Result<(), SubmitError> {
    if proto::names::is_skill(skill) {
        Ok(())
    } else {
        Err(SubmitError::invalid(
            "skill",
            "must match ^[a-z0-9][a-z0-9-]{0,63}$, like implement-task",
            skill,
        ))
    }
}

/// Checks a step name against `^[a-z0-9][a-z0-9_]{0,63}$`.
pub fn check_step(step: &str) -> Result<(), SubmitError> {
    if proto::names::is_step(step) {
        Ok(())
    } else {
        Err(SubmitError::invalid(
            "step",
            "must match ^[a-z0-9][a-z0-9_]{0,63}$, like implement_task",
            step,
        ))
    }
}

/// The default step name of a skill: its name with `-` replaced by `_`.
pub fn default_step(skill: &str) -> String {
    skill.replace('-', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets() {
        let cases = [
            ("MYPROJECT-123", Some("myproject")),
            ("my_proj2-7", Some("my_proj2")),
            ("A-1", Some("a")),
            ("a-b-12", None),
            ("1AB-12", None),
            ("_AB-12", None),
            ("AB-", None),
            ("AB-12x", None),
            ("AB12", None),
            ("-12", None),
            ("AB-+12", None),
            ("../AB-12", None),
            ("ÄB-12", None),
            ("", None),
        ];
        for (ticket, expected) in cases {
            let got = project_of(ticket).ok();
            assert_eq!(got.as_deref(), expected, "ticket {ticket:?}");
        }
    }

    #[test]
    fn ticket_errors_name_the_field_and_rule() {
        let error = project_of("nope").unwrap_err();
        assert_eq!(error.field(), Some("ticket"));
        assert!(
            error.to_string().contains("^[A-Za-z][A-Za-z0-9_]*-[0-9]+$"),
            "{error}"
        );
    }

    #[test]
    fn skills() {
        let long = "a".repeat(64);
        let too_long = "a".repeat(65);
        let cases = [
            ("implement-task", true),
            ("0day", true),
            (long.as_str(), true),
            (too_long.as_str(), false),
            ("-lead", false),
            ("Upper", false),
            ("under_score", false),
            ("../etc", false),
            ("a/b", false),
            ("", false),
        ];
        for (skill, ok) in cases {
            assert_eq!(check_skill(skill).is_ok(), ok, "skill {skill:?}");
        }
    }

    #[test]
    fn steps() {
        let cases = [
            ("implement_task", true),
            ("local_review", true),
            ("implement-task", false),
            ("_x", false),
            ("X", false),
            ("", false),
        ];
        for (step, ok) in cases {
            assert_eq!(check_step(step).is_ok(), ok, "step {step:?}");
        }
        assert_eq!(default_step("implement-task"), "implement_task");
    }
}
