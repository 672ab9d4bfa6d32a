//! The gateway's [`Allotter`] in distributed mode: shares of profiles' daily budgets asked of
//! the dispatcher on `{prefix}.allotments` (`proto::allotment`), answered signed with the job
//! key on direct reply-to, over a connection of its own opened when first needed.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use gateway::daily::{Allotted, Allotter};
use lapin::Connection;
use proto::allotment::{AllotmentAnswer, AllotmentQuery};
use proto::amqp::{self, Topology};
use proto::JobKey;

/// How long a gateway's request waits for the dispatcher's answer.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// Asks the dispatcher for allotments.
#[derive(Debug)]
pub struct AmqpAllotter {
    amqp_url: String,
    topology: Topology,
    key: JobKey,
    connection: tokio::sync::Mutex<Option<Connection>>,
}

impl AmqpAllotter {
    /// An allotter on the broker `amqp_url`, the topology `prefix` names.
    pub fn new(amqp_url: &str, prefix: &str, key: JobKey) -> AmqpAllotter {
        AmqpAllotter {
            amqp_url: amqp_url.to_string(),
            topology: Topology::new(prefix),
            key,
            connection: tokio::sync::Mutex::new(None),
        }
    }

    async fn ask(&self, query: AllotmentQuery) -> Allotted {
        let channel = {
            let mut connection = self.connection.lock().await;
            if !connection.as_ref().is_some_and(|c| c.status().connected()) {
                let opened = amqp::connect(&self.amqp_url, "forgepool-worker-allotments")
                    .await
                    .map_err(|e| e.to_string())?;
                *connection = Some(opened);
            }
            let Some(connection) = connection.as_ref() else {
                return Err("no connection to the broker".into());
            };
            amqp::open_channel(connection)
                .await
                .map_err(|e| e.to_string())?
        };
        let payload = serde_json::to_vec(&query).unwrap_or_default();
        let asked = tokio::time::timeout(
            ANSWER_WAIT,
            super::execution::question(
                &channel,
                &self.topology.allotments(),
                &payload,
                |body, signature| AllotmentAnswer::read(body, signature, &self.key, &query),
            ),
        )
        .await;
        let _ = tokio::time::timeout(ANSWER_WAIT, channel.close(200, "answered".into())).await;
        match asked {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err(format!(
                "the dispatcher did not answer within {ANSWER_WAIT:?} (is it running?)"
            )),
        }
    }
}

impl Allotter for AmqpAllotter {
    fn allot(&self, query: AllotmentQuery) -> Pin<Box<dyn Future<Output = Allotted> + Send + '_>> {
        Box::pin(self.ask(query))
    }
}
