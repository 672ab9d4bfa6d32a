//! The run loop as a typed state machine (SPEC 7), with no I/O.
//!
//! [`RunMachine::step`] takes the outcome of the stage the current [`Phase`] asked for and
//! returns the next phase. The engine performs the stage; this module decides what follows:
//! repair rounds and the no-progress guard, review cycles and `block_on_failure`, the final
//! review and delivery.

use proto::RunState;
pub use proto::{FailureSignature, Limits, MachineState, Phase, RoundReason};

/// The outcome of the stage a phase asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// The implementer completed and left `tree`.
    Implemented {
        /// The git tree of the working copy, without `.forge/`.
        tree: String,
    },
    /// A stage failed in a way that ends the run (crash, missing image, timeout).
    StageFailed {
        /// What happened, for the person reading the run.
        reason: String,
    },
    /// A stage exited with 75: the provider paused.
    StagePaused {
        /// What happened.
        reason: String,
    },
    /// Every verification command passed.
    Verified,
    /// Some verification commands failed.
    ChecksFailed {
        /// The failing commands and exit codes.
        signature: FailureSignature,
        /// The failures formatted for the `## Failed Checks` section.
        report: String,
    },
    /// The reviewer gave a verdict.
    Reviewed {
        /// Whether it approved.
        approved: bool,
        /// The feedback.
        feedback: String,
    },
    /// The final review finished with a validated report.
    FinalReviewed {
        /// `approved` (true) or `changes_required` (false).
        approved: bool,
        /// The summary or the refusal reason.
        reason: String,
    },
    /// The final review's report was refused (malformed, fabricated, or the stage failed).
    FinalReviewRefused {
        /// Why.
        reason: String,
    },
    /// The change was committed and pushed.
    Delivered,
    /// Delivery failed or was refused.
    DeliveryFailed {
        /// Why.
        reason: String,
    },
    /// A paused run was resumed.
    Resumed,
    /// A user cancelled the run.
    Cancelled,
}

impl Input {
    fn name(&self) -> &'static str {
        match self {
            Input::Implemented { .. } => "implemented",
            Input::StageFailed { .. } => "stage_failed",
            Input::StagePaused { .. } => "stage_paused",
            Input::Verified => "verified",
            Input::ChecksFailed { .. } => "checks_failed",
            Input::Reviewed { .. } => "reviewed",
            Input::FinalReviewed { .. } => "final_reviewed",
            Input::FinalReviewRefused { .. } => "final_review_refused",
            Input::Delivered => "delivered",
            Input::DeliveryFailed { .. } => "delivery_failed",
            Input::Resumed => "resumed",
            Input::Cancelled => "cancelled",
        }
    }
}

/// An input that the current phase cannot take: a bug in the engine, never a user error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("run loop cannot take `{input}` in phase `{phase}`")]
pub struct UnexpectedInput {
    /// The phase.
    pub phase: &'static str,
    /// The input.
    pub input: &'static str,
}

/// The run loop: its state (the phase and the counters the rules depend on, read through
/// `Deref`) and the rules that move it. The state is the checkpoint's [`MachineState`]; only
/// [`RunMachine::step`] changes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMachine(MachineState);

impl std::ops::Deref for RunMachine {
    type Target = MachineState;

    fn deref(&self) -> &MachineState {
        &self.0
    }
}

impl RunMachine {
    /// The machine a checkpoint kept, under the job's `limits` (a checkpoint never changes
    /// them).
    pub fn restored(state: MachineState, limits: Limits) -> RunMachine {
        RunMachine(MachineState { limits, ..state })
    }

    /// A machine at round 1 of `job`: a follow-up's first round answers its feedback.
    pub fn for_job(limits: Limits, job: &proto::Job) -> RunMachine {
        let mut machine = RunMachine::new(limits);
        if let Some(follow_up) = &job.follow_up {
            machine.0.phase = Phase::Implement {
                round: 1,
                reason: RoundReason::Review(follow_up.feedback.clone()),
            };
        }
        machine
    }

    /// A machine at round 1.
    pub fn new(limits: Limits) -> RunMachine {
        RunMachine(MachineState {
            phase: Phase::Implement {
                round: 1,
                reason: RoundReason::Initial,
            },
            limits,
            implementation_rounds: 0,
            repairs_used: 0,
            cycles_used: 0,
            review_exhausted: false,
            last_failure: None,
        })
    }

    /// The state a checkpoint keeps.
    pub fn state(&self) -> &MachineState {
        &self.0
    }

    /// Advances the machine by one stage outcome.
    pub fn step(mut self, input: Input) -> Result<RunMachine, UnexpectedInput> {
        let unexpected = UnexpectedInput {
            phase: self.0.phase.name(),
            input: input.name(),
        };
        let phase = std::mem::replace(
            &mut self.0.phase,
            Phase::Finished {
                state: RunState::Failed,
                reason: String::new(),
            },
        );
        self.0.phase = match (phase, input) {
            (Phase::Finished { .. }, _) => return Err(unexpected),
            (_, Input::Cancelled) => finished(RunState::Cancelled, "cancelled by request"),
            (Phase::Paused { resume, .. }, Input::Resumed) => *resume,
            (Phase::Paused { .. }, _) => return Err(unexpected),
            (phase, Input::StagePaused { reason }) => Phase::Paused {
                resume: Box::new(phase),
                reason,
            },
            (_, Input::StageFailed { reason }) => finished(RunState::Failed, &reason),

            (Phase::Implement { round, .. }, Input::Implemented { tree }) => {
                self.0.implementation_rounds += 1;
                Phase::Verify { round, tree }
            }
            (Phase::Verify { round, tree }, Input::Verified) => {
                self.0.last_failure = None;
                self.after_verification(round, tree)
            }
            (Phase::Verify { round, tree }, Input::ChecksFailed { signature, report }) => {
                self.after_failed_checks(round, tree, signature, report)
            }
            (Phase::Review { round, cycle, tree }, Input::Reviewed { approved, feedback }) => {
                self.after_verdict(round, cycle, tree, approved, feedback)
            }
            (Phase::FinalReview { tree }, Input::FinalReviewed { approved, reason }) => {
                if approved {
                    Phase::Deliver { tree }
                } else {
                    finished(
                        RunState::Blocked,
                        &format!("the final review requires changes: {reason}"),
                    )
                }
            }
            (Phase::FinalReview { .. }, Input::FinalReviewRefused { reason }) => finished(
                RunState::Blocked,
                &format!("the final review report was refused: {reason}"),
            ),
            (Phase::Deliver { .. }, Input::Delivered) => {
                if self.0.review_exhausted {
                    finished(
                        RunState::DeliveredWithWarnings,
                        "the change was pushed, but review was exhausted without approval",
                    )
                } else {
                    finished(RunState::Delivered, "the change was pushed")
                }
            }
            (Phase::Deliver { .. }, Input::DeliveryFailed { reason }) => {
                finished(RunState::Failed, &reason)
            }
            _ => return Err(unexpected),
        };
        Ok(self)
    }

    /// After failed checks: the no-progress guard, then the repair budget, then a repair round.
    fn after_failed_checks(
        &mut self,
        round: u32,
        tree: String,
        signature: FailureSignature,
        report: String,
    ) -> Phase {
        let same = self
            .last_failure
            .as_ref()
            .is_some_and(|(t, s)| *t == tree && *s == signature);
        if same {
            finished(
                RunState::Blocked,
                "no progress: two consecutive rounds left the same source tree and the same failing checks",
            )
        } else if self.0.repairs_used >= self.0.limits.repair_budget {
            finished(
                RunState::Blocked,
                &format!(
                    "verification failed and the repair budget of {} is spent",
                    self.0.limits.repair_budget
                ),
            )
        } else {
            self.0.repairs_used += 1;
            self.0.last_failure = Some((tree, signature));
            Phase::Implement {
                round: round + 1,
                reason: RoundReason::Repair(report),
            }
        }
    }

    /// After a review verdict: onwards when approved, another round while cycles remain, then
    /// blocked or onwards with a warning as `block_on_failure` says.
    fn after_verdict(
        &mut self,
        round: u32,
        cycle: u32,
        tree: String,
        approved: bool,
        feedback: String,
    ) -> Phase {
        self.0.cycles_used = cycle;
        if approved {
            self.after_review(tree)
        } else if cycle < self.0.limits.max_cycles {
            Phase::Implement {
                round: round + 1,
                reason: RoundReason::Review(feedback),
            }
        } else if self.0.limits.block_on_failure {
            finished(
                RunState::Blocked,
                &format!("review rejected all {cycle} cycle(s) and block_on_failure is set"),
            )
        } else {
            self.0.review_exhausted = true;
            self.after_review(tree)
        }
    }

    /// The terminal state, once finished.
    pub fn finished(&self) -> Option<(RunState, &str)> {
        match &self.0.phase {
            Phase::Finished { state, reason } => Some((*state, reason)),
            _ => None,
        }
    }

    fn after_verification(&mut self, round: u32, tree: String) -> Phase {
        if self.0.limits.max_cycles > 0 && self.0.cycles_used < self.0.limits.max_cycles {
            Phase::Review {
                round,
                cycle: self.0.cycles_used + 1,
                tree,
            }
        } else {
            self.after_review(tree)
        }
    }

    fn after_review(&mut self, tree: String) -> Phase {
        if self.0.limits.final_review {
            Phase::FinalReview { tree }
        } else {
            Phase::Deliver { tree }
        }
    }
}

fn finished(state: RunState, reason: &str) -> Phase {
    Phase::Finished {
        state,
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_cycles: 3,
        block_on_failure: false,
        repair_budget: 2,
        final_review: false,
    };

    fn implemented(tree: &str) -> Input {
        Input::Implemented { tree: tree.into() }
    }
    fn rejected(feedback: &str) -> Input {
        Input::Reviewed {
            approved: false,
            feedback: feedback.into(),
        }
    }
    fn approved() -> Input {
        Input::Reviewed {
            approved: true,
            feedback: String::new(),
        }
    }
    fn failed_checks(code: i64, text: &str) -> Input {
        Input::ChecksFailed {
            signature: vec![(vec!["make".into(), "check".into()], Some(code))],
            report: text.into(),
        }
    }

    /// Runs inputs from the start and returns the machine, asserting every step is accepted.
    fn check(limits: Limits, inputs: Vec<Input>) -> RunMachine {
        inputs
            .into_iter()
            .fold(RunMachine::new(limits), |m, input| m.step(input).unwrap())
    }

    fn assert_finished(machine: &RunMachine, state: RunState, reason_part: &str) {
        let (got, reason) = machine
            .finished()
            .unwrap_or_else(|| panic!("not finished: {:?}", machine.phase));
        assert_eq!(got, state, "{reason}");
        assert!(
            reason.contains(reason_part),
            "{reason:?} lacks {reason_part:?}"
        );
    }

    #[test]
    fn table_of_runs() {
        let block = Limits {
            block_on_failure: true,
            ..LIMITS
        };
        let no_review = Limits {
            max_cycles: 0,
            ..LIMITS
        };
        let with_final = Limits {
            final_review: true,
            ..LIMITS
        };
        let cases: Vec<(&str, Limits, Vec<Input>, RunState, &str)> = vec![
            (
                "approved at once",
                LIMITS,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    approved(),
                    Input::Delivered,
                ],
                RunState::Delivered,
                "pushed",
            ),
            (
                "rejected then approved",
                LIMITS,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    rejected("no tests"),
                    implemented("t2"),
                    Input::Verified,
                    approved(),
                    Input::Delivered,
                ],
                RunState::Delivered,
                "pushed",
            ),
            (
                "exhausted, not blocking",
                LIMITS,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    rejected("a"),
                    implemented("t2"),
                    Input::Verified,
                    rejected("b"),
                    implemented("t3"),
                    Input::Verified,
                    rejected("c"),
                    Input::Delivered,
                ],
                RunState::DeliveredWithWarnings,
                "exhausted",
            ),
            (
                "exhausted and blocking",
                block,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    rejected("a"),
                    implemented("t2"),
                    Input::Verified,
                    rejected("b"),
                    implemented("t3"),
                    Input::Verified,
                    rejected("c"),
                ],
                RunState::Blocked,
                "block_on_failure",
            ),
            (
                "no review",
                no_review,
                vec![implemented("t1"), Input::Verified, Input::Delivered],
                RunState::Delivered,
                "pushed",
            ),
            (
                "implementer crash",
                LIMITS,
                vec![Input::StageFailed {
                    reason: "implementer exited with code 2".into(),
                }],
                RunState::Failed,
                "code 2",
            ),
            (
                "final review requires changes",
                with_final,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    approved(),
                    Input::FinalReviewed {
                        approved: false,
                        reason: "oversold".into(),
                    },
                ],
                RunState::Blocked,
                "oversold",
            ),
            (
                "final review approves",
                with_final,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    approved(),
                    Input::FinalReviewed {
                        approved: true,
                        reason: String::new(),
                    },
                    Input::Delivered,
                ],
                RunState::Delivered,
                "pushed",
            ),
            (
                "delivery refused",
                no_review,
                vec![
                    implemented("t1"),
                    Input::Verified,
                    Input::DeliveryFailed {
                        reason: "tree changed".into(),
                    },
                ],
                RunState::Failed,
                "tree changed",
            ),
            (
                "cancelled",
                LIMITS,
                vec![implemented("t1"), Input::Cancelled],
                RunState::Cancelled,
                "cancelled",
            ),
        ];
        for (name, limits, inputs, state, reason) in cases {
            let machine = check(limits, inputs);
            let (got, why) = machine
                .finished()
                .unwrap_or_else(|| panic!("{name}: not finished"));
            assert_eq!(got, state, "{name}: {why}");
            assert!(why.contains(reason), "{name}: {why:?} lacks {reason:?}");
        }
    }

    #[test]
    fn rejection_feedback_reaches_the_next_round() {
        let machine = check(
            LIMITS,
            vec![
                implemented("t1"),
                Input::Verified,
                rejected("Missing tests"),
            ],
        );
        assert_eq!(
            machine.phase,
            Phase::Implement {
                round: 2,
                reason: RoundReason::Review("Missing tests".into())
            }
        );
        assert_eq!(machine.cycles_used, 1);
    }

    #[test]
    fn repair_budgets() {
        for budget in [0u32, 1, 3] {
            let limits = Limits {
                repair_budget: budget,
                max_cycles: 0,
                ..LIMITS
            };
            let mut machine = RunMachine::new(limits);
            for round in 0..=budget {
                machine = machine.step(implemented(&format!("t{round}"))).unwrap();
                machine = machine.step(failed_checks(1, "fail")).unwrap();
            }
            assert_finished(&machine, RunState::Blocked, "repair budget");
            assert_eq!(machine.implementation_rounds, budget + 1, "budget {budget}");
            assert_eq!(machine.repairs_used, budget);
        }
    }

    #[test]
    fn repair_rounds_carry_failed_checks() {
        let machine = check(
            LIMITS,
            vec![
                implemented("t1"),
                failed_checks(2, "## make check exited 2"),
            ],
        );
        assert_eq!(
            machine.phase,
            Phase::Implement {
                round: 2,
                reason: RoundReason::Repair("## make check exited 2".into())
            }
        );
    }

    #[test]
    fn no_progress_guard_trips_on_same_tree_and_signature_whatever_the_text() {
        let machine = check(
            LIMITS,
            vec![
                implemented("same"),
                failed_checks(1, "at 10:00:01"),
                implemented("same"),
                failed_checks(1, "at 10:00:09"),
            ],
        );
        assert_finished(&machine, RunState::Blocked, "no progress");
        assert_eq!(machine.implementation_rounds, 2);
    }

    #[test]
    fn no_progress_guard_lets_a_changed_tree_or_signature_continue() {
        let changed_tree = check(
            LIMITS,
            vec![
                implemented("a"),
                failed_checks(1, "x"),
                implemented("b"),
                failed_checks(1, "x"),
            ],
        );
        assert!(
            matches!(changed_tree.phase, Phase::Implement { round: 3, .. }),
            "{:?}",
            changed_tree.phase
        );
        let changed_code = check(
            LIMITS,
            vec![
                implemented("a"),
                failed_checks(1, "x"),
                implemented("a"),
                failed_checks(2, "x"),
            ],
        );
        assert!(
            matches!(changed_code.phase, Phase::Implement { round: 3, .. }),
            "{:?}",
            changed_code.phase
        );
    }

    #[test]
    fn pauses_do_not_spend_a_round_and_resume_where_they_stopped() {
        let machine = check(
            LIMITS,
            vec![Input::StagePaused {
                reason: "rate limited".into(),
            }],
        );
        assert!(matches!(machine.phase, Phase::Paused { .. }));
        assert_eq!(machine.implementation_rounds, 0);
        let machine = machine.step(Input::Resumed).unwrap();
        assert_eq!(
            machine.phase,
            Phase::Implement {
                round: 1,
                reason: RoundReason::Initial
            }
        );
    }

    #[test]
    fn finished_runs_take_no_more_input() {
        let machine = check(LIMITS, vec![Input::Cancelled]);
        let error = machine.step(Input::Verified).unwrap_err();
        assert_eq!(
            error,
            UnexpectedInput {
                phase: "finished",
                input: "verified"
            }
        );
        let error = RunMachine::new(LIMITS).step(Input::Verified).unwrap_err();
        assert_eq!(error.phase, "implement");
    }
}
