//! The Markdown report delivered with a run, suitable as a pull-request body (SPEC 9).

use std::fmt::Write;

use proto::{CheckResult, CycleOrigin, CycleRecord, Job, RoundRecord, RunState};

/// What the report is built from.
#[derive(Debug)]
pub struct ReportInput<'a> {
    /// The frozen job.
    pub job: &'a Job,
    /// The run's end state and reason.
    pub state: RunState,
    /// Why it ended there.
    pub reason: &'a str,
    /// Verification results of every round.
    pub checks: &'a [CheckResult],
    /// Every review cycle, in order.
    pub cycles: &'a [CycleRecord],
    /// Every completed implementation round.
    pub rounds: &'a [RoundRecord],
    /// Review was exhausted without approval.
    pub review_exhausted: bool,
    /// The final review's status line.
    pub final_review: &'a str,
    /// Warnings from submission and from the run.
    pub warnings: &'a [String],
    /// What the stages said they spent, when any said.
    pub usage: Option<&'a proto::UsageTotals>,
    /// The delivered branch's pull request.
    pub pull_request: Option<&'a str>,
}

/// Renders the report.
pub fn render(input: &ReportInput<'_>) -> String {
    let job = input.job;
    let mut out = String::new();
    let _ = writeln!(out, "# {}: {}\n", job.ticket, first_line(&job.brief));
    let _ = writeln!(out, "Outcome: **{}** ({})\n", input.state, input.reason);
    if let Some(pull) = input.pull_request {
        let _ = writeln!(out, "Pull request: {pull}\n");
    }
    let _ = writeln!(out, "## Brief\n\n{}\n", job.brief.trim());

    verification(&mut out, input);
    implementation_rounds(&mut out, input);
    review_section(&mut out, input);
    let _ = writeln!(out, "## Final review\n\n{}\n", input.final_review);
    usage_section(&mut out, input);

    if !input.warnings.is_empty() {
        let _ = writeln!(out, "## Warnings\n");
        for warning in input.warnings {
            let _ = writeln!(out, "- {warning}");
        }
        out.push('\n');
    }
    out
}

/// What the agents said they spent, with the budget when the request set one.
fn usage_section(out: &mut String, input: &ReportInput<'_>) {
    let Some(usage) = input.usage else {
        return;
    };
    let _ = writeln!(out, "## Usage\n");
    let _ = writeln!(
        out,
        "| input tokens | output tokens | cache read | cache write | cost (USD) | stages |\n|---|---|---|---|---|---|\n| {} | {} | {} | {} | {:.4} | {} |\n",
        usage.input_tokens,
        usage.output_tokens,
        usage.cache_read_tokens,
        usage.cache_write_tokens,
        usage.cost_usd,
        usage.stages
    );
    if !usage.models.is_empty() {
        // Model names come from agents: shown as code, never as Markdown.
        let models: Vec<String> = usage
            .models
            .iter()
            .map(|m| format!("`{}`", m.replace('`', "'")))
            .collect();
        let _ = writeln!(out, "Models: {}\n", models.join(", "));
    }
    if let Some(budget) = &input.job.budget {
        let _ = writeln!(out, "Budget: {budget}\n");
    }
}

/// The verification table.
fn verification(out: &mut String, input: &ReportInput<'_>) {
    let job = input.job;
    let _ = writeln!(out, "## Verification\n");
    if job.commands.is_empty() {
        let _ = writeln!(out, "No verification commands were configured.\n");
    } else if input.checks.is_empty() {
        let _ = writeln!(out, "No verification ran.\n");
    } else {
        let _ = writeln!(
            out,
            "| round | command | exit code | seconds |\n|---|---|---|---|"
        );
        for check in input.checks {
            let code = check
                .exit_code
                .map_or("timed out".to_string(), |c| c.to_string());
            let _ = writeln!(
                out,
                "| {} | `{}` | {} | {:.1} |",
                check.round,
                check.argv.join(" "),
                code,
                check.duration_seconds
            );
        }
        out.push('\n');
    }
}

/// Each implementation round: its reason, tree and failing checks.
fn implementation_rounds(out: &mut String, input: &ReportInput<'_>) {
    let job = input.job;
    let _ = writeln!(out, "## Implementation rounds\n");
    let _ = writeln!(
        out,
        "{} round(s); repair budget {}.\n",
        input.rounds.len(),
        job.repair_budget
    );
    for round in input.rounds {
        let failing = if round.failing.is_empty() {
            "checks passed".to_string()
        } else {
            round
                .failing
                .iter()
                .map(|(argv, code)| {
                    format!(
                        "`{}` → {}",
                        argv.join(" "),
                        code.map_or("timeout".into(), |c| c.to_string())
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "- Round {} ({}): tree `{}`, {}",
            round.round,
            round.reason,
            short(&round.tree),
            failing
        );
    }
    out.push('\n');
}

/// forgepool's review cycles, the agent's own loop apart, and the notes of an exhausted review.
fn review_section(out: &mut String, input: &ReportInput<'_>) {
    let job = input.job;
    let _ = writeln!(out, "## Review\n");
    // Only forgepool's own records are reviews; a container's own loop is shown apart, as
    // what the agent says about itself.
    let (reviews, own): (Vec<&CycleRecord>, Vec<&CycleRecord>) = input
        .cycles
        .iter()
        .partition(|c| c.origin == CycleOrigin::Forgepool);
    match &job.review {
        None => {
            let _ = writeln!(out, "This skill has no reviewer.\n");
        }
        Some(review) if reviews.is_empty() => {
            let _ = writeln!(out, "No review cycle ran (limit {}).\n", review.max_cycles);
        }
        Some(_) => {
            for cycle in &reviews {
                let limit = cycle.max_cycles.map_or(String::new(), |m| format!("/{m}"));
                let _ = writeln!(
                    out,
                    "### Cycle {}{}: {}\n",
                    cycle.cycle,
                    limit,
                    cycle.verdict.to_uppercase()
                );
                if !cycle.feedback.trim().is_empty() {
                    for line in cycle.feedback.trim().lines() {
                        let _ = writeln!(out, "> {line}");
                    }
                    out.push('\n');
                }
            }
        }
    }
    if !own.is_empty() {
        let _ = writeln!(
            out,
            "### The agent's own review loop\n\nWritten by the implementer into `.forge/`, not by forgepool's reviewer:\n"
        );
        for cycle in &own {
            let _ = writeln!(
                out,
                "- `{}/{}`: {}",
                cycle.step,
                cycle.file,
                cycle.verdict.to_uppercase()
            );
        }
        out.push('\n');
    }
    if input.review_exhausted {
        let _ = writeln!(out, "## Auto-Review Notes\n");
        let _ = writeln!(
            out,
            "Review was exhausted without approval: all {} cycle(s) were rejected and `block_on_failure` is false, so the change was delivered with this warning. The last feedback was:\n",
            reviews.len()
        );
        if let Some(last) = reviews.last() {
            for line in last.feedback.trim().lines() {
                let _ = writeln!(out, "> {line}");
            }
            out.push('\n');
        }
    }
}

fn first_line(text: &str) -> &str {
    text.lines().next().unwrap_or("").trim()
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}
