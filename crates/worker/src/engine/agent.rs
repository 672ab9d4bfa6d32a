//! The end of an agent kind's stage (SPEC 16): its CLI's report read into the run. The
//! transcript is published, the usage summed, and the stage's exit becomes what the report
//! says: a rate limit pauses the run with the provider's reset time whatever the CLI's exit
//! code, a CLI that says it failed fails, and a reviewer's verdict is read from its final
//! message rather than from its raw stream.

use super::*;

/// The largest record a kind's CLI leaves in `/forge/output` that is read (a trajectory).
const MAX_AGENT_RECORD_BYTES: u64 = 8 * 1024 * 1024;

/// Reads an agent kind's finished stage into the run: publishes its transcript, reads its
/// usage (the caller sums it, or the gateway's), sets the run's pause, and rewrites `output` (exit, stdout, tail) as its report
/// says. Returns the stage's usage.
pub(super) async fn settle_agent<S: EventSink>(
    run: &mut RunContext<'_>,
    sink: &S,
    place: StagePlace,
    output_dir: Option<PathBuf>,
    output: &mut StageOutput,
) -> Result<Option<proto::Usage>, PublishEvent> {
    let Some(mut report) = output.agent.take() else {
        return Ok(None);
    };
    let run_id = run.job.run_id;
    let stage = place.stage;
    if let (Some(name), Some(dir)) = (crate::agents::output_file(report.kind), output_dir) {
        match read_record(dir, name).await {
            Ok(Some(bytes)) => report.take_output_file(&bytes),
            Ok(None) => {}
            Err(note) => log_note(sink, run_id, stage, &note).await?,
        }
    }
    run.pause = None;
    run.pause_pool = false;
    if let StageExit::Exited(code) = output.exit {
        // A rate limit whose end nobody named pauses as long as the profile says.
        let unnamed_pause = profile_of(run.job, stage)
            .and_then(|p| p.pause_seconds)
            .map_or(crate::agents::DEFAULT_RATE_LIMIT_PAUSE, Duration::from_secs);
        let settled = report.settle(code, std::time::SystemTime::now(), unnamed_pause);
        if let Some(reason) = &settled.reason {
            log_note(sink, run_id, stage, reason).await?;
            output.tail = format!("{}\n{reason}", output.tail);
        }
        output.exit = StageExit::Exited(settled.exit_code);
        run.pause = settled.pause;
        run.pause_pool = pool_pauses(run.job, stage);
    }
    output.stdout = std::mem::take(&mut report.final_text);
    let usage = report.usage.take().map(|mut usage| {
        if usage.model.is_none() {
            usage.model = profile_of(run.job, stage).and_then(|p| p.model.clone());
        }
        usage
    });
    let transcript = std::mem::take(&mut report.transcript);
    publish(
        sink,
        run_id,
        EventKind::Transcript {
            stage,
            round: place.round,
            cycle: place.cycle,
            agent: report.kind,
            transcript,
        },
    )
    .await?;
    Ok(usage)
}

/// The profile a stage of the run uses.
/// Whether an agent's own claim of a pause (`pause.json`, its CLI's rate-limit line) pauses
/// the stage's profile across the pool: only for a profile without a `provider`. A gateway
/// profile's pool-wide pause comes from the gateway's own view of the provider's answers, so
/// a stage cannot stop every run of its profile by saying so (SPEC 6, 16).
pub(super) fn pool_pauses(job: &Job, stage: Stage) -> bool {
    profile_of(job, stage).is_some_and(|p| p.provider.is_none())
}

fn profile_of(job: &Job, stage: Stage) -> Option<&proto::AgentProfile> {
    match stage {
        Stage::Implement | Stage::Verify => Some(&job.implementer),
        Stage::Review => job.reviewer.as_ref(),
        Stage::FinalReview => job.final_reviewer.as_ref(),
    }
}

/// A record the CLI left in `/forge/output`: a regular file, never through a symlink,
/// bounded. `Ok(None)` when there is none.
async fn read_record(dir: PathBuf, name: &'static str) -> Result<Option<Vec<u8>>, String> {
    tokio::task::spawn_blocking(move || {
        match crate::workspace::confined::read_beneath(
            &dir,
            Path::new(name),
            MAX_AGENT_RECORD_BYTES,
        ) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(crate::workspace::confined::ReadError::Missing) => Ok(None),
            Err(error) => Err(format!("/forge/output/{name} cannot be read: {error}")),
        }
    })
    .await
    .unwrap_or(Ok(None))
}

/// A line of forgepool's own in the stage's log.
async fn log_note<S: EventSink>(
    sink: &S,
    run_id: Uuid,
    stage: Stage,
    note: &str,
) -> Result<(), PublishEvent> {
    warn!(%note, "agent stage");
    publish(
        sink,
        run_id,
        EventKind::Log {
            stage,
            stream: proto::LogStream::Stderr,
            text: format!("[forgepool] {note}\n"),
        },
    )
    .await
}
