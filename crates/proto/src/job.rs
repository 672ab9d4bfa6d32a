//! The frozen job: a validated run request with every file and setting resolved at submission.
//!
//! A job holds the names of secret variables, never their values.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{AgentKind, RepositoryRef, VerifyCommand};

/// Everything a worker needs to perform a run, frozen by the dispatcher at submission.
///
/// Changing skills, agent files or the environment afterwards never changes a job. It holds
/// the names of secret variables only, never their values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    /// Always [`crate::SCHEMA_VERSION`] when written; readers refuse other versions.
    pub schema_version: u32,
    /// Assigned by the dispatcher.
    pub run_id: Uuid,
    /// The ticket key, `MYPROJECT-123`.
    pub ticket: String,
    /// The project key derived from the ticket, lowercased.
    pub project: String,
    /// The skill name.
    pub skill: String,
    /// The step name; cycle files live under `.forge/{step}/`.
    pub step: String,
    /// The brief given to the implementer and the reviewers.
    pub brief: String,
    /// The source repository and starting ref.
    pub repository: RepositoryRef,
    /// Verification commands, run in order in the implementer's image.
    pub commands: Vec<VerifyCommand>,
    /// The resolved `SKILL.md` text.
    pub skill_md: String,
    /// The resolved review configuration; `None` when the skill has no reviewer.
    pub review: Option<ReviewConfig>,
    /// Repair rounds allowed after the first implementation round (0..=3).
    pub repair_budget: u32,
    /// The implementer's profile (also the image for verification commands).
    pub implementer: AgentProfile,
    /// The reviewer's profile; present when `review` is.
    pub reviewer: Option<AgentProfile>,
    /// The independent final reviewer's profile, when one was requested.
    pub final_reviewer: Option<AgentProfile>,
    /// Warnings found at submission (frontmatter, environment), kept with the run.
    pub warnings: Vec<String>,
    /// When the dispatcher accepted the run (RFC 3339). Also the delivery commit's date, so
    /// that delivering the same tree twice produces the same commit.
    pub submitted_at: String,
    /// Set when the job resumes a paused run: where it stopped. Everything else in the job is
    /// the original frozen job, so a resume changes no budget, limit or profile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<crate::Checkpoint>,
    /// The run's spending limit, from the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::Budget>,
    /// Set on each copy the dispatcher publishes (never in the stored frozen job): the run's
    /// epoch and the copy's expiry, under the job's signature. A worker runs no job without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publication: Option<crate::Publication>,
    /// Set on a follow-up round (SPEC 17): the run it continues and the feedback it answers.
    /// Its repository ref is that run's delivered branch; its delivery adds a commit there and
    /// never overwrites a commit pushed after the round started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow_up: Option<FollowUp>,
    /// The SHA-256 of the request the job was frozen from (its canonical JSON), so that a
    /// submission key repeated with another request is told apart from a true repeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_digest: Option<String>,
}

/// What a follow-up round continues (SPEC 17).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FollowUp {
    /// The run whose delivered branch this round starts from.
    pub of: Uuid,
    /// The feedback, given to the implementer as `## Reviewer Feedback`.
    pub feedback: String,
}

impl Job {
    /// The key that tells this execution of the run from the others: the run id, then the
    /// checkpoint's sequence for a resumed run (`{run_id}.{sequence}`).
    pub fn execution_key(&self) -> String {
        match &self.resume {
            None => self.run_id.to_string(),
            Some(checkpoint) => format!("{}.{}", self.run_id, checkpoint.sequence),
        }
    }
}

/// The review settings resolved from `review.md` and the environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReviewConfig {
    /// The path `review.md` was read from, relative to the skills directory.
    pub source: String,
    /// The prose body: the reviewer's instructions.
    pub instructions: String,
    /// The maximum number of review cycles (at least 1; zero disables review entirely).
    pub max_cycles: u32,
    /// End `blocked` instead of delivering with a warning when every cycle was rejected.
    pub block_on_failure: bool,
    /// The reviewer stage's time limit in seconds.
    pub timeout_seconds: u64,
}

/// A named agent profile (SPEC 5), copied into the job when it is frozen.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentProfile {
    /// The profile's name in the agents file.
    pub name: String,
    /// The container image; it must exist on the worker's engine or be pullable.
    pub image: String,
    /// The command the container runs; the image's entrypoint when empty.
    pub command: Vec<String>,
    /// Names of environment variables whose values the worker passes from its own environment.
    pub env: Vec<String>,
    /// The container network.
    pub network: Network,
    /// Memory limit in bytes.
    pub memory_bytes: u64,
    /// CPU limit in cores.
    pub cpus: f64,
    /// The stage's time limit in seconds.
    pub timeout_seconds: u64,
    /// The user the container runs as; the worker chooses a non-root one when absent.
    pub user: Option<String>,
    /// The container's root filesystem is read-only, with a size-limited tmpfs at `/tmp`.
    #[serde(default = "read_only_by_default")]
    pub read_only_root: bool,
    /// The most the stage may write to `/tmp`, and the largest file it may write anywhere.
    #[serde(default = "default_disk_bytes")]
    pub disk_bytes: u64,
    /// With `network = "egress"`: the only `host:port`s the stage may reach (a leading `*.`
    /// allows subdomains), through the worker's egress proxy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<String>,
    /// The most stages of this profile running at once across the pool; unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    /// The agent CLI the image runs (SPEC 16); `command` runs `command` under SPEC 6.
    #[serde(default, skip_serializing_if = "AgentKind::is_command")]
    pub kind: AgentKind,
    /// For an agent kind: the model the CLI asks for; the CLI's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// For an agent kind: the model API's root the CLI is pointed at; the kind's provider's
    /// public address when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The model provider whose traffic goes through the worker's model gateway (SPEC 16): the
    /// stage gets the gateway's address and a stage token, never the provider's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// With a `provider`: the most the profile may spend in a UTC day across the pool, checked
    /// by the gateways against the dispatcher's allotments (`crate::allotment`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub daily_budget: Option<crate::Budget>,
    /// For an agent kind: extra arguments added to the CLI's command line.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// For an agent kind: how long a rate-limited stage pauses when neither the CLI nor the
    /// provider named the reset; the worker's default (300 s) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_seconds: Option<u64>,
    /// With a `provider`: the server-side tools (run by the provider, reaching addresses the
    /// request names) the gateway lets the profile's requests name, by name (`web_search`,
    /// `web_fetch`, `mcp`, `google_search`, `url_context`, …); none when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_tools: Vec<String>,
}

/// A profile's `disk` when it sets none: 4 GiB.
pub const DEFAULT_DISK_BYTES: u64 = 4 << 30;

fn read_only_by_default() -> bool {
    true
}

fn default_disk_bytes() -> u64 {
    DEFAULT_DISK_BYTES
}

/// The largest brief a job may carry: 256 KiB.
pub const MAX_BRIEF_BYTES: usize = 256 * 1024;
/// The largest skill or review text a job may carry: 1 MiB.
pub const MAX_SKILL_TEXT_BYTES: usize = 1024 * 1024;
/// The most verification commands a job may carry.
pub const MAX_COMMANDS: usize = 64;

impl Job {
    /// Checks every field a worker relies on, as a worker must: a job message is untrusted
    /// input even when its signature checks (the dispatcher that signed it may be older). The
    /// error names the field and the rule.
    pub fn check(&self) -> Result<(), String> {
        match crate::names::project_of(&self.ticket) {
            Some(project) if project == self.project => {}
            Some(_) => {
                return Err(format!(
                    "project {:?} is not the ticket's project",
                    self.project
                ))
            }
            None => {
                return Err(format!(
                    "ticket {:?} must match ^[A-Za-z][A-Za-z0-9_]*-[0-9]+$",
                    self.ticket
                ))
            }
        }
        if !crate::names::is_skill(&self.skill) {
            return Err(format!(
                "skill {:?} must match ^[a-z0-9][a-z0-9-]{{0,63}}$",
                self.skill
            ));
        }
        if !crate::names::is_step(&self.step) {
            return Err(format!(
                "step {:?} must match ^[a-z0-9][a-z0-9_]{{0,63}}$",
                self.step
            ));
        }
        if self.brief.len() > MAX_BRIEF_BYTES {
            return Err(format!(
                "brief is {} bytes, over {MAX_BRIEF_BYTES}",
                self.brief.len()
            ));
        }
        let review_text = self.review.as_ref().map_or(0, |r| r.instructions.len());
        if self.skill_md.len() > MAX_SKILL_TEXT_BYTES || review_text > MAX_SKILL_TEXT_BYTES {
            return Err(format!(
                "skill_md and review.instructions may be at most {MAX_SKILL_TEXT_BYTES} bytes each"
            ));
        }
        if self.repair_budget > 3 {
            return Err(format!(
                "repair_budget {} must be 0 to 3",
                self.repair_budget
            ));
        }
        if self.commands.len() > MAX_COMMANDS {
            return Err(format!(
                "at most {MAX_COMMANDS} commands, got {}",
                self.commands.len()
            ));
        }
        for (index, command) in self.commands.iter().enumerate() {
            if command.argv.is_empty() || command.timeout == 0 {
                return Err(format!(
                    "commands[{index}] needs a non-empty argv and a timeout of at least 1 s"
                ));
            }
        }
        if self.review.is_some() != self.reviewer.is_some() {
            return Err("review and reviewer must be present together".into());
        }
        let profiles = [
            ("implementer", Some(&self.implementer)),
            ("reviewer", self.reviewer.as_ref()),
            ("final_reviewer", self.final_reviewer.as_ref()),
        ];
        for (role, profile) in profiles {
            if let Some(profile) = profile {
                profile.check().map_err(|e| format!("{role}: {e}"))?;
            }
        }
        Ok(())
    }
}

impl AgentProfile {
    /// Checks what no profile may ask for: a root user, or a variable forgepool or the
    /// container must own.
    pub fn check(&self) -> Result<(), String> {
        if self.image.trim().is_empty() || self.image.chars().any(char::is_control) {
            return Err(format!(
                "profile `{}`: image must name a container image",
                self.name
            ));
        }
        if let Some(user) = &self.user {
            if crate::names::is_root_user(user) {
                return Err(format!(
                    "profile `{}`: user {user:?} is root; stages never run as root",
                    self.name
                ));
            }
        }
        for entry in &self.egress {
            check_egress_entry(entry)
                .map_err(|e| format!("profile `{}`: egress {e}", self.name))?;
        }
        if self.network == Network::Egress && self.egress.is_empty() {
            return Err(format!(
                "profile `{}`: network \"egress\" needs at least one egress host",
                self.name
            ));
        }
        if self.kind.is_command()
            && (self.model.is_some()
                || self.base_url.is_some()
                || !self.args.is_empty()
                || self.pause_seconds.is_some())
        {
            return Err(format!(
                "profile `{}`: model, base_url, args and pause_seconds apply to agent kinds only",
                self.name
            ));
        }
        if self
            .pause_seconds
            .is_some_and(|s| !(1..=MAX_PAUSE_SECONDS).contains(&s))
        {
            return Err(format!(
                "profile `{}`: pause_seconds must be from 1 to {MAX_PAUSE_SECONDS}",
                self.name
            ));
        }
        let texts = self.model.iter().chain(&self.base_url).chain(&self.args);
        if texts.clone().any(|t| t.chars().any(char::is_control)) || self.args.len() > 64 {
            return Err(format!(
                "profile `{}`: model, base_url and args must be printable (at most 64 args)",
                self.name
            ));
        }
        for name in &self.env {
            if let Some(why) = crate::names::env_name_refusal(name) {
                return Err(format!(
                    "profile `{}`: env {name:?} is not allowed: {why}",
                    self.name
                ));
            }
        }
        Ok(())
    }

    /// The fields in which this profile differs from `other`, by name.
    pub fn differences(&self, other: &AgentProfile) -> Vec<&'static str> {
        let mut fields = Vec::new();
        let mut check = |name, differs: bool| {
            if differs {
                fields.push(name);
            }
        };
        check("image", self.image != other.image);
        check("command", self.command != other.command);
        check("env", self.env != other.env);
        check("network", self.network != other.network);
        check("user", self.user != other.user);
        check("memory", self.memory_bytes != other.memory_bytes);
        check("cpus", self.cpus != other.cpus);
        check(
            "timeout_seconds",
            self.timeout_seconds != other.timeout_seconds,
        );
        check(
            "read_only_root",
            self.read_only_root != other.read_only_root,
        );
        check("disk", self.disk_bytes != other.disk_bytes);
        check("egress", self.egress != other.egress);
        check(
            "max_concurrent",
            self.max_concurrent != other.max_concurrent,
        );
        check("kind", self.kind != other.kind);
        check("model", self.model != other.model);
        check("base_url", self.base_url != other.base_url);
        check("args", self.args != other.args);
        check("pause_seconds", self.pause_seconds != other.pause_seconds);
        fields
    }
}

/// The longest pause a profile may give a rate limit without a named reset: a day.
pub const MAX_PAUSE_SECONDS: u64 = 86_400;

/// A stage container's network.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Network {
    /// No network at all.
    #[default]
    None,
    /// Docker's default bridge: unrestricted, allowed only when the worker's operator says so.
    Bridge,
    /// Only the profile's `egress` hosts, through the worker's egress proxy.
    Egress,
}

impl Network {
    /// The profile value.
    pub fn as_str(self) -> &'static str {
        match self {
            Network::None => "none",
            Network::Bridge => "bridge",
            Network::Egress => "egress",
        }
    }
}

/// Checks one `egress` entry: `host:port` or `*.domain:port`, the port 1..=65535, the host
/// made of letters, digits, `-` and `.` (or an IPv4 address).
pub fn check_egress_entry(entry: &str) -> Result<(), String> {
    let (host, port) = entry
        .rsplit_once(':')
        .ok_or_else(|| format!("{entry:?} must be host:port, like api.anthropic.com:443"))?;
    if !port.parse::<u16>().is_ok_and(|p| p > 0) {
        return Err(format!("{entry:?} has no valid port (1 to 65535)"));
    }
    let name = host.strip_prefix("*.").unwrap_or(host);
    let valid = !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if !valid {
        return Err(format!(
            "{entry:?} must name a host (letters, digits, '-', '.') or `*.domain`"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> AgentProfile {
        AgentProfile {
            max_concurrent: None,
            name: "claude".into(),
            image: "agents/claude:1".into(),
            command: vec!["claude".into(), "-p".into()],
            env: vec!["ANTHROPIC_API_KEY".into()],
            network: Network::Bridge,
            memory_bytes: 4 << 30,
            cpus: 2.0,
            timeout_seconds: 1800,
            user: None,
            read_only_root: true,
            disk_bytes: DEFAULT_DISK_BYTES,
            egress: vec![],
            kind: AgentKind::Command,
            model: None,
            base_url: None,
            provider: None,
            daily_budget: None,
            args: vec![],
            pause_seconds: None,
            server_tools: vec![],
        }
    }

    #[test]
    fn job_round_trips_and_holds_secret_names_only() {
        let job = Job {
            budget: None,
            follow_up: None,
            schema_version: crate::SCHEMA_VERSION,
            run_id: Uuid::new_v4(),
            ticket: "MYPROJECT-123".into(),
            project: "myproject".into(),
            skill: "implement-task".into(),
            step: "implement_task".into(),
            brief: "do it".into(),
            repository: RepositoryRef {
                url: "file:///r.git".into(),
                git_ref: None,
            },
            commands: vec![],
            skill_md: "# Skill".into(),
            review: Some(ReviewConfig {
                source: "default/implement-task/review.md".into(),
                instructions: "check".into(),
                max_cycles: 3,
                block_on_failure: false,
                timeout_seconds: 300,
            }),
            repair_budget: 2,
            implementer: profile(),
            reviewer: Some(profile()),
            final_reviewer: None,
            warnings: vec![],
            submitted_at: crate::timestamp_now(),
            resume: None,
            publication: None,
            request_digest: None,
        };
        let text = serde_json::to_string(&job).unwrap();
        assert!(text.contains("\"ANTHROPIC_API_KEY\""));
        let again: Job = serde_json::from_str(&text).unwrap();
        assert_eq!(again, job);
    }

    #[test]
    fn a_resumed_job_carries_its_checkpoint_and_a_key_of_its_own() {
        let mut job: Job = serde_json::from_value(serde_json::json!({
            "schema_version": 1, "run_id": "6d0f3c3e-2f1a-4c4e-9a57-0b1f1b1c1d1e", "ticket": "SHOP-1",
            "project": "shop", "skill": "s", "step": "s", "brief": "b",
            "repository": {"url": "file:///r.git"}, "commands": [], "skill_md": "s", "review": null,
            "repair_budget": 1,
            "implementer": {"name": "i", "image": "i", "command": [], "env": [], "network": "none",
                            "memory_bytes": 1, "cpus": 1.0, "timeout_seconds": 60, "user": null},
            "reviewer": null, "final_reviewer": null, "warnings": [], "submitted_at": "2024-01-15T10:30:00Z"
        }))
        .expect("a job without `resume` still reads");
        assert_eq!(job.execution_key(), "6d0f3c3e-2f1a-4c4e-9a57-0b1f1b1c1d1e");
        assert!(!serde_json::to_string(&job).unwrap().contains("resume"));
        job.resume = Some(crate::Checkpoint {
            resume_at: None,
            sequence: 2,
            base: "b".into(),
            tree: "t".into(),
            patch: String::new(),
            state: crate::checkpoint::sample_loop_state(),
        });
        assert_eq!(
            job.execution_key(),
            "6d0f3c3e-2f1a-4c4e-9a57-0b1f1b1c1d1e.2"
        );
        let back: Job = serde_json::from_str(&serde_json::to_string(&job).unwrap()).unwrap();
        assert_eq!(back, job);
    }
}
