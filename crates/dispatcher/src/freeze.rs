//! Validation and freezing: a run request becomes a [`Job`] with every file and setting resolved.
//!
//! This is the only place where skills, agent profiles and the compatibility environment
//! variables are read for a run. What it returns is final: later changes never reach the job.
//!
//! `Freezer::freeze(RunRequest) -> Frozen { job, warnings }`; a `SubmitError` names the field at
//! fault.

use std::path::{Path, PathBuf};

use proto::{Job, ReviewConfig, RunRequest, SCHEMA_VERSION};
use uuid::Uuid;

use crate::agents::AgentBook;
use crate::names;
use crate::skills::{self, DEFAULT_REVIEW_TIMEOUT_SECONDS};
use crate::SubmitError;

/// The largest brief accepted: 256 KiB.
pub const MAX_BRIEF_BYTES: usize = 256 * 1024;
/// The largest request body accepted: 1 MiB.
pub const MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// The largest repair budget.
pub const MAX_REPAIR_ATTEMPTS: i64 = 3;
/// The repair budget when neither the request nor `FORGE_REPAIR_ATTEMPTS` sets one.
pub const DEFAULT_REPAIR_ATTEMPTS: u32 = 2;
/// The longest verification command timeout: one day.
pub const MAX_COMMAND_TIMEOUT_SECONDS: u64 = 86_400;

/// Environment variable: the default `max_retries` for skills whose `review.md` sets none.
pub const ENV_AUTO_REVIEW_MAX_RETRIES: &str = "AUTO_REVIEW_MAX_RETRIES";
/// Environment variable: the default repair budget.
pub const ENV_FORGE_REPAIR_ATTEMPTS: &str = "FORGE_REPAIR_ATTEMPTS";

/// What the freezer reads: the skills directory, the agent profiles, and the environment.
#[derive(Debug)]
pub struct Freezer {
    skills_dir: PathBuf,
    agents: AgentBook,
    env: Vec<(String, String)>,
    /// The repository URL schemes accepted (`FORGEPOOL_ALLOWED_URL_SCHEMES`).
    allowed_schemes: Vec<String>,
}

/// A frozen job and the warnings to show its submitter.
#[derive(Debug, Clone)]
pub struct Frozen {
    /// The job, ready to store and publish.
    pub job: Job,
    /// Warnings, also stored in `job.warnings`.
    pub warnings: Vec<String>,
}

impl Freezer {
    /// A freezer over a skills directory and agents; `env` is the compatibility environment
    /// (`AUTO_REVIEW_MAX_RETRIES`, `FORGE_REPAIR_ATTEMPTS`), read at submission.
    pub fn new(
        skills_dir: impl Into<PathBuf>,
        agents: AgentBook,
        env: Vec<(String, String)>,
    ) -> Freezer {
        Freezer {
            skills_dir: skills_dir.into(),
            agents,
            env,
            allowed_schemes: proto::names::default_allowed_schemes(),
        }
    }

    /// The same freezer accepting only repository URLs of `schemes`.
    pub fn with_allowed_schemes(mut self, schemes: Vec<String>) -> Freezer {
        self.allowed_schemes = schemes;
        self
    }

    /// A freezer that reads the compatibility variables from the process environment.
    pub fn from_process_env(skills_dir: impl Into<PathBuf>, agents: AgentBook) -> Freezer {
        let env = [ENV_AUTO_REVIEW_MAX_RETRIES, ENV_FORGE_REPAIR_ATTEMPTS]
            .into_iter()
            .filter_map(|name| {
                std::env::var(name)
                    .ok()
                    .map(|value| (name.to_string(), value))
            })
            .collect();
        Freezer::new(skills_dir, agents, env)
    }

    /// The skills directory.
    pub fn skills_dir(&self) -> &Path {
        &self.skills_dir
    }

    /// Validates a request and freezes it into a job with a new run id.
    pub fn freeze(&self, request: RunRequest) -> Result<Frozen, SubmitError> {
        let digest = request_digest(&request);
        let mut warnings = Vec::new();
        if let Some(version) = request.schema_version {
            if version != SCHEMA_VERSION {
                return Err(SubmitError::invalid(
                    "schema_version",
                    &format!("must be {SCHEMA_VERSION}"),
                    &version.to_string(),
                ));
            }
        }
        let project = names::project_of(&request.ticket)?;
        names::check_skill(&request.skill)?;
        let step = request
            .step
            .clone()
            .unwrap_or_else(|| names::default_step(&request.skill));
        names::check_step(&step)?;
        check_brief(&request.brief)?;
        check_repository(&request.repository, &self.allowed_schemes)?;
        check_commands(&request.commands)?;
        let repair_budget = self.repair_budget(request.repair_attempts, &mut warnings)?;
        if let Some(budget) = &request.budget {
            budget.check().map_err(|message| {
                let field = ["budget.max_cost_usd", "budget.max_tokens"]
                    .into_iter()
                    .find(|field| message.starts_with(field))
                    .unwrap_or("budget");
                SubmitError::Invalid {
                    field: field.into(),
                    message: message.trim_start_matches(field).trim_start().to_string(),
                }
            })?;
        }

        let skill_md = skills::resolve(&self.skills_dir, &project, &request.skill, "SKILL.md")?
            .ok_or_else(|| SubmitError::UnknownSkill {
                skill: request.skill.clone(),
                project: project.clone(),
            })?;
        let review = self.review_config(&project, &request.skill, &mut warnings)?;

        let choice = request.agents.clone().unwrap_or_default();
        let implementer = self.profile(
            "agents.implementer",
            choice.implementer.as_deref(),
            "implementer",
        )?;
        let reviewer = match review {
            Some(_) => {
                Some(self.profile("agents.reviewer", choice.reviewer.as_deref(), "reviewer")?)
            }
            None => None,
        };
        let final_reviewer = match request
            .assurance
            .as_ref()
            .and_then(|a| a.review_agent.as_deref())
        {
            Some(name) => {
                Some(self.profile("assurance.review_agent", Some(name), "final reviewer")?)
            }
            None => None,
        };

        let job = Job {
            budget: request.budget.clone(),
            follow_up: None,
            schema_version: SCHEMA_VERSION,
            run_id: Uuid::new_v4(),
            ticket: request.ticket,
            project,
            skill: request.skill,
            step,
            brief: request.brief,
            repository: request.repository,
            commands: request.commands,
            skill_md: skill_md.text,
            review,
            repair_budget,
            implementer,
            reviewer,
            final_reviewer,
            warnings: warnings.clone(),
            submitted_at: proto::timestamp_now(),
            resume: None,
            publication: None,
            request_digest: Some(digest),
        };
        Ok(Frozen { job, warnings })
    }

    fn env(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn repair_budget(
        &self,
        requested: Option<i64>,
        warnings: &mut Vec<String>,
    ) -> Result<u32, SubmitError> {
        if let Some(n) = requested {
            if !(0..=MAX_REPAIR_ATTEMPTS).contains(&n) {
                return Err(SubmitError::invalid(
                    "repair_attempts",
                    "must be an integer from 0 to 3",
                    &n.to_string(),
                ));
            }
            return Ok(n as u32);
        }
        if let Some(raw) = self.env(ENV_FORGE_REPAIR_ATTEMPTS) {
            match raw.trim().parse::<i64>() {
                Ok(n) if (0..=MAX_REPAIR_ATTEMPTS).contains(&n) => return Ok(n as u32),
                _ => warnings.push(format!(
                    "{ENV_FORGE_REPAIR_ATTEMPTS} must be an integer from 0 to 3, got {raw:?}; ignored, the default {DEFAULT_REPAIR_ATTEMPTS} is used"
                )),
            }
        }
        Ok(DEFAULT_REPAIR_ATTEMPTS)
    }

    fn review_config(
        &self,
        project: &str,
        skill: &str,
        warnings: &mut Vec<String>,
    ) -> Result<Option<ReviewConfig>, SubmitError> {
        let Some(file) = skills::resolve(&self.skills_dir, project, skill, "review.md")? else {
            return Ok(None);
        };
        let (review, file_warnings) = skills::parse_review(&file.text, &file.relative);
        warnings.extend(file_warnings);
        let max_cycles = skills::resolve_max_retries(
            review.max_retries,
            self.env(ENV_AUTO_REVIEW_MAX_RETRIES),
            warnings,
        );
        if max_cycles == 0 {
            return Ok(None);
        }
        Ok(Some(ReviewConfig {
            source: file.relative,
            instructions: review.body,
            max_cycles,
            block_on_failure: review.block_on_failure.unwrap_or(false),
            timeout_seconds: review
                .timeout_seconds
                .unwrap_or(DEFAULT_REVIEW_TIMEOUT_SECONDS),
        }))
    }

    fn profile(
        &self,
        field: &'static str,
        requested: Option<&str>,
        role: &str,
    ) -> Result<proto::AgentProfile, SubmitError> {
        let default_role = if role == "final reviewer" {
            "reviewer"
        } else {
            role
        };
        let name = requested.or_else(|| self.agents.default_for(default_role)).ok_or_else(|| SubmitError::Invalid {
            field: field.to_string(),
            message: format!(
                "no {role} profile was chosen and the agents file has no [defaults] {default_role}; name one of: {}",
                self.agents.names().join(", ")
            ),
        })?;
        self.agents
            .get(name)
            .cloned()
            .ok_or_else(|| SubmitError::Invalid {
                field: field.to_string(),
                message: format!(
                    "unknown agent profile `{name}`; the agents file defines: {}",
                    self.agents.names().join(", ")
                ),
            })
    }
}

fn check_brief(brief: &str) -> Result<(), SubmitError> {
    if brief.trim().is_empty() {
        return Err(SubmitError::Invalid {
            field: "brief".into(),
            message: "must not be empty".into(),
        });
    }
    if brief.len() > MAX_BRIEF_BYTES {
        return Err(SubmitError::TooLarge {
            field: "brief".into(),
            limit: MAX_BRIEF_BYTES,
            size: brief.len(),
        });
    }
    Ok(())
}

fn check_repository(
    repository: &proto::RepositoryRef,
    allowed_schemes: &[String],
) -> Result<(), SubmitError> {
    let url = repository.url.as_str();
    let unsafe_text =
        |s: &str| s.starts_with('-') || s.chars().any(|c| c.is_control() || c.is_whitespace());
    if let Err(rule) = proto::names::check_url(url, allowed_schemes) {
        let shown = proto::names::shown_url(url);
        return Err(SubmitError::invalid("repository.url", &rule, &shown));
    }
    if let Some(reference) = &repository.git_ref {
        let forbidden = ["..", "~", "^", ":", "?", "*", "[", "\\", "@{", "//"];
        let bad = reference.is_empty()
            || unsafe_text(reference)
            || reference.starts_with('/')
            || reference.ends_with('/')
            || reference.ends_with(".lock")
            || forbidden.iter().any(|f| reference.contains(f));
        if bad {
            return Err(SubmitError::invalid(
                "repository.ref",
                "must be a branch, tag or commit name (git check-ref-format rules, no leading '-')",
                reference,
            ));
        }
    }
    Ok(())
}

fn check_commands(commands: &[proto::VerifyCommand]) -> Result<(), SubmitError> {
    for (i, command) in commands.iter().enumerate() {
        if command.argv.is_empty() || command.argv[0].is_empty() {
            return Err(SubmitError::Invalid {
                field: format!("commands[{i}].argv"),
                message: "must be a non-empty list whose first item is the program".into(),
            });
        }
        if command.argv.iter().any(|a| a.contains('\0')) {
            return Err(SubmitError::Invalid {
                field: format!("commands[{i}].argv"),
                message: "must not contain NUL bytes".into(),
            });
        }
        if command.timeout == 0 || command.timeout > MAX_COMMAND_TIMEOUT_SECONDS {
            return Err(SubmitError::Invalid {
                field: format!("commands[{i}].timeout"),
                message: format!(
                    "must be a number of seconds from 1 to {MAX_COMMAND_TIMEOUT_SECONDS}, got {}",
                    command.timeout
                ),
            });
        }
    }
    Ok(())
}

/// The SHA-256 (hex) of a request's canonical JSON: its fields in their declared order, so
/// the same request gives the same digest however its text was laid out.
pub fn request_digest(request: &RunRequest) -> String {
    use sha2::Digest;
    let canonical = serde_json::to_vec(request).unwrap_or_default();
    hex::encode(sha2::Sha256::digest(&canonical))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixture {
        _dir: tempfile::TempDir,
        skills: PathBuf,
    }

    fn fixture(review: Option<&str>) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let skills = dir.path().join("skills");
        std::fs::create_dir_all(skills.join("default/implement-task")).unwrap();
        std::fs::write(
            skills.join("default/implement-task/SKILL.md"),
            "# Implement",
        )
        .unwrap();
        if let Some(text) = review {
            std::fs::write(skills.join("default/implement-task/review.md"), text).unwrap();
        }
        Fixture { _dir: dir, skills }
    }

    fn book() -> AgentBook {
        AgentBook::parse(
            "[agents.impl]\nimage = \"i\"\n[agents.rev]\nimage = \"r\"\n[defaults]\nimplementer = \"impl\"\nreviewer = \"rev\"\n",
            Path::new("agents.toml"),
        )
        .unwrap()
    }

    fn request() -> RunRequest {
        serde_json::from_str(
            r#"{"ticket": "SHOP-1", "skill": "implement-task", "brief": "Reject negatives",
                "repository": {"url": "file:///srv/shop.git"}}"#,
        )
        .unwrap()
    }

    #[test]
    fn freezes_review_and_defaults() {
        let f = fixture(Some(
            "---\nmax_retries: 4\nblock_on_failure: true\n---\nCheck it",
        ));
        let frozen = Freezer::new(&f.skills, book(), vec![])
            .freeze(request())
            .unwrap();
        let job = frozen.job;
        assert_eq!(job.project, "shop");
        assert_eq!(job.step, "implement_task");
        assert_eq!(job.skill_md, "# Implement");
        let review = job.review.unwrap();
        assert_eq!((review.max_cycles, review.block_on_failure), (4, true));
        assert_eq!(review.instructions, "Check it");
        assert_eq!(job.implementer.name, "impl");
        assert_eq!(job.reviewer.unwrap().name, "rev");
        assert_eq!(job.repair_budget, DEFAULT_REPAIR_ATTEMPTS);
    }

    #[test]
    fn environment_fills_gaps_and_zero_disables_review() {
        let f = fixture(Some("Check it"));
        let env = vec![(ENV_AUTO_REVIEW_MAX_RETRIES.to_string(), "0".to_string())];
        let job = Freezer::new(&f.skills, book(), env)
            .freeze(request())
            .unwrap()
            .job;
        assert_eq!(job.review, None);
        assert_eq!(job.reviewer, None);

        let env = vec![
            (ENV_AUTO_REVIEW_MAX_RETRIES.to_string(), "6".to_string()),
            (ENV_FORGE_REPAIR_ATTEMPTS.to_string(), "1".to_string()),
        ];
        let job = Freezer::new(&f.skills, book(), env)
            .freeze(request())
            .unwrap()
            .job;
        assert_eq!(job.review.unwrap().max_cycles, 6);
        assert_eq!(job.repair_budget, 1);
    }

    #[test]
    fn warnings_reach_the_submitter_and_the_job() {
        let f = fixture(Some("---\nmax_retries: three\n---\nCheck it"));
        let frozen = Freezer::new(&f.skills, book(), vec![])
            .freeze(request())
            .unwrap();
        assert_eq!(frozen.warnings.len(), 1);
        assert!(frozen.warnings[0].contains("default/implement-task/review.md"));
        assert_eq!(frozen.job.warnings, frozen.warnings);
        assert_eq!(frozen.job.review.unwrap().max_cycles, 3);
    }

    #[test]
    fn no_review_md_means_no_reviewer() {
        let f = fixture(None);
        let job = Freezer::new(&f.skills, book(), vec![])
            .freeze(request())
            .unwrap()
            .job;
        assert_eq!(job.review, None);
    }

    #[test]
    fn every_bad_field_is_named() {
        let f = fixture(None);
        let freezer = Freezer::new(&f.skills, book(), vec![]);
        type Mutation = Box<dyn Fn(&mut RunRequest)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("ticket", Box::new(|r| r.ticket = "bad".into())),
            ("skill", Box::new(|r| r.skill = "../x".into())),
            ("skill", Box::new(|r| r.skill = "unknown-skill".into())),
            ("step", Box::new(|r| r.step = Some("Bad-Step".into()))),
            ("brief", Box::new(|r| r.brief = " ".into())),
            (
                "brief",
                Box::new(|r| r.brief = "x".repeat(MAX_BRIEF_BYTES + 1)),
            ),
            (
                "repository.url",
                Box::new(|r| r.repository.url = "--upload-pack=evil".into()),
            ),
            (
                "repository.ref",
                Box::new(|r| r.repository.git_ref = Some("../main".into())),
            ),
            (
                "repository.ref",
                Box::new(|r| r.repository.git_ref = Some("-x".into())),
            ),
            (
                "commands[0].argv",
                Box::new(|r| {
                    r.commands = vec![proto::VerifyCommand {
                        argv: vec![],
                        timeout: 5,
                    }]
                }),
            ),
            (
                "commands[0].timeout",
                Box::new(|r| {
                    r.commands = vec![proto::VerifyCommand {
                        argv: vec!["x".into()],
                        timeout: 0,
                    }]
                }),
            ),
            ("repair_attempts", Box::new(|r| r.repair_attempts = Some(4))),
            (
                "budget.max_cost_usd",
                Box::new(|r| r.budget = Some(proto::Budget::dollars(0.0))),
            ),
            (
                "budget.max_cost_usd",
                Box::new(|r| r.budget = Some(proto::Budget::dollars(f64::NAN))),
            ),
            (
                "budget.max_tokens",
                Box::new(|r| {
                    r.budget = Some(proto::Budget {
                        max_cost_usd: None,
                        max_tokens: Some(0),
                    })
                }),
            ),
            (
                "repair_attempts",
                Box::new(|r| r.repair_attempts = Some(-1)),
            ),
            (
                "agents.implementer",
                Box::new(|r| {
                    r.agents = Some(proto::AgentChoice {
                        implementer: Some("nope".into()),
                        reviewer: None,
                    })
                }),
            ),
            (
                "assurance.review_agent",
                Box::new(|r| {
                    r.assurance = Some(proto::Assurance {
                        review_agent: Some("nope".into()),
                    })
                }),
            ),
            ("schema_version", Box::new(|r| r.schema_version = Some(99))),
        ];
        for (field, mutate) in cases {
            let mut r = request();
            mutate(&mut r);
            let error = freezer.freeze(r).unwrap_err();
            assert_eq!(error.field(), Some(field), "{error}");
            assert!(
                error.to_string().contains(field.split('[').next().unwrap()),
                "{error} does not name {field}"
            );
        }
    }

    #[test]
    fn frozen_job_ignores_later_file_changes() {
        let f = fixture(Some("---\nmax_retries: 2\n---\nOld rules"));
        let freezer = Freezer::new(&f.skills, book(), vec![]);
        let job = freezer.freeze(request()).unwrap().job;
        std::fs::write(
            f.skills.join("default/implement-task/review.md"),
            "---\nmax_retries: 9\n---\nNew",
        )
        .unwrap();
        let review = job.review.unwrap();
        assert_eq!(
            (review.max_cycles, review.instructions.as_str()),
            (2, "Old rules")
        );
    }
}
