//! The model gateway (SPEC 16): each worker's reverse proxy between stage containers and
//! model providers.
//!
//! In the data flow it sits beside the stage containers. Before a stage of a profile with a
//! `provider` starts, the engine asks the [`Gateway`] for a [`Pass`]: a token valid for that
//! stage alone, bound to its run, profile, provider and container. The stage gets the token
//! and the gateway's address as its CLI's key and base URL; the real key stays in the
//! worker's memory. A request reaches the gateway through the relay container on the worker's
//! internal network ([`relay`]), which says which container sent it; the gateway checks the
//! token, its container and the route ([`api`]), reserves the request's worst case against
//! the run's budget ([`ledger`]), forwards it with the key, and meters the answer as it flows
//! back ([`meter`]). What it reads of a request is only the fields that decide its worst case
//! and reach ([`request`]); what it forwards either way is by allowlist ([`policy`]), the
//! key masked in every answer. A provider's rate-limit answer to a spending call pauses the
//! profile on this gateway and halts the stage (the engine pauses the run, and the profile
//! across the pool, until the reset); free routes are rate-limited per stage and pause
//! nothing. A request whose worst case does not fit in what is left of the run's (or the
//! day's) budget is refused before it is sent, and halts the stage. When the stage ends the
//! engine closes its pass and takes the stage's usage of record from it.

mod amount;
pub mod api;
mod conns;
pub mod daily;
pub mod ledger;
mod listen;
pub mod meter;
mod metered;
pub mod policy;
pub mod providers;
pub mod relay;
pub mod request;
mod reset;
mod server;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub use api::Api;
pub use ledger::{Amount, Limits};
pub use listen::{serve_tcp, serve_unix};
pub use providers::{Provider, Providers};

/// The header line the relay sends before each connection's bytes: the sender's address.
pub const PEER_PREFACE: &str = "FORGEPOOL-PEER ";
/// The port the relay listens on inside the worker's internal network.
pub const RELAY_PORT: u16 = 8480;
/// The socket file the gateway listens on, in its folder.
pub const SOCKET_NAME: &str = "gateway.sock";
/// Where the relay container sees the gateway's folder.
pub const RELAY_MOUNT: &str = "/gateway";

/// Token counts of one answer, a stage or a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    /// Uncached prompt tokens.
    pub input: u64,
    /// Completion tokens.
    pub output: u64,
    /// Prompt tokens read from the cache.
    pub cache_read: u64,
    /// Prompt tokens written to the cache.
    pub cache_write: u64,
    /// The model that answered (the last one named).
    pub model: Option<String>,
}

impl Counts {
    /// Every token together.
    pub fn total(&self) -> u64 {
        self.input + self.output + self.cache_read + self.cache_write
    }

    /// Keeps each figure given at its largest (streams repeat running totals).
    pub fn keep_max(
        &mut self,
        input: Option<u64>,
        output: Option<u64>,
        cache_read: Option<u64>,
        cache_write: Option<u64>,
    ) {
        for (field, value) in [
            (&mut self.input, input),
            (&mut self.output, output),
            (&mut self.cache_read, cache_read),
            (&mut self.cache_write, cache_write),
        ] {
            if let Some(value) = value {
                *field = (*field).max(value);
            }
        }
    }

    /// Records the model an answer names: printable, at most 100 characters.
    pub fn set_model(&mut self, model: &str) {
        let clean: String = model
            .chars()
            .filter(|c| !c.is_control())
            .take(100)
            .collect();
        if !clean.is_empty() {
            self.model = Some(clean);
        }
    }

    /// Adds another answer's counts.
    pub fn add(&mut self, other: &Counts) {
        self.input += other.input;
        self.output += other.output;
        self.cache_read += other.cache_read;
        self.cache_write += other.cache_write;
        if other.model.is_some() {
            self.model.clone_from(&other.model);
        }
    }
}

/// What a stage's calls came to, read when its pass is closed.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageMeter {
    /// The tokens metered.
    pub counts: Counts,
    /// Their price.
    pub cost_usd: f64,
    /// Requests forwarded.
    pub requests: u64,
    /// Why a request was refused for the run's budget, if one was.
    pub exhausted: Option<String>,
    /// The provider's rate limit the stage hit: until when, and why.
    pub rate_limited: Option<(SystemTime, String)>,
}

/// What a pass is for.
#[derive(Debug, Clone)]
pub struct PassRequest {
    /// The run.
    pub run_id: Uuid,
    /// The profile.
    pub profile: String,
    /// The provider the profile names.
    pub provider: String,
    /// The stage container's name: only it may use the token.
    pub container: String,
    /// The run's budget.
    pub limits: Limits,
    /// What the run spent before this execution.
    pub spent: Amount,
    /// How long the token may live at most (the stage's time limit and a margin).
    pub lifetime: Duration,
    /// Whether the profile has a daily budget: its calls also spend the pool's allotments.
    pub daily_budget: bool,
    /// The server-side tools the profile allows by name (`web_search`, `mcp`, …): a request
    /// naming any other is refused (SPEC 16).
    pub server_tools: Vec<String>,
}

/// Finds a container's address on the internal network, so a token is used only from the
/// container it was made for.
pub trait PeerCheck: Send + Sync + std::fmt::Debug {
    /// The address of `container`, when it runs.
    fn address(
        &self,
        container: &str,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<IpAddr>> + Send + '_>>;
}

#[derive(Debug)]
struct GrantState {
    request: PassRequest,
    expires: Instant,
    halt: CancellationToken,
    peer: Mutex<Option<IpAddr>>,
    meter: Mutex<StageMeter>,
    /// The request bodies this stage may hold at once, in bytes.
    bodies: Arc<tokio::sync::Semaphore>,
    /// This stage's calls of free routes in the current minute: when it began, how many.
    free_calls: Mutex<(Instant, u32)>,
}

impl GrantState {
    /// Counts a call of a free route; false past [`server::FREE_CALLS_PER_MINUTE`] in the
    /// current minute.
    fn free_call(&self) -> bool {
        let mut window = self.free_calls.lock().unwrap_or_else(|p| p.into_inner());
        if window.0.elapsed() >= Duration::from_secs(60) {
            *window = (Instant::now(), 0);
        }
        window.1 += 1;
        window.1 <= server::FREE_CALLS_PER_MINUTE
    }
}

/// A stage's pass: its token, and the signal that the gateway halted the stage (a spent
/// budget, a rate limit). Dropping it revokes the token.
#[derive(Debug)]
pub struct Pass {
    token: String,
    profile: String,
    base_url: String,
    api: Api,
    key_env: String,
    halt: CancellationToken,
    gateway: Arc<Gateway>,
    closed: bool,
}

impl Pass {
    /// The token the stage sends instead of a key.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The base URL the stage's CLI is given (the API's suffix included).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The provider's API.
    pub fn api(&self) -> Api {
        self.api
    }

    /// The worker's variable holding the provider's real key (its value is redacted).
    pub fn key_env(&self) -> &str {
        &self.key_env
    }

    /// The profile the pass is for.
    pub fn profile(&self) -> &str {
        &self.profile
    }

    /// The provider's rate limit the stage hit, so far: until when, and why.
    pub fn rate_limited(&self) -> Option<(SystemTime, String)> {
        let grant = self.gateway.grant(&self.token)?;
        let meter = grant.meter.lock().unwrap_or_else(|p| p.into_inner());
        meter.rate_limited.clone()
    }

    /// Cancelled when the gateway halts the stage.
    pub fn halted(&self) -> CancellationToken {
        self.halt.clone()
    }

    /// Revokes the token and returns what the stage's calls came to.
    pub fn close(mut self) -> StageMeter {
        self.closed = true;
        self.gateway.revoke(&self.token).unwrap_or_default()
    }
}

impl Drop for Pass {
    fn drop(&mut self) {
        if !self.closed {
            self.gateway.revoke(&self.token);
        }
    }
}

/// Why a pass cannot be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PassError {
    /// The profile names a provider this worker does not know.
    #[error("the profile names the provider `{0}`, which this worker's providers (built-in and FORGEPOOL_PROVIDERS_FILE) do not have")]
    UnknownProvider(String),
    /// The worker has no key for it.
    #[error("the worker has no key for the provider `{provider}`: set {key_env} in the worker's environment")]
    NoKey {
        /// The provider.
        provider: String,
        /// Its key variable.
        key_env: String,
    },
    /// The gateway is not running on this worker.
    #[error("this worker runs no model gateway")]
    NoGateway,
    /// The profile has a daily budget and nothing allots it.
    #[error("the profile has a daily_budget, and this worker's gateway has nowhere to ask for its share (no dispatcher)")]
    NoAllotter,
}

/// The gateway's shared state.
#[derive(Debug)]
pub struct Gateway {
    providers: Providers,
    keys: HashMap<String, String>,
    clients: HashMap<String, reqwest::Client>,
    grants: Mutex<HashMap<String, Arc<GrantState>>>,
    ledger: Arc<ledger::Ledger>,
    daily: Option<Arc<daily::DailyBudgets>>,
    pauses: Mutex<HashMap<(String, String), SystemTime>>,
    peers: Option<Arc<dyn PeerCheck>>,
    metrics: Option<Arc<telemetry::Metrics>>,
    /// The root the stages reach the gateway at (`http://relay:port`).
    root: String,
    /// The request bodies every stage together may hold at once, in bytes.
    bodies: Arc<tokio::sync::Semaphore>,
}

/// The gateway's settings.
#[derive(Debug, Default)]
pub struct Settings {
    /// The providers.
    pub providers: Option<Providers>,
    /// Keys by variable name; the worker's environment when `None`.
    pub keys: Option<HashMap<String, String>>,
    /// How a token's container is found.
    pub peers: Option<Arc<dyn PeerCheck>>,
    /// The metrics.
    pub metrics: Option<Arc<telemetry::Metrics>>,
    /// The root the stages reach the gateway at.
    pub root: String,
    /// Where profiles' daily budgets are allotted from; a profile with one gets no pass
    /// without it.
    pub allotter: Option<Arc<dyn daily::Allotter>>,
}

impl Gateway {
    /// A gateway: keys are read once, here, from the given map or the worker's environment;
    /// a provider without a key stays unusable (its stages fail saying which variable to
    /// set). Each provider gets its own HTTP client (its CA file beside the system roots).
    pub fn new(settings: Settings) -> Result<Arc<Gateway>, String> {
        let providers = settings.providers.unwrap_or_else(Providers::builtin);
        let mut keys = HashMap::new();
        let mut clients = HashMap::new();
        for provider in providers.iter() {
            let key = match &settings.keys {
                Some(map) => map.get(&provider.key_env).cloned(),
                None => std::env::var(&provider.key_env).ok(),
            };
            if let Some(key) = key.filter(|k| !k.is_empty()) {
                keys.insert(provider.name.clone(), key);
            }
            clients.insert(provider.name.clone(), server::client_for(provider)?);
        }
        Ok(Arc::new(Gateway {
            providers,
            keys,
            clients,
            grants: Mutex::new(HashMap::new()),
            ledger: Arc::new(ledger::Ledger::default()),
            daily: settings.allotter.map(daily::DailyBudgets::new),
            pauses: Mutex::new(HashMap::new()),
            peers: settings.peers,
            metrics: settings.metrics,
            root: settings.root.trim_end_matches('/').to_string(),
            bodies: Arc::new(tokio::sync::Semaphore::new(server::MAX_HELD_BODIES)),
        }))
    }

    /// The providers it forwards to.
    pub fn providers(&self) -> &Providers {
        &self.providers
    }

    /// Every key it holds, to redact from whatever a stage prints.
    pub fn keys(&self) -> Vec<String> {
        self.keys.values().cloned().collect()
    }

    /// Issues a stage's pass.
    pub fn pass(self: &Arc<Gateway>, request: PassRequest) -> Result<Pass, PassError> {
        let provider = self
            .providers
            .get(&request.provider)
            .ok_or_else(|| PassError::UnknownProvider(request.provider.clone()))?;
        if !self.keys.contains_key(&provider.name) {
            return Err(PassError::NoKey {
                provider: provider.name.clone(),
                key_env: provider.key_env.clone(),
            });
        }
        if request.daily_budget {
            match &self.daily {
                Some(daily) => daily.join(&request.profile),
                None => return Err(PassError::NoAllotter),
            }
        }
        let token = format!("fpg-{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
        let halt = CancellationToken::new();
        let base_url = format!(
            "{}/{}{}",
            self.root,
            provider.name,
            provider.api.base_suffix()
        );
        self.ledger
            .open(request.run_id, request.limits, request.spent);
        let profile = request.profile.clone();
        let state = GrantState {
            expires: Instant::now() + request.lifetime,
            halt: halt.clone(),
            peer: Mutex::new(None),
            meter: Mutex::new(StageMeter::default()),
            bodies: Arc::new(tokio::sync::Semaphore::new(server::MAX_REQUEST_BODY)),
            free_calls: Mutex::new((Instant::now(), 0)),
            request,
        };
        self.grants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token.clone(), Arc::new(state));
        Ok(Pass {
            profile,
            token,
            base_url,
            api: provider.api,
            key_env: provider.key_env.clone(),
            halt,
            gateway: Arc::clone(self),
            closed: false,
        })
    }

    fn revoke(&self, token: &str) -> Option<StageMeter> {
        let state = self
            .grants
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(token)?;
        self.ledger.close(state.request.run_id);
        if let (true, Some(daily)) = (state.request.daily_budget, &self.daily) {
            daily.leave(&state.request.profile);
        }
        let meter = state
            .meter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Some(meter)
    }

    fn grant(&self, token: &str) -> Option<Arc<GrantState>> {
        let grants = self.grants.lock().unwrap_or_else(|p| p.into_inner());
        grants.get(token).cloned()
    }

    /// Until when `profile` may not call `provider`, if a rate limit said so.
    fn paused(&self, profile: &str, provider: &str) -> Option<SystemTime> {
        let mut pauses = self.pauses.lock().unwrap_or_else(|p| p.into_inner());
        let key = (profile.to_string(), provider.to_string());
        match pauses.get(&key) {
            Some(until) if *until > SystemTime::now() => Some(*until),
            Some(_) => {
                pauses.remove(&key);
                None
            }
            None => None,
        }
    }

    fn record_pause(&self, grant: &GrantState, until: SystemTime, reason: String) {
        let request = &grant.request;
        self.pauses
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((request.profile.clone(), request.provider.clone()), until);
        grant
            .meter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rate_limited = Some((until, reason.clone()));
        tracing::info!(profile = %request.profile, provider = %request.provider, %reason, "the provider rate-limited the profile; its stage is halted and paused");
        grant.halt.cancel();
    }
}
