//! What budgets count in: limits, amounts of tokens and money, and the refusal when one is
//! spent. Shared by a run's ledger and a profile's daily allotment.

/// A run's limits (SPEC 4's `budget`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    /// The most tokens of every kind together.
    pub max_tokens: Option<u64>,
    /// The most US dollars.
    pub max_cost_usd: Option<f64>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.max_tokens.is_some() || self.max_cost_usd.is_some()
    }
}

/// An amount of tokens and money.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Amount {
    /// Tokens of every kind.
    pub tokens: u64,
    /// US dollars.
    pub cost_usd: f64,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq)]
pub struct Exhausted(pub String);
