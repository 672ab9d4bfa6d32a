//! Profiles' daily budgets, across the pool: this gateway spends only what the pool's
//! [`Allotter`] (the dispatcher, in distributed mode) allotted it today, and asks for more when
//! a request's worst case does not fit in what is left (it asks for the shortfall). The
//! allotter grants only what fits in what remains of the day (`proto::allotment::grant`), so
//! however many gateways race, the day's spending stays within the limit while reservations
//! bound what providers bill. What a gateway did not spend goes back when its last stage of
//! the profile ends.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use proto::allotment::{day_of, AllotmentQuery, Spend};
use uuid::Uuid;

use crate::amount::{Amount, Exhausted};

/// How many times one request asks for more before it gives up (others kept taking what was
/// allotted for it).
const MAX_ASKS: usize = 8;

/// What a gateway asks the pool for, and what it gets.
pub type Allotted = Result<proto::allotment::AllotmentAnswer, String>;

/// Where a gateway's allotments come from: the dispatcher (over the broker) or, in one
/// process, [`LocalAllotter`].
pub trait Allotter: Send + Sync + std::fmt::Debug {
    /// Asks for `query.want` and hands back `query.returned`; an error when nobody answered.
    fn allot(&self, query: AllotmentQuery) -> Pin<Box<dyn Future<Output = Allotted> + Send + '_>>;
}

/// One profile's account on this gateway, for one day.
#[derive(Debug, Default)]
struct Account {
    day: String,
    allotted: Amount,
    used: Amount,
    reserved: Amount,
    /// Open passes of the profile: the last one hands back what is left.
    holders: usize,
}

impl Account {
    fn fits(&self, worst: Amount) -> bool {
        self.used.tokens + self.reserved.tokens + worst.tokens <= self.allotted.tokens
            && self.used.cost_usd + self.reserved.cost_usd + worst.cost_usd
                <= self.allotted.cost_usd + 1e-12
    }

    fn left(&self) -> Amount {
        Amount {
            tokens: self
                .allotted
                .tokens
                .saturating_sub(self.used.tokens + self.reserved.tokens),
            cost_usd: (self.allotted.cost_usd - self.used.cost_usd - self.reserved.cost_usd)
                .max(0.0),
        }
    }
}

/// This gateway's daily accounts.
#[derive(Debug)]
pub struct DailyBudgets {
    allotter: Arc<dyn Allotter>,
    accounts: Mutex<HashMap<String, Account>>,
    /// One question at a time per profile.
    asking: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A request's worst case held against its profile's allotment.
#[derive(Debug)]
pub struct DailyHold {
    budgets: Arc<DailyBudgets>,
    profile: String,
    day: String,
    amount: Amount,
    settled: bool,
}

/// Why a daily budget refused a request.
#[derive(Debug)]
pub enum Refused {
    /// The day's budget is spent: the profile waits for the next day.
    Spent(String),
    /// Nobody answered the question (no dispatcher): try again later.
    Unknown(String),
}

fn spend(amount: Amount) -> Spend {
    Spend {
        tokens: amount.tokens,
        cost_usd: amount.cost_usd,
    }
}

impl DailyBudgets {
    /// Accounts fed by `allotter`.
    pub fn new(allotter: Arc<dyn Allotter>) -> Arc<DailyBudgets> {
        Arc::new(DailyBudgets {
            allotter,
            accounts: Mutex::new(HashMap::new()),
            asking: Mutex::new(HashMap::new()),
        })
    }

    fn accounts(&self) -> std::sync::MutexGuard<'_, HashMap<String, Account>> {
        self.accounts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A pass of `profile` opens.
    pub fn join(&self, profile: &str) {
        self.accounts()
            .entry(profile.to_string())
            .or_default()
            .holders += 1;
    }

    /// A pass of `profile` closes; the last hands back what is left of today's allotment.
    pub fn leave(self: &Arc<DailyBudgets>, profile: &str) {
        let returned = {
            let mut accounts = self.accounts();
            let Some(account) = accounts.get_mut(profile) else {
                return;
            };
            account.holders = account.holders.saturating_sub(1);
            if account.holders > 0 || account.reserved.tokens > 0 {
                return;
            }
            let left = account.left();
            let day = account.day.clone();
            accounts.remove(profile);
            (left.tokens > 0 || left.cost_usd > 0.0).then_some((day, left))
        };
        let Some((day, left)) = returned else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let budgets = Arc::clone(self);
        let query = AllotmentQuery {
            schema_version: proto::SCHEMA_VERSION,
            profile: profile.to_string(),
            day,
            want: Spend::default(),
            returned: spend(left),
            nonce: Uuid::new_v4(),
        };
        runtime.spawn(async move {
            if let Err(reason) = budgets.allotter.allot(query).await {
                tracing::warn!(%reason, "cannot hand back an unspent daily allotment; it counts as spent today");
            }
        });
    }

    /// Holds `worst` against `profile`'s allotment, asking the pool for more when it does not
    /// fit.
    pub async fn reserve(
        self: &Arc<DailyBudgets>,
        profile: &str,
        worst: Amount,
    ) -> Result<DailyHold, Refused> {
        for _ in 0..MAX_ASKS {
            if let Some(hold) = self.try_hold(profile, worst) {
                return Ok(hold);
            }
            let lock = {
                let mut asking = self.asking.lock().unwrap_or_else(|p| p.into_inner());
                Arc::clone(asking.entry(profile.to_string()).or_default())
            };
            let _asking = lock.lock().await;
            // Another request may have been allotted enough for this one meanwhile.
            if let Some(hold) = self.try_hold(profile, worst) {
                return Ok(hold);
            }
            let day = day_of(SystemTime::now());
            // Only what the account lacks: what is left of its allotment counts.
            let left = self
                .accounts()
                .get(profile)
                .filter(|a| a.day == day)
                .map(Account::left)
                .unwrap_or_default();
            let want = Amount {
                tokens: worst.tokens.saturating_sub(left.tokens),
                cost_usd: (worst.cost_usd - left.cost_usd).max(0.0),
            };
            let query = AllotmentQuery {
                schema_version: proto::SCHEMA_VERSION,
                profile: profile.to_string(),
                day: day.clone(),
                want: spend(want),
                returned: Spend::default(),
                nonce: Uuid::new_v4(),
            };
            let answer = self.allotter.allot(query).await.map_err(Refused::Unknown)?;
            if let Some(reason) = answer.refused {
                return Err(Refused::Spent(reason));
            }
            let mut accounts = self.accounts();
            let account = accounts.entry(profile.to_string()).or_default();
            if account.day != day {
                *account = Account {
                    day,
                    holders: account.holders,
                    ..Account::default()
                };
            }
            account.allotted.tokens += answer.granted.tokens;
            account.allotted.cost_usd += answer.granted.cost_usd;
        }
        Err(Refused::Unknown(format!(
            "the profile's daily allotment was taken by other requests {MAX_ASKS} times over; try again"
        )))
    }

    fn try_hold(self: &Arc<DailyBudgets>, profile: &str, worst: Amount) -> Option<DailyHold> {
        let today = day_of(SystemTime::now());
        let mut accounts = self.accounts();
        let account = accounts.entry(profile.to_string()).or_default();
        if account.day != today {
            // Yesterday's allotment is void (its day is over); today's starts empty.
            *account = Account {
                day: today.clone(),
                holders: account.holders,
                ..Account::default()
            };
        }
        if !account.fits(worst) {
            return None;
        }
        account.reserved.tokens += worst.tokens;
        account.reserved.cost_usd += worst.cost_usd;
        Some(DailyHold {
            budgets: Arc::clone(self),
            profile: profile.to_string(),
            day: today,
            amount: worst,
            settled: false,
        })
    }
}

impl DailyHold {
    /// Replaces the held worst case with what the request spent.
    pub fn settle(mut self, actual: Amount) {
        self.settled = true;
        self.release(actual);
    }

    fn release(&self, actual: Amount) {
        let mut accounts = self.budgets.accounts();
        if let Some(account) = accounts.get_mut(&self.profile) {
            if account.day == self.day {
                account.reserved.tokens =
                    account.reserved.tokens.saturating_sub(self.amount.tokens);
                account.reserved.cost_usd =
                    (account.reserved.cost_usd - self.amount.cost_usd).max(0.0);
                account.used.tokens += actual.tokens;
                account.used.cost_usd += actual.cost_usd;
            }
        }
    }
}

impl Drop for DailyHold {
    fn drop(&mut self) {
        if !self.settled {
            // Nothing was metered (see `ledger::Reservation`): the hold is released.
            self.release(Amount::default());
        }
    }
}

/// The pool's allotments kept in this process (`forgepool run`, tests): the same grants as
/// the dispatcher's, from limits given per profile.
#[derive(Debug, Default)]
pub struct LocalAllotter {
    limits: HashMap<String, proto::Budget>,
    totals: Mutex<HashMap<(String, String), Spend>>,
}

impl LocalAllotter {
    /// An allotter for these profiles' daily limits.
    pub fn new(limits: HashMap<String, proto::Budget>) -> LocalAllotter {
        LocalAllotter {
            limits,
            totals: Mutex::new(HashMap::new()),
        }
    }

    /// What it has allotted `profile` today, net of what came back.
    pub fn allotted(&self, profile: &str) -> Spend {
        let key = (profile.to_string(), day_of(SystemTime::now()));
        let totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        totals.get(&key).copied().unwrap_or_default()
    }
}

impl Allotter for LocalAllotter {
    fn allot(&self, query: AllotmentQuery) -> Pin<Box<dyn Future<Output = Allotted> + Send + '_>> {
        let day = day_of(SystemTime::now());
        let mut answer = proto::allotment::AllotmentAnswer {
            schema_version: proto::SCHEMA_VERSION,
            nonce: query.nonce,
            day: day.clone(),
            granted: Spend::default(),
            refused: None,
        };
        match self.limits.get(&query.profile) {
            None => {
                answer.refused = Some(format!(
                    "the profile {:?} has no daily_budget",
                    query.profile
                ));
            }
            Some(limits) => {
                let mut totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
                let total = totals
                    .entry((query.profile.clone(), day.clone()))
                    .or_default();
                let returned = if query.day == day {
                    query.returned
                } else {
                    Spend::default()
                };
                let (new_total, granted) =
                    proto::allotment::allot(&query.profile, limits, *total, query.want, returned);
                *total = new_total;
                match granted {
                    Ok(granted) => answer.granted = granted,
                    Err(reason) => answer.refused = Some(reason),
                }
            }
        }
        Box::pin(async move { Ok(answer) })
    }
}

impl From<Refused> for Exhausted {
    fn from(refused: Refused) -> Exhausted {
        match refused {
            Refused::Spent(reason) | Refused::Unknown(reason) => Exhausted(reason),
        }
    }
}
