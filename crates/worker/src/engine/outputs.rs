//! What a finished stage left for the run: an agent kind's report of its CLI, or the files of
//! SPEC 6 (`usage.json`, `pause.json`), and the stage's usage of record (the gateway's count
//! when it metered the stage).

use super::agent::settle_agent;
use super::*;

/// Takes a finished stage's `usage.json` into the run's sums, and its `pause.json` (when it
/// paused) into the run; notes each file that was there but could not be taken in the run's
/// log. Returns the stage's usage.
/// Reads what the stage left: an agent kind's report of its CLI, or the files of SPEC 6.
pub(super) async fn settle_outputs<S: EventSink>(
    run: &mut RunContext<'_>,
    sink: &S,
    place: StagePlace,
    output_dir: Option<PathBuf>,
    outcome: Result<StageOutput, RuntimeError>,
    metered: Option<proto::Usage>,
) -> Result<(Result<StageOutput, RuntimeError>, Option<proto::Usage>), PublishEvent> {
    let (outcome, reported) = match outcome {
        // An agent kind's stage ends as its CLI's report says.
        Ok(mut output) if output.agent.is_some() => {
            let usage = settle_agent(run, sink, place, output_dir, &mut output).await?;
            (Ok(output), usage)
        }
        outcome => {
            let paused = matches!(&outcome, Ok(o) if o.exit == StageExit::Exited(EXIT_PAUSED));
            let usage = take_outputs(run, sink, place.stage, output_dir, paused).await?;
            (outcome, usage)
        }
    };
    // The gateway's count, when it metered the stage, is the one the run sums (SPEC 16).
    let (usage, note) = super::model::usage_of_record(metered, reported);
    if let Some(note) = note {
        let text = format!("[forgepool] {note}\n");
        let (stage, stream) = (place.stage, proto::LogStream::Stderr);
        publish(
            sink,
            run.job.run_id,
            EventKind::Log {
                stage,
                stream,
                text,
            },
        )
        .await?;
    }
    if let Some(usage) = &usage {
        run.usage.get_or_insert_with(Default::default).add(usage);
    }
    Ok((outcome, usage))
}

async fn take_outputs<S: EventSink>(
    run: &mut RunContext<'_>,
    sink: &S,
    stage: Stage,
    output_dir: Option<PathBuf>,
    paused: bool,
) -> Result<Option<proto::Usage>, PublishEvent> {
    let Some(dir) = output_dir else {
        return Ok(None);
    };
    let (usage, pause, notes) = read_outputs(dir, paused).await;
    for note in notes {
        warn!(%note, "an agent's output file is ignored");
        let text = format!("[forgepool] {note}\n");
        let stream = proto::LogStream::Stderr;
        publish(
            sink,
            run.job.run_id,
            EventKind::Log {
                stage,
                stream,
                text,
            },
        )
        .await?;
    }
    run.pause = pause;
    run.pause_pool = super::agent::pool_pauses(run.job, stage);
    Ok(usage)
}

/// The largest `usage.json` or `pause.json` read from `/forge/output`.
const MAX_OUTPUT_NOTE_BYTES: u64 = 64 * 1024;

/// Reads a finished stage's `usage.json`, and its `pause.json` when it `paused`: regular files
/// only (never through a symlink), up to 64 KiB. Returns them and a note for each file that
/// was there but could not be taken.
async fn read_outputs(
    dir: PathBuf,
    paused: bool,
) -> (
    Option<proto::Usage>,
    Option<proto::PauseRequest>,
    Vec<String>,
) {
    tokio::task::spawn_blocking(move || {
        let mut notes = Vec::new();
        let mut read = |name: &str| match crate::workspace::confined::read_beneath(
            &dir,
            Path::new(name),
            MAX_OUTPUT_NOTE_BYTES,
        ) {
            Ok(bytes) => Some(bytes),
            Err(crate::workspace::confined::ReadError::Missing) => None,
            Err(error) => {
                notes.push(format!("/forge/output/{name} cannot be read: {error}"));
                None
            }
        };
        let usage = read("usage.json");
        let pause = if paused { read("pause.json") } else { None };
        let usage = usage.and_then(|bytes| {
            proto::Usage::parse(&bytes)
                .map_err(|error| notes.push(error))
                .ok()
        });
        let pause = pause.and_then(|bytes| {
            proto::PauseRequest::parse(&bytes, std::time::SystemTime::now())
                .map_err(|error| notes.push(error))
                .ok()
        });
        (usage, pause, notes)
    })
    .await
    .unwrap_or_default()
}
