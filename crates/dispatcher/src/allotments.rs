//! Profiles' daily budgets (SPEC 16): the dispatcher allots shares of each profile's budget
//! to the pool's gateways from its store (`proto::allotment`), answering each gateway's
//! question signed with the job key on its direct reply-to queue.
//!
//! The limits are the dispatcher's own agents file's, never a worker's say: a profile the file
//! does not hold, or holds without a daily budget, is refused.
//!
//! `Dispatcher::allot` reads the profile's `daily_budget` from that file and calls
//! `RunStore::allot`, which grants or refuses under one locked row of `daily_allotments` per
//! profile and UTC day (migration `V4`).

use proto::allotment::{AllotmentAnswer, AllotmentQuery, Spend};
use proto::amqp::{self, Delivery};
use tracing::warn;

use crate::dispatcher::Dispatcher;
use crate::store::{Allot, RunStore, StoreError};

/// The largest allotment question read.
const MAX_QUESTION_BYTES: usize = 16 * 1024;

impl Dispatcher {
    /// Allots a share of `query.profile`'s daily budget for today (the dispatcher's UTC day),
    /// taking back what the gateway hands back for that same day.
    pub(crate) async fn allot(
        &self,
        query: &AllotmentQuery,
    ) -> Result<AllotmentAnswer, StoreError> {
        let day = proto::allotment::day_of(std::time::SystemTime::now());
        let answer = |granted: Spend, refused: Option<String>| AllotmentAnswer {
            schema_version: proto::SCHEMA_VERSION,
            nonce: query.nonce,
            day: day.clone(),
            granted,
            refused,
        };
        if let Some(refused) = query.refusal() {
            return Ok(answer(Spend::default(), Some(refused)));
        }
        let Some(limits) = self
            .agents
            .get(&query.profile)
            .and_then(|profile| profile.daily_budget.clone())
        else {
            return Ok(answer(
                Spend::default(),
                Some(format!(
                    "the dispatcher's agents file gives the profile {:?} no daily_budget",
                    query.profile
                )),
            ));
        };
        let returned = if query.day == day {
            query.returned
        } else {
            Spend::default()
        };
        let allot = Allot {
            profile: query.profile.clone(),
            day: day.clone(),
            limits,
            want: query.want,
            returned,
        };
        Ok(match self.store.allot(allot).await? {
            Ok(granted) => answer(granted, None),
            Err(refused) => answer(Spend::default(), Some(refused)),
        })
    }
}

/// Answers a gateway's question (signed, to its `reply_to`). Nothing is answered when the
/// store cannot say: the gateway's wait ends and its request is refused for now.
pub(crate) async fn answer_allotment(dispatcher: &Dispatcher, delivery: &Delivery) {
    let query = match proto::decode_message::<AllotmentQuery>(&delivery.data, MAX_QUESTION_BYTES) {
        Ok(query) => query,
        Err(reason) => return warn!(%reason, "ignoring a malformed allotment question"),
    };
    let Some(reply_to) = delivery.properties.reply_to().as_ref() else {
        return warn!(profile = %query.profile, "ignoring an allotment question with no reply_to");
    };
    let answer = match dispatcher.allot(&query).await {
        Ok(answer) => answer,
        Err(error) => {
            return warn!(%error, profile = %query.profile, "cannot allot a daily budget yet")
        }
    };
    let payload = serde_json::to_vec(&answer).unwrap_or_default();
    let signature = AllotmentAnswer::sign(&payload, &dispatcher.job_key);
    let headers = amqp::signature_headers(signature);
    let replied = dispatcher
        .publisher
        .publish("", reply_to.as_str(), &payload, Some(headers));
    if let Err(error) = replied.await {
        warn!(%error, profile = %query.profile, "cannot answer an allotment question");
    }
}
