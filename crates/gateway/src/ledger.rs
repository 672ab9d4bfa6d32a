//! Budgets, enforced before each call: a request's worst case is **reserved** against its
//! run's budget before it is forwarded, and **settled** with the metered figure after. A
//! request is admitted only when the run's spent and reserved amount plus its own worst case
//! is within every limit, so however many requests race, the run never passes its budget
//! while reservations bound what providers bill (input tokens are at most the request's
//! bytes, output at most every answer's allowance). An answer that never states its usage
//! (cut short, or a stream not asked for it) is settled at its reservation, never at nothing.

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

/// A reserved worst case; settled with the real figure. Dropped unsettled, it is released
/// when the request never left the gateway, and spent whole once it was sent (the provider
/// may have billed it: what it cost is unknown).
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Ledger>,
    run: Uuid,
    amount: Amount,
    settled: bool,
    /// Whether the request was handed to the provider.
    sent: bool,
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
            if committed.tokens.saturating_add(worst.tokens) > max {
                return Err(Exhausted(format!(
                    "budget exhausted: the run has spent or reserved {} of its {max} tokens (budget.max_tokens), and this request may take {} more (every byte of its body and its whole output allowance)",
                    committed.tokens, worst.tokens
                )));
            }
        }
        if let Some(max) = account.limits.max_cost_usd {
            if committed.cost_usd + worst.cost_usd > max + 1e-12 {
                return Err(Exhausted(format!(
                    "budget exhausted: the run has spent or reserved ${:.4} of its ${max:.2} (budget.max_cost_usd), and this request may cost ${:.4} more (every byte of its body and its whole output allowance)",
                    committed.cost_usd, worst.cost_usd
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
            sent: false,
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

    /// Whether the request was handed to the provider: once it was, dropped unsettled, the
    /// reservation is spent whole.
    pub fn set_sent(&mut self, sent: bool) {
        self.sent = sent;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            // Never sent: nothing was spent. Sent, and lost before anything was metered: the
            // provider may have billed all of it.
            let spent = if self.sent {
                self.amount
            } else {
                Amount::default()
            };
            self.ledger.settle(self.run, self.amount, spent);
            if let Some(daily) = self.daily.take() {
                daily.settle(spent);
            }
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
    /// LiteLLM's race), a request admitted whose own worst case passes what is left, or one
    /// refused while it fits.
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
        // 300, 600 and 900 fit in 1000; a fourth would make 1200.
        assert_eq!(held.len(), 3);
        for reservation in held {
            reservation.settle(worst(250));
        }
        assert_eq!(ledger.spent(run).unwrap().tokens, 750);
        // 750 spent: a request of 250 fits exactly, one of 251 does not.
        assert!(ledger.reserve(run, worst(251)).is_err());
        ledger.reserve(run, worst(250)).unwrap().settle(worst(250));
        let refused = ledger.reserve(run, worst(1)).unwrap_err();
        assert!(refused.0.contains("budget.max_tokens"), "{}", refused.0);
    }

    /// Catches: a dropped reservation that keeps holding budget, a request lost after it was
    /// sent settled at nothing (the provider billed it), or earlier spending of the run
    /// (before a resume) forgotten.
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
        // A request of 0.6 does not fit in the 0.5 left.
        assert!(ledger.reserve(run, worst(600)).is_err());
        drop(ledger.reserve(run, worst(400)).unwrap());
        // Dropped before it was sent: nothing spent, 0.5 left.
        let first = ledger.reserve(run, worst(400)).unwrap();
        // 0.5 spent + 0.4 reserved: 0.2 more does not fit.
        assert!(ledger.reserve(run, worst(200)).is_err());
        first.settle(worst(100));
        assert!(ledger.reserve(run, worst(200)).is_ok());
        // Sent and lost before its usage: spent whole.
        let mut lost = ledger.reserve(run, worst(100)).unwrap();
        lost.set_sent(true);
        drop(lost);
        assert!((ledger.spent(run).unwrap().cost_usd - 0.7).abs() < 1e-9);
        ledger.close(run);
        assert!(ledger.spent(run).is_none());
    }
}
