//! A stage's way to its model (SPEC 16): for a profile with a `provider`, the gateway's pass
//! (a token for this stage alone, the run's budget and what the run spent so far), the
//! variables that point the CLI at the gateway with that token, and, when the stage ends,
//! what the pass says: the stage's usage of record, a budget spent, a rate limit hit.

use super::*;
use gateway::{Amount, Limits, Pass, PassRequest, StageMeter};
use proto::AgentKind;

/// How long a stage token outlives the stage's time limit at most (it is revoked when the
/// stage ends; this bounds a token whose stage was lost).
const TOKEN_MARGIN: Duration = Duration::from_secs(120);

/// How far the CLI's own count may stray from the gateway's before the stage's log says so.
const CROSS_CHECK_TOLERANCE: f64 = 0.01;

impl<R: ContainerRuntime> Engine<R> {
    /// The pass of a stage of `profile` in `container`; `None` when the profile names no
    /// provider, `Err` (the stage's failure reason) when no pass can be made.
    pub(super) fn stage_pass(
        &self,
        run: &RunContext<'_>,
        profile: &AgentProfile,
        container: &str,
        timeout_seconds: u64,
    ) -> Option<Result<Pass, String>> {
        let provider = profile.provider.as_ref()?;
        let Some(gateway) = &self.config.gateway else {
            return Some(Err(format!(
                "agent profile `{}` names the provider `{provider}`, but this worker runs no model gateway",
                profile.name
            )));
        };
        let spent = run
            .usage
            .as_ref()
            .map_or(Amount::default(), |usage| Amount {
                tokens: usage.input_tokens
                    + usage.output_tokens
                    + usage.cache_read_tokens
                    + usage.cache_write_tokens,
                cost_usd: usage.cost_usd,
            });
        let limits = run
            .job
            .budget
            .as_ref()
            .map_or(Limits::default(), |b| Limits {
                max_tokens: b.max_tokens,
                max_cost_usd: b.max_cost_usd,
            });
        let request = PassRequest {
            run_id: run.job.run_id,
            profile: profile.name.clone(),
            provider: provider.clone(),
            container: container.to_string(),
            limits,
            spent,
            lifetime: Duration::from_secs(timeout_seconds) + TOKEN_MARGIN,
            daily_budget: profile.daily_budget.is_some(),
            server_tools: profile.server_tools.clone(),
        };
        Some(
            gateway
                .pass(request)
                .map_err(|e| format!("agent profile `{}`: {e}", profile.name)),
        )
    }

    /// The gateway halted a stage: a rate limit it hit pauses the profile across the pool at
    /// once, before the stage has stopped, so that no worker starts another stage of it.
    pub(super) async fn halted_by_gateway(&self, run_id: Uuid, pass: Option<&Pass>) {
        warn!("the model gateway halted the stage");
        let Some((pass, (until, reason))) = pass.and_then(|p| Some((p, p.rate_limited()?))) else {
            return;
        };
        let pause = proto::PauseRequest {
            reason,
            until: humantime::format_rfc3339_seconds(until).to_string(),
        };
        info!(profile = pass.profile(), until = %pause.until, "the provider rate-limited the profile; it rests across the pool");
        self.config.gate.pause(run_id, pass.profile(), &pause).await;
    }

    /// A stage's pass with the variables it gives the stage added to `env`, and the token
    /// and every key of the gateway to `redact`; or the reason the stage cannot run.
    pub(super) fn grant_pass(
        &self,
        run: &RunContext<'_>,
        profile: &AgentProfile,
        (container, timeout_seconds): (&str, u64),
        env: &mut Vec<String>,
        redact: &mut Vec<String>,
    ) -> (Option<Pass>, Option<String>) {
        match self.stage_pass(run, profile, container, timeout_seconds) {
            Some(Ok(pass)) => {
                env.extend(pass_env(profile.kind, &pass));
                redact.push(pass.token().to_string());
                if let Some(gateway) = &self.config.gateway {
                    redact.extend(gateway.keys());
                }
                (Some(pass), None)
            }
            Some(Err(reason)) => (None, Some(reason)),
            None => (None, None),
        }
    }
}

/// The variables that point a stage at the gateway: `FORGE_MODEL_BASE_URL` and
/// `FORGE_MODEL_TOKEN` always, and the kind's own key variable holding the token (for
/// `command`, the usual variables of the provider's API, base URL included).
pub(super) fn pass_env(kind: AgentKind, pass: &Pass) -> Vec<String> {
    let (url, token) = (pass.base_url(), pass.token());
    let mut env = vec![
        format!("FORGE_MODEL_BASE_URL={url}"),
        format!("FORGE_MODEL_TOKEN={token}"),
    ];
    let pairs: &[(&str, &str)] = match (kind, pass.api()) {
        (AgentKind::ClaudeCode, _) => &[("ANTHROPIC_API_KEY", token)],
        (AgentKind::GeminiCli, _) => &[("GEMINI_API_KEY", token)],
        (AgentKind::Command, gateway::Api::AnthropicMessages) => {
            &[("ANTHROPIC_API_KEY", token), ("ANTHROPIC_BASE_URL", url)]
        }
        (AgentKind::Command, gateway::Api::Gemini) => {
            &[("GEMINI_API_KEY", token), ("GOOGLE_GEMINI_BASE_URL", url)]
        }
        (AgentKind::Command, _) => &[("OPENAI_API_KEY", token), ("OPENAI_BASE_URL", url)],
        _ => &[("OPENAI_API_KEY", token)],
    };
    env.extend(pairs.iter().map(|(name, value)| format!("{name}={value}")));
    env
}

/// The base URL a kind's CLI is given for `profile`'s provider: the gateway's.
pub(super) fn gateway_base_url(profile: &AgentProfile) -> Option<String> {
    let provider = profile.provider.as_ref()?;
    let api = gateway::Api::of_kind(profile.kind)?;
    Some(format!(
        "{}/{provider}{}",
        crate::docker::gateway_root(),
        api.base_suffix()
    ))
}

/// The stage's usage of record, from its pass: `None` when the stage made no call.
pub(super) fn metered_usage(meter: &StageMeter) -> Option<proto::Usage> {
    (meter.requests > 0).then(|| proto::Usage {
        input_tokens: meter.counts.input,
        output_tokens: meter.counts.output,
        cache_read_tokens: meter.counts.cache_read,
        cache_write_tokens: meter.counts.cache_write,
        cost_usd: meter.cost_usd,
        model: meter.counts.model.clone(),
    })
}

/// The usage a stage counts with: the gateway's when it metered the stage, else what the
/// agent reported; and a note when both exist and their token counts differ by more than 1%.
pub(super) fn usage_of_record(
    metered: Option<proto::Usage>,
    reported: Option<proto::Usage>,
) -> (Option<proto::Usage>, Option<String>) {
    let Some(metered) = metered else {
        return (reported, None);
    };
    let total = |u: &proto::Usage| {
        u.input_tokens + u.output_tokens + u.cache_read_tokens + u.cache_write_tokens
    };
    let note = reported.as_ref().and_then(|reported| {
        let (ours, theirs) = (total(&metered) as f64, total(reported) as f64);
        ((ours - theirs).abs() > CROSS_CHECK_TOLERANCE * ours.max(theirs)).then(|| {
            format!(
                "the agent reported {} tokens (input {}, output {}, cache read {}, cache write {}); the model gateway metered {} (input {}, output {}, cache read {}, cache write {}), which the run counts",
                total(reported), reported.input_tokens, reported.output_tokens, reported.cache_read_tokens, reported.cache_write_tokens,
                total(&metered), metered.input_tokens, metered.output_tokens, metered.cache_read_tokens, metered.cache_write_tokens,
            )
        })
    });
    (Some(metered), note)
}

/// What a closed pass does to the stage: a spent budget ends it with that reason; a rate
/// limit makes it a pause until the provider's reset, whatever the CLI did.
pub(super) fn gateway_verdict(
    run: &mut RunContext<'_>,
    meter: &StageMeter,
    outcome: &mut Result<StageOutput, RuntimeError>,
) -> Option<String> {
    if let Some(reason) = &meter.exhausted {
        return Some(reason.clone());
    }
    let (until, reason) = meter.rate_limited.as_ref()?;
    run.pause = Some(proto::PauseRequest {
        reason: reason.clone(),
        until: humantime::format_rfc3339_seconds(*until).to_string(),
    });
    // The gateway saw the provider's answer itself: the profile rests across the pool.
    run.pause_pool = true;
    if let Ok(output) = outcome {
        output.exit = StageExit::Exited(crate::agents::EXIT_PAUSED);
        output.tail = format!("{}\n{reason}", output.tail.trim_end())
            .trim_start()
            .to_string();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(input: u64, output: u64) -> proto::Usage {
        proto::Usage {
            input_tokens: input,
            output_tokens: output,
            ..Default::default()
        }
    }

    /// Catches: the agent's own count taken over the gateway's, or a disagreement hidden.
    #[test]
    fn the_gateways_count_is_of_record_and_a_disagreement_is_shown() {
        let (kept, note) = usage_of_record(Some(usage(100, 10)), Some(usage(100, 10)));
        assert_eq!(kept, Some(usage(100, 10)));
        assert!(note.is_none());
        let (kept, note) = usage_of_record(Some(usage(100, 10)), Some(usage(50, 1)));
        assert_eq!(kept, Some(usage(100, 10)));
        assert!(note.unwrap().contains("metered 110"));
        let (kept, _) = usage_of_record(None, Some(usage(5, 5)));
        assert_eq!(kept, Some(usage(5, 5)));
    }
}
