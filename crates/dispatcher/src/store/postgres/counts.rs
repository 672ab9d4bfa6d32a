//! The PostgreSQL store's counters: a profile's daily allotments and a run's lost executions,
//! each changed in one locked transaction or one statement.

use proto::allotment::Spend;
use uuid::Uuid;

use super::PostgresStore;
use crate::store::{Allot, StoreError};

/// See [`crate::store::RunStore::allot`].
pub(super) async fn allot(
    store: &PostgresStore,
    allot: Allot,
) -> Result<Result<Spend, String>, StoreError> {
    store
        .bounded(async {
            let mut client = store.client().await?;
            let tx = client.transaction().await?;
            tx.execute(
                "INSERT INTO daily_allotments (profile, day) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                &[&allot.profile, &allot.day],
            )
            .await?;
            let row = tx
                .query_one(
                    "SELECT tokens, cost_usd FROM daily_allotments WHERE profile = $1 AND day = $2 FOR UPDATE",
                    &[&allot.profile, &allot.day],
                )
                .await?;
            let total = Spend {
                tokens: row.get::<_, i64>(0).max(0) as u64,
                cost_usd: row.get(1),
            };
            let (total, granted) = allot.apply(total);
            let tokens = total.tokens.min(i64::MAX as u64) as i64;
            tx.execute(
                "UPDATE daily_allotments SET tokens = $3, cost_usd = $4 WHERE profile = $1 AND day = $2",
                &[&allot.profile, &allot.day, &tokens, &total.cost_usd],
            )
            .await?;
            tx.commit().await?;
            Ok(granted)
        })
        .await
}

/// See [`crate::store::RunStore::record_lost`].
pub(super) async fn record_lost(
    store: &PostgresStore,
    run_id: Uuid,
    lost: u32,
) -> Result<u32, StoreError> {
    store
        .bounded(async {
            let row = store
                .client()
                .await?
                .query_opt(
                    "UPDATE runs SET lost_executions = GREATEST(lost_executions, $2) WHERE run_id = $1
                     RETURNING lost_executions",
                    &[&run_id.to_string(), &i64::from(lost)],
                )
                .await?;
            Ok(row.map_or(0, |r| u32::try_from(r.get::<_, i64>(0)).unwrap_or(u32::MAX)))
        })
        .await
}
