//! Profile gates: whether a stage of an agent profile may start now. A profile may be paused
//! across the pool (a stage exited 75 with a `pause.json`, SPEC 6) and may cap how many of
//! its stages run at once across the pool (`max_concurrent`, SPEC 5).
//!
//! The engine asks its gate before every agent stage: [`Admission::Go`] holds a cap slot
//! until its [`Ticket`] is dropped; [`Admission::Paused`] pauses the run until the profile's
//! pause ends; [`Admission::Busy`] hands the run back to wait without holding a run slot.
//! [`LocalGate`] serves one process (the embedded mode, the engine's tests); the worker's
//! gate keeps caps and pauses on the broker (`amqp::gate`).
//!
//! `Role` says which of the job's profiles a phase uses, and is its code in the
//! `x-forgepool-waits-for` header; `Pauses` holds the pauses known (the latest end wins).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use proto::{AgentProfile, PauseRequest};
use uuid::Uuid;

/// The role of an agent in a run: which of the job's profiles a stage uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The implementer (`implement` stages).
    Implementer,
    /// The reviewer (`review` stages).
    Reviewer,
    /// The final reviewer (the `final_review` stage).
    FinalReviewer,
}

impl Role {
    /// The role whose agent the phase runs; `None` for a phase that runs no agent.
    pub fn of_phase(phase: &proto::Phase) -> Option<Role> {
        match phase {
            proto::Phase::Implement { .. } => Some(Role::Implementer),
            proto::Phase::Review { .. } => Some(Role::Reviewer),
            proto::Phase::FinalReview { .. } => Some(Role::FinalReviewer),
            _ => None,
        }
    }

    /// The job's profile for this role.
    pub fn profile(self, job: &proto::Job) -> Option<&AgentProfile> {
        match self {
            Role::Implementer => Some(&job.implementer),
            Role::Reviewer => job.reviewer.as_ref(),
            Role::FinalReviewer => job.final_reviewer.as_ref(),
        }
    }

    /// The role's code in a parked job's header.
    pub fn code(self) -> u8 {
        match self {
            Role::Implementer => 1,
            Role::Reviewer => 2,
            Role::FinalReviewer => 3,
        }
    }

    /// The role a header's code names.
    pub fn from_code(code: u8) -> Option<Role> {
        match code {
            1 => Some(Role::Implementer),
            2 => Some(Role::Reviewer),
            3 => Some(Role::FinalReviewer),
            _ => None,
        }
    }
}

/// A boxed future, for the object-safe gate.
pub type GateFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Whether a stage may start.
#[derive(Debug)]
pub enum Admission {
    /// Start it; the ticket holds a cap slot of the profile until it is dropped.
    Go(Ticket),
    /// The profile is paused across the pool until the pause's end.
    Paused(PauseRequest),
    /// Every cap slot of the profile (`max`) is taken: the run waits without a run slot.
    Busy {
        /// The profile's `max_concurrent`.
        max: u32,
    },
}

/// A cap slot of a profile.
pub trait Slot: Send + Sync {
    /// Gives the slot back; done when it is free for others.
    fn release(self: Box<Self>) -> GateFuture<'static, ()>;
}

/// A cap slot held: [`Ticket::release`] gives it back (dropping it does too, later).
#[derive(Default)]
pub struct Ticket(Option<Box<dyn Slot>>);

impl Ticket {
    /// A ticket for a profile with no cap: it holds nothing.
    pub fn free() -> Ticket {
        Ticket(None)
    }

    /// A ticket holding `slot`.
    pub fn holding(slot: impl Slot + 'static) -> Ticket {
        Ticket(Some(Box::new(slot)))
    }

    /// Gives the slot back, and returns once it is free: the run's next stage of the same
    /// profile may take it at once.
    pub async fn release(mut self) {
        if let Some(slot) = self.0.take() {
            slot.release().await;
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Ticket(slot)"
        } else {
            "Ticket(free)"
        })
    }
}

/// What decides whether a profile's stage may start, and hears of a profile's pause.
pub trait ProfileGate: Send + Sync + std::fmt::Debug {
    /// Whether a stage of `profile` may start now for `run_id`.
    fn admit<'a>(&'a self, run_id: Uuid, profile: &'a AgentProfile) -> GateFuture<'a, Admission>;

    /// A stage of `profile` paused until `pause.until`: no stage of it starts before then,
    /// anywhere the gate reaches.
    fn pause<'a>(
        &'a self,
        run_id: Uuid,
        profile: &'a str,
        pause: &'a PauseRequest,
    ) -> GateFuture<'a, ()>;
}

/// The pauses of profiles known here, by profile: the latest end wins.
#[derive(Debug, Default)]
pub struct Pauses(Mutex<HashMap<String, PauseRequest>>);

impl Pauses {
    /// Notes a pause of `profile`; returns whether it is news (a later end than known).
    pub fn note(&self, profile: &str, pause: PauseRequest) -> bool {
        let mut pauses = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let later = pauses
            .get(profile)
            .is_none_or(|known| ends(known) < ends(&pause));
        if later {
            pauses.insert(profile.to_string(), pause);
        }
        later
    }

    /// The pause of `profile` still in force at `now`.
    pub fn current(&self, profile: &str, now: SystemTime) -> Option<PauseRequest> {
        let pauses = self.0.lock().unwrap_or_else(|e| e.into_inner());
        pauses
            .get(profile)
            .filter(|pause| ends(pause) > now)
            .cloned()
    }

    /// Forgets the pauses that ended by `now`, and returns their profiles.
    pub fn expire(&self, now: SystemTime) -> Vec<String> {
        let mut pauses = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let ended: Vec<String> = pauses
            .iter()
            .filter(|(_, pause)| ends(pause) <= now)
            .map(|(profile, _)| profile.clone())
            .collect();
        for profile in &ended {
            pauses.remove(profile);
        }
        ended
    }
}

fn ends(pause: &PauseRequest) -> SystemTime {
    proto::parse_time(&pause.until).unwrap_or(SystemTime::UNIX_EPOCH)
}

/// The gate of one process: pauses and caps counted in memory.
#[derive(Debug, Default)]
pub struct LocalGate {
    pauses: Pauses,
    running: Arc<Mutex<HashMap<String, u32>>>,
}

/// A slot of a [`LocalGate`]'s cap, given back when dropped.
struct LocalSlot {
    running: Arc<Mutex<HashMap<String, u32>>>,
    profile: String,
}

impl Slot for LocalSlot {
    fn release(self: Box<Self>) -> GateFuture<'static, ()> {
        drop(self);
        Box::pin(std::future::ready(()))
    }
}

impl Drop for LocalSlot {
    fn drop(&mut self) {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = running.get_mut(&self.profile) {
            *count = count.saturating_sub(1);
        }
    }
}

impl ProfileGate for LocalGate {
    fn admit<'a>(&'a self, _run_id: Uuid, profile: &'a AgentProfile) -> GateFuture<'a, Admission> {
        Box::pin(async move {
            if let Some(pause) = self.pauses.current(&profile.name, SystemTime::now()) {
                return Admission::Paused(pause);
            }
            let Some(max) = profile.max_concurrent else {
                return Admission::Go(Ticket::free());
            };
            let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
            let count = running.entry(profile.name.clone()).or_default();
            if *count >= max {
                return Admission::Busy { max };
            }
            *count += 1;
            Admission::Go(Ticket::holding(LocalSlot {
                running: Arc::clone(&self.running),
                profile: profile.name.clone(),
            }))
        })
    }

    fn pause<'a>(
        &'a self,
        _run_id: Uuid,
        profile: &'a str,
        pause: &'a PauseRequest,
    ) -> GateFuture<'a, ()> {
        Box::pin(async move {
            self.pauses.note(profile, pause.clone());
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn profile(max: Option<u32>) -> AgentProfile {
        AgentProfile {
            name: "claude".into(),
            image: "img".into(),
            command: vec![],
            env: vec![],
            network: proto::Network::None,
            memory_bytes: 1 << 30,
            cpus: 1.0,
            timeout_seconds: 60,
            user: None,
            read_only_root: true,
            disk_bytes: proto::DEFAULT_DISK_BYTES,
            egress: vec![],
            max_concurrent: max,
            kind: proto::AgentKind::Command,
            model: None,
            base_url: None,
            provider: None,
            daily_budget: None,
            args: vec![],
            pause_seconds: None,
            server_tools: Vec::new(),
        }
    }

    /// Catches: a cap that lets one too many in, a slot never given back, a pause that stops
    /// nothing or never ends.
    #[tokio::test]
    async fn caps_count_slots_and_pauses_end() {
        let gate = LocalGate::default();
        let capped = profile(Some(2));
        let run = Uuid::new_v4();
        let one = gate.admit(run, &capped).await;
        let two = gate.admit(run, &capped).await;
        assert!(matches!(one, Admission::Go(_)) && matches!(two, Admission::Go(_)));
        assert!(matches!(
            gate.admit(run, &capped).await,
            Admission::Busy { max: 2 }
        ));
        drop(one);
        assert!(matches!(gate.admit(run, &capped).await, Admission::Go(_)));
        assert!(matches!(
            gate.admit(run, &profile(None)).await,
            Admission::Go(_)
        ));

        let now = SystemTime::now();
        let soon = PauseRequest {
            reason: "rate_limit".into(),
            until: proto::format_timestamp(now + Duration::from_secs(3600)),
        };
        gate.pause(run, "claude", &soon).await;
        assert!(matches!(gate.admit(run, &profile(None)).await, Admission::Paused(p) if p == soon));
        let past = PauseRequest {
            reason: "old".into(),
            until: proto::format_timestamp(now - Duration::from_secs(5)),
        };
        assert!(
            !gate.pauses.note("claude", past),
            "an earlier end does not shorten a pause"
        );
        assert_eq!(
            gate.pauses.expire(now + Duration::from_secs(3601)),
            ["claude"]
        );
        assert!(matches!(
            gate.admit(run, &profile(None)).await,
            Admission::Go(_)
        ));
    }
}
