//! forgepool's Prometheus metrics (SPEC 13), shared by the dispatcher and the workers.
//!
//! Both services feed run events through [`Metrics::observe`]: a worker the events of the runs
//! it executes, the dispatcher every event it stores for the first time (so its figures are the
//! cluster-wide view, each event counted once, and they survive worker restarts). The
//! Forge-compatible families keep their names, labels and buckets; everything else is
//! `forgepool_*`. Label values are bounded: skills and steps come from the frozen job (names
//! the dispatcher validated against the skills folder, never from files an agent wrote),
//! verdicts, stages and outcomes from closed sets, queue names from the topology.
//!
//! A worker feeds it through `ObservedSink`, which wraps the AMQP sink per run. Gauges: queue
//! depths (both services read them every 5 s with passive declares, `Publisher::queue_depths`),
//! runs by state (the dispatcher, from its store), slots and containers (a worker).

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use proto::{EventKind, Job, RunState, Stage};

/// The buckets of `forge_review_duration_seconds`, as Forge defines them.
pub const REVIEW_BUCKETS: [f64; 8] = [1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0];
/// The buckets of `forgepool_stage_duration_seconds`: the review buckets plus long stages.
pub const STAGE_BUCKETS: [f64; 11] = [
    0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
];
/// The buckets of the HTTP request durations: from a quick answer to a slow store.
pub const HTTP_BUCKETS: [f64; 9] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0];
/// The buckets of queue waits and whole runs: seconds to hours.
pub const RUN_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0,
];

/// Which service the metrics belong to; a worker also counts its own containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `forgepool dispatcher`: every stored event, cluster-wide.
    Dispatcher,
    /// `forgepool worker` or `forgepool run`: the runs this process executes.
    Worker,
}

/// Every metric family forgepool serves.
#[derive(Debug)]
pub struct Metrics {
    role: Role,
    registry: Registry,
    review_cycles: IntCounterVec,
    review_verdicts: IntCounterVec,
    review_duration: HistogramVec,
    queue_depth: IntGaugeVec,
    runs_finished: IntCounterVec,
    runs_by_state: IntGaugeVec,
    stage_duration: HistogramVec,
    containers_running: IntGauge,
    broker_connected: IntGauge,
    build_info: IntGaugeVec,
    http_requests: IntCounterVec,
    http_duration: HistogramVec,
    queue_wait: HistogramVec,
    run_duration: HistogramVec,
    repair_rounds: IntCounter,
    no_progress_stops: IntCounter,
    deliveries: IntCounter,
    checks: IntCounterVec,
    broker_reconnects: IntCounterVec,
    dead_lettered: IntCounterVec,
    runs_in_progress: IntGauge,
    run_slots: IntGauge,
    agent_tokens: IntCounterVec,
    agent_cost: prometheus::CounterVec,
    profile_paused: IntGaugeVec,
    runs_waiting: IntGaugeVec,
    model_requests: IntCounterVec,
    model_tokens: IntCounterVec,
    model_cost: prometheus::CounterVec,
    model_latency: HistogramVec,
    tracker_deliveries: IntCounterVec,
    tracker_requests: IntCounterVec,
}

/// The buckets of the gateway's request durations: a refusal in microseconds to a long
/// streamed answer.
pub const MODEL_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 5.0, 15.0, 30.0, 60.0, 300.0,
];

fn counter(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("a valid counter");
    registry
        .register(Box::new(metric.clone()))
        .expect("a unique counter");
    metric
}

fn gauge(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let metric = IntGaugeVec::new(Opts::new(name, help), labels).expect("a valid gauge");
    registry
        .register(Box::new(metric.clone()))
        .expect("a unique gauge");
    metric
}

fn histogram(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> HistogramVec {
    let metric = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .expect("a valid histogram");
    registry
        .register(Box::new(metric.clone()))
        .expect("a unique histogram");
    metric
}

impl Metrics {
    /// A fresh registry with every family registered.
    pub fn new(role: Role) -> Metrics {
        let registry = Registry::new();
        let r = &registry;
        let metrics = Metrics {
            role,
            review_cycles: counter(
                r,
                "forge_review_cycles_total",
                "Review cycle files collected.",
                &["skill", "step"],
            ),
            review_verdicts: counter(
                r,
                "forge_review_verdicts_total",
                "Review verdicts, by verdict (approved, rejected).",
                &["skill", "step", "verdict"],
            ),
            review_duration: histogram(
                r,
                "forge_review_duration_seconds",
                "Wall time of reviewer containers, create to removal.",
                &["skill", "step"],
                &REVIEW_BUCKETS,
            ),
            queue_depth: gauge(
                r,
                "forge_queue_depth",
                "Messages ready in each forgepool queue, as the broker last reported.",
                &["queue_name"],
            ),
            runs_finished: counter(
                r,
                "forgepool_runs_total",
                "Runs that reached a terminal state or paused, by outcome.",
                &["outcome"],
            ),
            runs_by_state: gauge(
                r,
                "forgepool_runs_by_state",
                "Stored runs by current state (dispatcher only).",
                &["state"],
            ),
            stage_duration: histogram(
                r,
                "forgepool_stage_duration_seconds",
                "Wall time of stage containers, by stage and outcome.",
                &["stage", "outcome"],
                &STAGE_BUCKETS,
            ),
            containers_running: IntGauge::new(
                "forgepool_containers_running",
                "Stage containers this worker is running now.",
            )
            .expect("a valid gauge"),
            build_info: gauge(
                r,
                "forgepool_build_info",
                "1, with this build's version and the service's role as labels.",
                &["version", "role"],
            ),
            http_requests: counter(
                r,
                "forgepool_http_requests_total",
                "HTTP requests the dispatcher answered, by method, route (its template) and status (dispatcher).",
                &["method", "route", "status"],
            ),
            http_duration: histogram(
                r,
                "forgepool_http_request_duration_seconds",
                "Time to answer an HTTP request (the head of a response; an event stream's is its start), by method and route (dispatcher).",
                &["method", "route"],
                &HTTP_BUCKETS,
            ),
            queue_wait: histogram(
                r,
                "forgepool_queue_wait_seconds",
                "From a run's submission until a worker starts it, by skill (dispatcher).",
                &["skill"],
                &RUN_BUCKETS,
            ),
            run_duration: histogram(
                r,
                "forgepool_run_duration_seconds",
                "From a run's submission until it ends, pauses included, by skill and outcome (dispatcher).",
                &["skill", "outcome"],
                &RUN_BUCKETS,
            ),
            broker_connected: IntGauge::new(
                "forgepool_broker_connected",
                "1 while this service's main consumer is connected to RabbitMQ (it is ready), else 0.",
            )
            .expect("a valid gauge"),
            repair_rounds: IntCounter::new(
                "forgepool_repair_rounds_total",
                "Implementation rounds started to repair failed checks.",
            )
            .expect("a valid counter"),
            no_progress_stops: IntCounter::new(
                "forgepool_no_progress_stops_total",
                "Runs the no-progress guard stopped.",
            )
            .expect("a valid counter"),
            deliveries: IntCounter::new(
                "forgepool_deliveries_total",
                "Branches pushed with an approved change.",
            )
            .expect("a valid counter"),
            checks: counter(
                r,
                "forgepool_checks_total",
                "Verification commands run, by outcome (passed, failed, timed_out).",
                &["outcome"],
            ),
            broker_reconnects: counter(
                r,
                "forgepool_broker_reconnects_total",
                "Connections to RabbitMQ opened again after a loss, by consumer.",
                &["connection"],
            ),
            dead_lettered: counter(
                r,
                "forgepool_dead_lettered_total",
                "Messages this service sent to the dead-letter exchange, by source queue.",
                &["queue_name"],
            ),
            runs_in_progress: IntGauge::new(
                "forgepool_runs_in_progress",
                "Runs this worker is executing now.",
            )
            .expect("a valid gauge"),
            run_slots: IntGauge::new("forgepool_run_slots", "Run slots this worker offers.")
                .expect("a valid gauge"),
            agent_tokens: counter(
                r,
                "forgepool_agent_tokens_total",
                "Tokens agents reported in usage.json, by profile and kind (input, output, cache_read, cache_write).",
                &["profile", "kind"],
            ),
            agent_cost: {
                let metric = prometheus::CounterVec::new(
                    Opts::new(
                        "forgepool_agent_cost_usd_total",
                        "Cost agents reported in usage.json, in US dollars, by profile.",
                    ),
                    &["profile"],
                )
                .expect("a valid counter");
                r.register(Box::new(metric.clone())).expect("a unique counter");
                metric
            },
            profile_paused: gauge(
                r,
                "forgepool_profile_paused",
                "1 while an agent profile is paused across the pool (a stage's pause.json), by profile (workers).",
                &["profile"],
            ),
            runs_waiting: gauge(
                r,
                "forgepool_runs_waiting_for_profile",
                "Runs waiting for a cap slot of an agent profile (max_concurrent), by profile (dispatcher).",
                &["profile"],
            ),
            model_requests: counter(
                r,
                "forgepool_model_requests_total",
                "Requests through the worker's model gateway, by profile, provider, model (a model of the provider's price table, or other) and HTTP status.",
                &["profile", "provider", "model", "code"],
            ),
            model_tokens: counter(
                r,
                "forgepool_model_tokens_total",
                "Tokens the model gateway metered on the wire, by profile, model and kind (input, output, cache_read, cache_write).",
                &["profile", "model", "kind"],
            ),
            model_cost: {
                let metric = prometheus::CounterVec::new(
                    Opts::new(
                        "forgepool_model_cost_usd_total",
                        "What the model gateway's metered tokens cost at the providers' prices, in US dollars.",
                    ),
                    &["profile", "model"],
                )
                .expect("a valid counter");
                r.register(Box::new(metric.clone()))
                    .expect("a unique counter");
                metric
            },
            model_latency: histogram(
                r,
                "forgepool_model_request_duration_seconds",
                "Time from a request reaching the model gateway to the end of its answer, by profile and provider.",
                &["profile", "provider"],
                &MODEL_BUCKETS,
            ),
            tracker_deliveries: counter(
                r,
                "forgepool_tracker_deliveries_total",
                "Tracker webhook deliveries and poll findings, by what became of them.",
                &["tracker", "outcome"],
            ),
            tracker_requests: counter(
                r,
                "forgepool_tracker_requests_total",
                "Calls to trackers' APIs, by the status answered (0: none).",
                &["tracker", "code"],
            ),
            registry,
        };
        metrics.register_plain_metrics();
        metrics
    }

    /// Registers the metrics without labels (the labelled families register themselves).
    fn register_plain_metrics(&self) {
        let metrics = self;
        let mut singles = vec![
            Box::new(metrics.repair_rounds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.no_progress_stops.clone()),
            Box::new(metrics.deliveries.clone()),
            Box::new(metrics.broker_connected.clone()),
        ];
        // What only a worker has: a dispatcher would export them stuck at 0.
        if metrics.role == Role::Worker {
            singles.push(Box::new(metrics.containers_running.clone()));
            singles.push(Box::new(metrics.runs_in_progress.clone()));
            singles.push(Box::new(metrics.run_slots.clone()));
        }
        for single in singles {
            metrics.registry.register(single).expect("a unique metric");
        }
        // The process's own figures (CPU, resident memory, open files, start time), from /proc.
        #[cfg(target_os = "linux")]
        {
            let process = prometheus::process_collector::ProcessCollector::for_self();
            metrics
                .registry
                .register(Box::new(process))
                .expect("a unique collector");
        }
        let role = match metrics.role {
            Role::Worker => "worker",
            Role::Dispatcher => "dispatcher",
        };
        metrics
            .build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), role])
            .set(1);
    }

    /// Counts an HTTP request the dispatcher answered: `route` is the matched route's
    /// template (`/v1/runs/{id}`), or `unmatched`, so that labels stay bounded.
    pub fn http_request(&self, method: &str, route: &str, status: u16, seconds: f64) {
        self.http_requests
            .with_label_values(&[method, route, &status.to_string()])
            .inc();
        self.http_duration
            .with_label_values(&[method, route])
            .observe(seconds);
    }

    /// Times a run's state change the dispatcher stored (`prior` was its state before): the
    /// wait from submission until a worker starts a run that was queued (not a resumed one),
    /// and the time from submission until the run ends.
    pub fn observe_run_times(&self, job: &Job, event: &proto::Event, prior: RunState) {
        let EventKind::State { state, .. } = &event.kind else {
            return;
        };
        let (Some(submitted), Some(at)) = (
            proto::parse_time(&job.submitted_at),
            proto::parse_time(&event.time),
        ) else {
            return;
        };
        let seconds = at
            .duration_since(submitted)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if *state == RunState::Running && prior == RunState::Queued && job.resume.is_none() {
            self.queue_wait
                .with_label_values(&[job.skill.as_str()])
                .observe(seconds);
        }
        if state.is_terminal() && !prior.is_terminal() {
            self.run_duration
                .with_label_values(&[job.skill.as_str(), state.as_str()])
                .observe(seconds);
        }
    }

    /// Counts what an event of `job` tells: review cycles and verdicts, stage durations,
    /// checks, outcomes, repair rounds, no-progress stops and deliveries.
    pub fn observe(&self, job: &Job, event: &EventKind) {
        let (skill, step) = (job.skill.as_str(), job.step.as_str());
        match event {
            EventKind::Cycle { cycle } => {
                self.review_cycles.with_label_values(&[skill, step]).inc();
                let verdict = match cycle.verdict.as_str() {
                    "approved" => "approved",
                    "rejected" => "rejected",
                    _ => "other",
                };
                self.review_verdicts
                    .with_label_values(&[skill, step, verdict])
                    .inc();
            }
            EventKind::StageStarted { .. } => {
                if self.role == Role::Worker {
                    self.containers_running.inc();
                }
            }
            EventKind::StageFinished {
                stage,
                duration_seconds,
                outcome,
                usage,
                ..
            } => {
                if let Some(usage) = usage {
                    self.count_usage(job, *stage, usage);
                }
                if self.role == Role::Worker {
                    self.containers_running.dec();
                }
                let outcome = outcome.as_str();
                self.stage_duration
                    .with_label_values(&[stage.as_str(), outcome])
                    .observe(*duration_seconds);
                if *stage == Stage::Review {
                    self.review_duration
                        .with_label_values(&[skill, step])
                        .observe(*duration_seconds);
                }
            }
            EventKind::Check { result } => {
                let outcome = match result.exit_code {
                    Some(0) => "passed",
                    Some(_) => "failed",
                    None => "timed_out",
                };
                self.checks.with_label_values(&[outcome]).inc();
            }
            EventKind::State { state, reason } => {
                if state.is_terminal() || *state == RunState::Paused {
                    self.runs_finished
                        .with_label_values(&[state.as_str()])
                        .inc();
                }
                if *state == RunState::Blocked && reason.starts_with("no progress") {
                    self.no_progress_stops.inc();
                }
            }
            EventKind::Result { result } => {
                if result.commit.is_some() {
                    self.deliveries.inc();
                }
                // The history is cumulative across a pause: counted once, when the run ends.
                if result.state.is_terminal() {
                    let repairs = result
                        .repair_history
                        .iter()
                        .filter(|round| round.reason == "repair")
                        .count();
                    self.repair_rounds.inc_by(repairs as u64);
                }
            }
            EventKind::Log { .. }
            | EventKind::Heartbeat { .. }
            | EventKind::Checkpoint { .. }
            | EventKind::CancelRequested { .. }
            | EventKind::Webhook { .. }
            | EventKind::Tracker { .. }
            | EventKind::Transcript { .. }
            | EventKind::PullRequest { .. } => {}
        }
    }

    /// Counts a stage's reported usage under its profile.
    fn count_usage(&self, job: &Job, stage: Stage, usage: &proto::Usage) {
        let profile = match stage {
            Stage::Implement | Stage::Verify => Some(&job.implementer),
            Stage::Review => job.reviewer.as_ref(),
            Stage::FinalReview => job.final_reviewer.as_ref(),
        };
        let Some(profile) = profile else {
            return;
        };
        let name = profile.name.as_str();
        for (kind, tokens) in usage.tokens() {
            self.agent_tokens
                .with_label_values(&[name, kind])
                .inc_by(tokens);
        }
        self.agent_cost
            .with_label_values(&[name])
            .inc_by(usage.cost_usd);
    }

    /// Counts one request through the model gateway and its duration; `model` is already a
    /// bounded label.
    pub fn model_request(
        &self,
        profile: &str,
        provider: &str,
        model: &str,
        code: u16,
        seconds: f64,
    ) {
        self.model_requests
            .with_label_values(&[profile, provider, model, &code.to_string()])
            .inc();
        self.model_latency
            .with_label_values(&[profile, provider])
            .observe(seconds);
    }

    /// Adds the tokens and cost the gateway metered for one answer.
    pub fn model_usage(&self, profile: &str, model: &str, tokens: [(&str, u64); 4], cost: f64) {
        for (kind, count) in tokens {
            if count > 0 {
                self.model_tokens
                    .with_label_values(&[profile, model, kind])
                    .inc_by(count);
            }
        }
        if cost > 0.0 {
            self.model_cost
                .with_label_values(&[profile, model])
                .inc_by(cost);
        }
    }

    /// Sets `forgepool_profile_paused{profile}`: 1 while paused, 0 after.
    pub fn set_profile_paused(&self, profile: &str, paused: bool) {
        self.profile_paused
            .with_label_values(&[profile])
            .set(i64::from(paused));
    }

    /// Sets `forgepool_runs_waiting_for_profile` for every profile at once (a profile absent
    /// from `counts` has no series until runs wait for it again).
    pub fn set_runs_waiting(&self, counts: &[(String, i64)]) {
        self.runs_waiting.reset();
        for (profile, count) in counts {
            self.runs_waiting.with_label_values(&[profile]).set(*count);
        }
    }

    /// Sets `forge_queue_depth` for one queue.
    pub fn set_queue_depth(&self, queue_name: &str, depth: u32) {
        self.queue_depth
            .with_label_values(&[queue_name])
            .set(i64::from(depth));
    }

    /// Sets `forge_queue_depth` for every queue the broker reported.
    pub fn set_queue_depths(&self, depths: &[(String, u32)]) {
        for (queue_name, depth) in depths {
            self.set_queue_depth(queue_name, *depth);
        }
    }

    /// Sets `forgepool_runs_by_state{state}` for every state at once (states absent from `counts` are 0).
    pub fn set_runs_by_state(&self, counts: &[(RunState, u64)]) {
        for state in RunState::ALL {
            let count = counts
                .iter()
                .find(|(s, _)| *s == state)
                .map_or(0, |(_, n)| *n);
            self.runs_by_state
                .with_label_values(&[state.as_str()])
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    /// Records whether the service's main consumer is connected to the broker.
    pub fn set_broker_connected(&self, connected: bool) {
        self.broker_connected.set(i64::from(connected));
    }

    /// Whether the service's main consumer is connected to the broker (its readiness).
    pub fn broker_connected(&self) -> bool {
        self.broker_connected.get() == 1
    }

    /// Counts a reconnection of the named consumer.
    pub fn broker_reconnected(&self, connection: &str) {
        self.broker_reconnects
            .with_label_values(&[connection])
            .inc();
    }

    /// Counts a tracker delivery by its outcome (`started`, `duplicate`, `ignored`, …).
    pub fn tracker_delivery(&self, tracker: &str, outcome: &str) {
        self.tracker_deliveries
            .with_label_values(&[tracker, outcome])
            .inc();
    }

    /// Counts a call to a tracker's API by its answer's status.
    pub fn tracker_request(&self, tracker: &str, code: u16) {
        self.tracker_requests
            .with_label_values(&[tracker, &code.to_string()])
            .inc();
    }

    /// Counts a message this service dead-lettered from `queue`.
    pub fn dead_lettered(&self, queue: &str) {
        self.dead_lettered.with_label_values(&[queue]).inc();
    }

    /// The gauge of runs in progress (a worker's).
    pub fn runs_in_progress(&self) -> &IntGauge {
        &self.runs_in_progress
    }

    /// Sets the number of run slots (a worker's).
    pub fn set_run_slots(&self, slots: usize) {
        self.run_slots.set(i64::try_from(slots).unwrap_or(i64::MAX));
    }

    /// Every family in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        let encoder = TextEncoder::new();
        if encoder
            .encode(&self.registry.gather(), &mut buffer)
            .is_err()
        {
            return String::new();
        }
        String::from_utf8(buffer).unwrap_or_default()
    }
}

/// The content type of [`Metrics::render`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use proto::{CheckResult, CycleRecord, RoundRecord, RunResult};
    use uuid::Uuid;

    fn job() -> Job {
        serde_json::from_value(serde_json::json!({
            "schema_version": 1, "run_id": Uuid::new_v4(), "ticket": "SHOP-1", "project": "shop",
            "skill": "implement-task", "step": "implement_task", "brief": "b",
            "repository": {"url": "file:///r.git"}, "commands": [], "skill_md": "s", "review": null,
            "repair_budget": 2,
            "implementer": {"name": "i", "image": "i", "command": [], "env": [], "network": "none",
                            "memory_bytes": 1073741824u64, "cpus": 1.0, "timeout_seconds": 60, "user": null},
            "reviewer": null, "final_reviewer": null, "warnings": [], "submitted_at": "2024-01-15T10:30:00Z"
        }))
        .unwrap()
    }

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .map(|l| l.rsplit(' ').next().unwrap())
    }

    #[test]
    fn events_become_the_forge_families_with_their_labels_and_buckets() {
        let metrics = Metrics::new(Role::Worker);
        let job = job();
        let cycle = |n: u32, verdict: &str| EventKind::Cycle {
            cycle: CycleRecord {
                step: "an_agent_chose_this".into(),
                file: format!("review_cycle_{n}.json"),
                cycle: n,
                max_cycles: Some(3),
                verdict: verdict.into(),
                feedback: String::new(),
                content: serde_json::json!({}),
                origin: Default::default(),
            },
        };
        for event in [
            EventKind::StageStarted {
                stage: Stage::Review,
                round: 1,
                cycle: Some(1),
            },
            EventKind::StageFinished {
                usage: None,
                stage: Stage::Review,
                round: 1,
                cycle: Some(1),
                exit_code: Some(0),
                duration_seconds: 7.5,
                outcome: proto::StageOutcome::Completed,
            },
            cycle(1, "rejected"),
            cycle(2, "approved"),
            EventKind::Check {
                result: CheckResult {
                    round: 1,
                    argv: vec!["true".into()],
                    exit_code: Some(0),
                    duration_seconds: 0.2,
                    output_tail: String::new(),
                },
            },
            EventKind::State {
                state: RunState::Blocked,
                reason: "no progress: same tree".into(),
            },
        ] {
            metrics.observe(&job, &event);
        }
        metrics.set_queue_depth("forgepool.jobs", 4);
        let text = metrics.render();
        let labels = r#"skill="implement-task",step="implement_task""#;
        assert_eq!(
            line(&text, &format!("forge_review_cycles_total{{{labels}}}")),
            Some("2")
        );
        assert_eq!(
            line(
                &text,
                &format!("forge_review_verdicts_total{{{labels},verdict=\"rejected\"}}")
            ),
            Some("1")
        );
        assert_eq!(
            line(
                &text,
                &format!("forge_review_duration_seconds_bucket{{{labels},le=\"5\"}}")
            ),
            Some("0")
        );
        assert_eq!(
            line(
                &text,
                &format!("forge_review_duration_seconds_bucket{{{labels},le=\"10\"}}")
            ),
            Some("1")
        );
        assert_eq!(
            line(
                &text,
                &format!("forge_review_duration_seconds_sum{{{labels}}}")
            ),
            Some("7.5")
        );
        assert_eq!(
            line(&text, "forge_queue_depth{queue_name=\"forgepool.jobs\"}"),
            Some("4")
        );
        assert_eq!(line(&text, "forgepool_containers_running "), Some("0"));
        assert_eq!(line(&text, "forgepool_no_progress_stops_total "), Some("1"));
        assert_eq!(
            line(&text, "forgepool_runs_total{outcome=\"blocked\"}"),
            Some("1")
        );
        assert_eq!(
            line(&text, "forgepool_checks_total{outcome=\"passed\"}"),
            Some("1")
        );
        assert!(
            !text.contains("an_agent_chose_this"),
            "labels come from the job, never from agent files"
        );
        let buckets: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("forge_review_duration_seconds_bucket"))
            .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(
            buckets,
            ["1", "5", "10", "30", "60", "120", "300", "600", "+Inf"]
        );
    }

    #[test]
    fn every_dashboard_query_names_a_metric_forgepool_serves() {
        let dashboard: serde_json::Value = serde_json::from_str(include_str!(
            "../../../helm/forgepool/dashboards/forgepool.json"
        ))
        .expect("the dashboard is JSON");
        let metrics = Metrics::new(Role::Worker);
        metrics.observe(
            &job(),
            &EventKind::StageFinished {
                usage: None,
                stage: Stage::Review,
                round: 1,
                cycle: Some(1),
                exit_code: Some(0),
                duration_seconds: 1.0,
                outcome: proto::StageOutcome::Completed,
            },
        );
        metrics.broker_reconnected("x");
        metrics.dead_lettered("x");
        metrics.set_runs_by_state(&[]);
        metrics.set_queue_depth("q", 0);
        for verdict in ["approved", "rejected"] {
            metrics.observe(
                &job(),
                &EventKind::Cycle {
                    cycle: CycleRecord {
                        step: "s".into(),
                        file: "review_cycle_1.json".into(),
                        cycle: 1,
                        max_cycles: None,
                        verdict: verdict.into(),
                        feedback: String::new(),
                        content: serde_json::json!({}),
                        origin: Default::default(),
                    },
                },
            );
        }
        metrics.observe(
            &job(),
            &EventKind::State {
                state: RunState::Failed,
                reason: String::new(),
            },
        );
        metrics.observe(
            &job(),
            &EventKind::Check {
                result: CheckResult {
                    round: 1,
                    argv: Vec::new(),
                    exit_code: None,
                    duration_seconds: 0.0,
                    output_tail: String::new(),
                },
            },
        );
        let served: std::collections::HashSet<String> = metrics
            .render()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split(['{', ' ']).next().map(String::from))
            .collect();
        let mut queries = 0;
        for panel in dashboard["panels"].as_array().unwrap() {
            for target in panel["targets"].as_array().unwrap() {
                let expr = target["expr"].as_str().unwrap();
                queries += 1;
                let names: Vec<&str> = expr
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|w| w.starts_with("forge_") || w.starts_with("forgepool_"))
                    .collect();
                assert!(!names.is_empty(), "{expr} reads no forgepool metric");
                for name in names {
                    assert!(served.contains(name), "{expr}: {name} is not served");
                }
            }
        }
        assert!(
            queries >= 10,
            "the dashboard covers the metrics ({queries} queries)"
        );
    }

    #[test]
    fn a_dispatcher_does_not_count_containers_it_cannot_see() {
        let metrics = Metrics::new(Role::Dispatcher);
        metrics.observe(
            &job(),
            &EventKind::StageStarted {
                stage: Stage::Implement,
                round: 2,
                cycle: None,
            },
        );
        let round = |round: u32, reason: &str| RoundRecord {
            round,
            reason: reason.into(),
            tree: "t".into(),
            failing: Vec::new(),
            output_tail: String::new(),
        };
        metrics.observe(
            &job(),
            &EventKind::Result {
                result: RunResult {
                    pull_request: None,
                    usage: None,
                    change: None,
                    final_review: None,
                    state: RunState::Delivered,
                    reason: "ok".into(),
                    branch: Some("forge/shop-1".into()),
                    commit: Some("abc".into()),
                    tree: None,
                    report: String::new(),
                    warnings: Vec::new(),
                    repair_budget: 2,
                    implementation_rounds: 3,
                    repair_history: vec![
                        round(1, "initial"),
                        round(2, "repair"),
                        round(3, "review"),
                    ],
                    review: "not_requested".into(),
                },
            },
        );
        let text = metrics.render();
        assert_eq!(
            line(&text, "forgepool_containers_running "),
            None,
            "a series only workers have is not exported stuck at 0"
        );
        assert_eq!(
            line(&text, "forgepool_repair_rounds_total "),
            Some("1"),
            "only rounds that repaired failed checks"
        );
        assert_eq!(line(&text, "forgepool_deliveries_total "), Some("1"));
    }
}
