//! Whether a job's execution is still live: the worker asks the dispatcher, whose store is the
//! truth, before it executes a job (`proto::ExecutionQuery`). The question goes to
//! `{prefix}.execution-questions`; the answer comes back on RabbitMQ's direct reply-to, signed with the
//! job key, naming the question's nonce. Whoever else can publish cannot answer.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel};
use proto::amqp::{self, AmqpError, Topology};
use proto::{ExecutionAnswer, ExecutionQuery, Job, JobKey};
use tracing::warn;

/// RabbitMQ's direct reply-to pseudo-queue.
const REPLY_TO: &str = "amq.rabbitmq.reply-to";

/// How long the worker waits for the dispatcher's answer: as long as the question lives in
/// its queue.
const ANSWER_WAIT: Duration = Duration::from_millis(amqp::QUESTION_TTL_MS as u64);

/// How long closing the question's channel may take.
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// What the store says of a job's execution.
#[derive(Debug)]
pub enum Liveness {
    /// The run is still at this job's epoch, unfinished and not paused: execute it.
    Live,
    /// It is not (the reason says why): the job is dropped unrun.
    NotLive(String),
    /// No answer (no dispatcher, a broker failure): the job waits and asks again.
    Unknown(String),
}

/// Asks the dispatcher whether `job`'s execution is live, on `channel` (closed after), telling
/// it how often the run's execution was `lost` before this copy.
pub async fn ask(
    channel: Channel,
    topology: &Topology,
    key: &JobKey,
    job: &Job,
    lost: u32,
) -> Liveness {
    let Some(publication) = &job.publication else {
        return Liveness::NotLive("the job carries no publication".into());
    };
    let query = ExecutionQuery {
        schema_version: proto::SCHEMA_VERSION,
        run_id: job.run_id,
        epoch: publication.epoch,
        nonce: uuid::Uuid::new_v4(),
        lost,
    };
    let asked = tokio::time::timeout(ANSWER_WAIT, exchange(&channel, topology, key, &query)).await;
    // Closing the channel ends the reply consumer; a late answer has nowhere to go. A broker
    // that stopped answering is not waited for: the connection's own failure ends it.
    let _ = tokio::time::timeout(CLOSE_WAIT, channel.close(200, "answered".into())).await;
    match asked {
        Ok(Ok(answer)) if answer.live => Liveness::Live,
        Ok(Ok(answer)) => Liveness::NotLive(answer.reason),
        Ok(Err(error)) => Liveness::Unknown(error.to_string()),
        Err(_) => Liveness::Unknown(format!(
            "the dispatcher did not answer within {ANSWER_WAIT:?} (is it running?)"
        )),
    }
}

async fn exchange(
    channel: &Channel,
    topology: &Topology,
    key: &JobKey,
    query: &ExecutionQuery,
) -> Result<ExecutionAnswer, AmqpError> {
    let payload = serde_json::to_vec(query).unwrap_or_default();
    question(
        channel,
        &topology.executions(),
        &payload,
        |body, signature| ExecutionAnswer::read(body, signature, key, query),
    )
    .await
}

/// Publishes a question to `queue` and waits on direct reply-to for the first answer `read`
/// accepts (signed, naming the question); others are logged and ignored.
pub(super) async fn question<T>(
    channel: &Channel,
    queue: &str,
    payload: &[u8],
    read: impl Fn(&[u8], Option<&str>) -> Result<T, String>,
) -> Result<T, AmqpError> {
    let broker = |operation| move |source| AmqpError::Broker { operation, source };
    let no_ack = BasicConsumeOptions {
        no_ack: true,
        ..Default::default()
    };
    let mut answers = channel
        .basic_consume(REPLY_TO.into(), "".into(), no_ack, FieldTable::default())
        .await
        .map_err(broker("consume answers"))?;
    let properties = BasicProperties::default()
        .with_reply_to(ShortString::from(REPLY_TO))
        .with_content_type(ShortString::from("application/json"));
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            payload,
            properties,
        )
        .await
        .map_err(broker("ask the dispatcher"))?;
    while let Some(delivery) = answers.next().await {
        let delivery = delivery.map_err(broker("read an answer"))?;
        let signature = amqp::header_text(&delivery.properties, proto::SIGNATURE_HEADER);
        match read(&delivery.data, signature.as_deref()) {
            Ok(answer) => return Ok(answer),
            Err(reason) => warn!(%reason, "ignoring an answer"),
        }
    }
    Err(AmqpError::Pool("the answer channel closed".into()))
}
