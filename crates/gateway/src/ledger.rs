//! Budgets, enforced before each call: a request's worst case is **reserved** against its
//! run's budget before it is forwarded, and **settled** with the metered figure after. A
//! request is admitted only while the run's spent plus reserved amount is under every limit,
//! so however many requests race, the run overshoots its budget by at most the reservation of
//! the one that was admitted last (and not at all when reservations hold the real figures,
//! which they bound: input tokens are at most the request's bytes, output at most its limit).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use uuid::Uuid;

pub use crate::amount::{Amount, Exhausted, Limits};
use crate::daily::DailyHold;

#[derive(Debug)]
struct Account {
    limits: Limits,
    spent: Amount,
    reserved: Amount,
    /// Stage grants open on this run: the account goes with the last.
    holders: usize,
}

/// Every open run's account.
#[derive(Debug, Default)]
pub struct Ledger {
    accounts: Mutex<HashMap<Uuid, Account>>,
}

/// A reserved worst case; settled with the real figure, or with what was metered when it is
/// dropped unsettled (an answer cut short).
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Ledger>,
    run: Uuid,
    amount: Amount,
    settled: bool,
    /// The same worst case held against the profile's daily allotment, when it has one.
    daily: Option<DailyHold>,
}

impl Ledger {
    /// Opens (or joins) the account of `run`, which has already spent `spent` (its usage of
    /// record before this execution). The limits are the frozen job's.
    pub fn open(&self, run: Uuid, limits: Limits, spent: Amount) {
        let mut accounts = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        let account = accounts.entry(run).or_insert(Account {
            limits,
            spent,
            reserved: Amount::default(),
            holders: 0,
        });
        account.holders += 1;
    }

    /// Leaves the account of `run`; the last holder closes it.
    pub fn close(&self, run: Uuid) {
        let mut accounts = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(account) = accounts.get_mut(&run) {
            account.holders = account.holders.saturating_sub(1);
            if account.holders == 0 {
                accounts.remove(&run);
            }
        }
    }

    /// What `run` has spent so far, settled requests only.
    pub fn spent(&self, run: Uuid) -> Option<Amount> {
        let accounts = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        accounts.get(&run).map(|a| a.spent)
    }

    /// Reserves `worst` for a request of `run`, or says which limit is spent.
    pub fn reserve(self: &Arc<Ledger>, run: Uuid, worst: Amount) -> Result<Reservation, Exhausted> {
        let mut accounts = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        let account = accounts
            .get_mut(&run)
            .ok_or_else(|| Exhausted("the run's budget account is closed".to_string()))?;
        let committed = Amount {
            tokens: account.spent.tokens + account.reserved.tokens,
            cost_usd: account.spent.cost_usd + account.reserved.cost_usd,
        };
        if let Some(max) = account.limits.max_tokens {
            if committed.tokens >= max {
                return Err(Exhausted(format!(
                    "budget exhausted: the run has spent or reserved {} of its {max} tokens (budget.max_tokens)",
                    committed.tokens
                )));
            }
        }
        if let Some(max) = account.limits.max_cost_usd {
            if committed.cost_usd >= max {
                return Err(Exhausted(format!(
                    "budget exhausted: the run has spent or reserved ${:.4} of its ${max:.2} (budget.max_cost_usd)",
                    committed.cost_usd
                )));
            }
        }
        account.reserved.tokens += worst.tokens;
        account.reserved.cost_usd += worst.cost_usd;
        Ok(Reservation {
            ledger: Arc::clone(self),
            run,
            amount: worst,
            settled: false,
            daily: None,
        })
    }

    fn settle(&self, run: Uuid, reserved: Amount, actual: Amount) {
        let mut accounts = self.accounts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(account) = accounts.get_mut(&run) {
            account.reserved.tokens = account.reserved.tokens.saturating_sub(reserved.tokens);
            account.reserved.cost_usd = (account.reserved.cost_usd - reserved.cost_usd).max(0.0);
            account.spent.tokens += actual.tokens;
            account.spent.cost_usd += actual.cost_usd;
        }
    }
}

impl Reservation {
    /// Replaces the reservation with what the request really spent.
    pub fn settle(mut self, actual: Amount) {
        self.settled = true;
        self.ledger.settle(self.run, self.amount, actual);
        if let Some(daily) = self.daily.take() {
            daily.settle(actual);
        }
    }

    /// Adds the hold on the profile's daily allotment, settled with this reservation.
    pub fn with_daily(mut self, hold: DailyHold) -> Reservation {
        self.daily = Some(hold);
        self
    }

    /// The reserved worst case.
    pub fn amount(&self) -> Amount {
        self.amount
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            // Nothing was metered: the request never reached the provider, or its answer
            // was lost before any usage; what it may have spent is unknown, so the
            // reservation is released and the next answer's figures count.
            self.ledger.settle(self.run, self.amount, Amount::default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worst(tokens: u64) -> Amount {
        Amount {
            tokens,
            cost_usd: tokens as f64 / 1000.0,
        }
    }

    /// Catches: a budget checked against spent figures only (concurrent requests all pass,
    /// LiteLLM's race), or one that refuses while budget remains.
    #[test]
    fn concurrent_reservations_stop_at_the_budget() {
        let ledger = Arc::new(Ledger::default());
        let run = Uuid::new_v4();
        ledger.open(
            run,
            Limits {
                max_tokens: Some(1000),
                max_cost_usd: None,
            },
            Amount::default(),
        );
        let mut held = Vec::new();
        for _ in 0..64 {
            if let Ok(reservation) = ledger.reserve(run, worst(300)) {
                held.push(reservation);
            }
        }
        // 0, 300, 600, 900 are under 1000: four admitted, the fifth sees 1200.
        assert_eq!(held.len(), 4);
        for reservation in held {
            reservation.settle(worst(250));
        }
        assert_eq!(ledger.spent(run).unwrap().tokens, 1000);
        let refused = ledger.reserve(run, worst(1)).unwrap_err();
        assert!(refused.0.contains("budget.max_tokens"), "{}", refused.0);
    }

    /// Catches: a dropped reservation that keeps holding budget, or earlier spending of the
    /// run (before a resume) forgotten.
    #[test]
    fn a_dropped_reservation_frees_its_amount_and_past_spending_counts() {
        let ledger = Arc::new(Ledger::default());
        let run = Uuid::new_v4();
        let limits = Limits {
            max_tokens: None,
            max_cost_usd: Some(1.0),
        };
        ledger.open(
            run,
            limits,
            Amount {
                tokens: 0,
                cost_usd: 0.5,
            },
        );
        drop(ledger.reserve(run, worst(600)).unwrap());
        // Spent 0.5 and nothing reserved: admitted, reserving 0.6.
        let first = ledger.reserve(run, worst(600)).unwrap();
        // 0.5 spent + 0.6 reserved is past 1.0.
        assert!(ledger.reserve(run, worst(1)).is_err());
        first.settle(worst(100));
        assert!(ledger.reserve(run, worst(1)).is_ok());
        ledger.close(run);
        assert!(ledger.spent(run).is_none());
    }
}
