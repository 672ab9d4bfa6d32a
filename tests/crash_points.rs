//! A worker killed at each phase boundary of a run (SPEC 11's crash windows), one test per
//! boundary, and a job whose holders die before they start it.
//!
//! The doomed worker kills itself (SIGKILL) at the fault point named by
//! `FORGEPOOL_FAULT_POINT`, compiled in only with the `fault-points` feature (`scripts/test.sh`
//! builds the tests with it). Another worker then takes the job. Each test counts where the
//! effects land: pushes with the origin's `post-receive` hook, stage executions from the
//! run's `stage_started` events (a superseded execution's events are kept too), and the
//! run's containers left on the engine. The implementer writes a random nonce, so a second
//! execution would make a different commit and a second push.

#[cfg(not(feature = "fault-points"))]
#[test]
fn the_crash_point_tests_need_the_fault_points_feature() {
    panic!(
        "these tests kill the worker at its fault points, which exist only with the \
         `fault-points` feature: run `cargo nextest run --features fault-points` \
         (scripts/test.sh does)"
    );
}

#[cfg(feature = "fault-points")]
mod common;

#[cfg(feature = "fault-points")]
mod crash {
    use std::time::{Duration, Instant};

    use super::common::cluster::{container_count, jobs_on_broker, Cluster};
    use super::common::Fixture;

    const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";

    /// What landed for one run: its final state, pushes of its branch, how often each stage
    /// ran, and its containers left on the engine.
    struct Landed {
        state: String,
        pushes: usize,
        implementer: usize,
        reviewer: usize,
    }

    /// How often a run's stage started, over every execution.
    fn stage_runs(stream: &str, stage: &str) -> usize {
        stream
            .lines()
            .filter_map(|line| line.strip_prefix("data:"))
            .filter_map(|data| serde_json::from_str::<serde_json::Value>(data.trim()).ok())
            .filter(|event| event["type"] == "stage_started" && event["stage"] == stage)
            .count()
    }

    /// Waits up to `limit` for the worker `index` to exit by itself; panics otherwise.
    fn wait_dead(cluster: &mut Cluster, index: usize, limit: Duration) {
        let started = Instant::now();
        loop {
            if let Ok(Some(_)) = cluster.workers[index].child.try_wait() {
                return;
            }
            assert!(
                started.elapsed() < limit,
                "the doomed worker did not reach its fault point\n{}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits up to 90 s for the run's containers to be gone (a dead worker's are removed by
    /// the survivors' sweep once its presence has been missing for 30 s).
    async fn wait_no_containers(cluster: &Cluster, run_id: &str) {
        let started = Instant::now();
        while container_count(run_id) > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "the run's containers were left on the engine\n{}",
                cluster.logs()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits up to 90 s until no copy of a job is left on the broker (the heir settled the
    /// job the dead worker held), so what the heir did is counted too.
    async fn wait_settled(cluster: &Cluster) {
        let started = Instant::now();
        while jobs_on_broker(&cluster.prefix) > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(90),
                "the job was never settled\n{}",
                cluster.logs()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// A run whose first worker kills itself at `point`; a second worker takes it over.
    async fn killed_at(point: &str, ticket: &str) -> Landed {
        let fixture = Fixture::new(Some(REVIEW), &["change"], &["approve"]);
        let mut cluster = Cluster::start(fixture, 0, 1, None).await;
        let doomed = cluster.start_worker_with("doomed", 1, &[("FORGEPOOL_FAULT_POINT", point)]);
        let id = cluster.submit(ticket).await;
        wait_dead(&mut cluster, doomed, Duration::from_secs(60));
        cluster.start_worker("heir", 1);
        let views = cluster
            .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
            .await;
        wait_settled(&cluster).await;
        wait_no_containers(&cluster, &id).await;
        let stream = cluster.event_stream(&id).await;
        let branch = format!("forge/{}", ticket.to_lowercase());
        let landed = Landed {
            state: views[0]["state"].as_str().unwrap_or_default().to_string(),
            pushes: cluster.pushes(&branch),
            implementer: stage_runs(&stream, "implement"),
            reviewer: stage_runs(&stream, "review"),
        };
        assert_eq!(
            landed.state,
            "delivered",
            "killed at {point}: {}\n{}",
            views[0]["states"],
            cluster.logs()
        );
        assert_eq!(landed.pushes, 1, "killed at {point}: pushed once");
        cluster.delete_queues().await;
        landed
    }

    /// Catches: a run lost when its worker dies before any stage (the job was acknowledged
    /// early, or its `running` state strands it), or one that runs a stage twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_before_the_first_stage() {
        let landed = killed_at("started", "CRASH-1").await;
        assert_eq!((landed.implementer, landed.reviewer), (1, 1));
    }

    /// Catches: a completed implementer run again after a crash (its progress was not kept, or
    /// not restored). The review may have been under way when the worker died: it runs again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_after_the_implementers_progress_was_kept() {
        let landed = killed_at("progress-kept#1", "CRASH-2").await;
        assert_eq!(landed.implementer, 1, "the implementer ran once");
        assert!(landed.reviewer <= 2, "reviewer ran {}", landed.reviewer);
    }

    /// Catches: a completed review run again before the delivery after a crash.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_after_the_reviews_progress_was_kept() {
        let landed = killed_at("progress-kept#2", "CRASH-3").await;
        assert_eq!((landed.implementer, landed.reviewer), (1, 1));
    }

    /// Catches: a crash just before the push that loses the run or repeats its stages.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_just_before_the_push() {
        let landed = killed_at("before-push", "CRASH-4").await;
        assert_eq!((landed.implementer, landed.reviewer), (1, 1));
    }

    /// Catches: a second push (a different commit: the nonce) by the execution that follows a
    /// worker that died between its push and its final events; the branch is the commit point.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_between_the_push_and_the_final_events() {
        let landed = killed_at("pushed", "CRASH-5").await;
        assert_eq!((landed.implementer, landed.reviewer), (1, 1));
    }

    /// Catches: a run executed again because its worker died after the final events but
    /// before the done marker and the acknowledgement.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_between_the_final_events_and_the_done_marker() {
        let landed = killed_at("ended", "CRASH-6").await;
        assert_eq!((landed.implementer, landed.reviewer), (1, 1));
    }

    /// Catches: a run executed again because its worker died between the done marker and the
    /// acknowledgement.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_between_the_done_marker_and_the_ack() {
        let landed = killed_at("marked-done", "CRASH-7").await;
        assert_eq!((landed.implementer, landed.reviewer), (1, 1));
    }

    /// Catches: a cancel of a run whose job is between workers (its worker died) that is lost,
    /// or that the next worker does not hear before it pushes (SPEC 11: durable cancel).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_cancelled_between_workers_is_cancelled_by_the_next() {
        let fixture = Fixture::new(Some(REVIEW), &["change"], &["approve"]);
        let mut cluster = Cluster::start(fixture, 0, 1, None).await;
        let doomed =
            cluster.start_worker_with("doomed", 1, &[("FORGEPOOL_FAULT_POINT", "progress-kept#1")]);
        let id = cluster.submit("BETWEEN-1").await;
        wait_dead(&mut cluster, doomed, Duration::from_secs(60));
        let (status, answer) = cluster.cancel(&id).await;
        assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{answer}");
        assert_eq!(
            answer["cancel"], "requested",
            "the run is still running: {answer}"
        );
        cluster.start_worker("heir", 1);
        let views = cluster
            .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
            .await;
        assert_eq!(
            views[0]["state"],
            "cancelled",
            "{}\n{}",
            views[0]["states"],
            cluster.logs()
        );
        wait_settled(&cluster).await;
        assert_eq!(cluster.pushes("forge/between-1"), 0, "nothing delivered");
        wait_no_containers(&cluster, &id).await;
        cluster.delete_queues().await;
    }

    /// Catches: a job held, but not started, by workers that die counted toward the poison
    /// limit (SPEC 11): before, each worker that received the lost job held it for a 10 s
    /// grace, so six workers killed one after the other failed the run by the broker's
    /// delivery limit. Now the job waits its grace parked on the broker, and only losses count.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_whose_holders_die_before_starting_it_is_not_poison() {
        let fixture = Fixture::new(Some(REVIEW), &["sleep-from", "1", "60"], &["approve"]);
        let agents = std::fs::read_to_string(&fixture.agents).unwrap().replacen(
            "env = [\"AGENT_SECRET\"]",
            "env = [\"AGENT_SECRET\", \"SLEEP_DONE\"]",
            1,
        );
        std::fs::write(&fixture.agents, agents).unwrap();
        let mut cluster = Cluster::start(fixture, 0, 1, None).await;
        let id = cluster.submit("HELD-1").await;
        // The first worker runs the implementer (it sleeps) and is killed while it runs.
        let first = cluster.start_worker("w0", 1);
        cluster.wait_running(&id).await;
        cluster.workers[first].kill();
        // Six more are each killed two seconds after they started: each gets the lost job
        // first, within the grace of the worker that died.
        for n in 1..=6 {
            let worker = cluster.start_worker(&format!("w{n}"), 1);
            tokio::time::sleep(Duration::from_secs(2)).await;
            cluster.workers[worker].kill();
        }
        cluster.start_worker_with("last", 1, &[("SLEEP_DONE", "yes")]);
        let views = cluster
            .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(120))
            .await;
        assert_eq!(
            views[0]["state"],
            "delivered",
            "{}\n{}",
            views[0]["states"],
            cluster.logs()
        );
        wait_settled(&cluster).await;
        assert_eq!(cluster.pushes("forge/held-1"), 1, "delivered once");
        assert!(
            cluster.dead_letters().await.is_empty(),
            "the job was not dead-lettered"
        );
        wait_no_containers(&cluster, &id).await;
        cluster.delete_queues().await;
    }

    /// Two runs of a profile capped at one on a worker that dies at `point` of the move of
    /// the second run's job to the wait queue; an heir takes over both.
    async fn killed_moving_a_job(point: &str, tag: &str) {
        let fixture = Fixture::new(Some(REVIEW), &["sleep-from", "1", "4"], &["approve"]);
        let agents = std::fs::read_to_string(&fixture.agents).unwrap().replacen(
            "[agents.impl]\n",
            "[agents.impl]\nmax_concurrent = 1\n",
            1,
        );
        std::fs::write(&fixture.agents, agents).unwrap();
        let mut cluster = Cluster::start(fixture, 0, 1, None).await;
        let doomed = cluster.start_worker_with("doomed", 2, &[("FORGEPOOL_FAULT_POINT", point)]);
        let tickets = [format!("{tag}-1"), format!("{tag}-2")];
        let mut ids = Vec::new();
        for ticket in &tickets {
            ids.push(cluster.submit(ticket).await);
        }
        wait_dead(&mut cluster, doomed, Duration::from_secs(60));
        let log = std::fs::read_to_string(&cluster.workers[doomed].log).unwrap_or_default();
        assert!(
            log.contains(&format!("fault point `{point}`")),
            "the doomed worker died at its fault point {point}:\n{log}"
        );
        cluster.start_worker("heir", 2);
        let views = cluster.wait_terminal(&ids, Duration::from_secs(180)).await;
        wait_settled(&cluster).await;
        for ((view, ticket), id) in views.iter().zip(&tickets).zip(&ids) {
            assert_eq!(
                view["state"],
                "delivered",
                "killed at {point}: {ticket}: {}\n{}",
                view["states"],
                cluster.logs()
            );
            let branch = format!("forge/{}", ticket.to_lowercase());
            assert_eq!(
                cluster.pushes(&branch),
                1,
                "killed at {point}: {ticket} pushed once"
            );
            let stream = cluster.event_stream(id).await;
            assert!(
                stage_runs(&stream, "review") == 1,
                "killed at {point}: {ticket} reviewed once (one execution went past its implementer)"
            );
        }
        assert!(
            cluster.dead_letters().await.is_empty(),
            "killed at {point}: no job was dead-lettered"
        );
        for id in &ids {
            wait_no_containers(&cluster, id).await;
        }
        cluster.delete_queues().await;
    }

    /// Catches: a job lost when its worker dies just before it publishes the job's waiting
    /// copy (the delivery must not have been acknowledged yet), and either run executed twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_before_a_waiting_job_is_moved() {
        killed_moving_a_job("moving", "MOVEA").await;
    }

    /// Catches: a job run twice when its worker dies between the confirmed waiting copy and
    /// the acknowledgement (two copies on the broker: the redelivered one and the waiting
    /// one; the lease, the done marker and the store's live execution must absorb one), and a
    /// duplicate taken for poison (dead-lettered).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn killed_between_a_waiting_jobs_copy_and_its_ack() {
        killed_moving_a_job("moved", "MOVEB").await;
    }

    /// Catches: worker deaths counted against the broker's delivery limit, a guard against
    /// messages no consumer can settle (issue 27: five workers SIGKILLed in turn while each
    /// ran the implementer failed the run "delivery_limit"); a run executed twice at the end
    /// (its branch pushed twice, counted by the origin's hook); and a stage that did not start
    /// again after each death (each execution's `stage_started` is counted).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_run_whose_first_five_workers_die_mid_stage_is_delivered() {
        let fixture = Fixture::new(Some(REVIEW), &["sleep-from", "1", "60"], &["approve"]);
        let agents = std::fs::read_to_string(&fixture.agents).unwrap().replacen(
            "env = [\"AGENT_SECRET\"]",
            "env = [\"AGENT_SECRET\", \"SLEEP_DONE\"]",
            1,
        );
        std::fs::write(&fixture.agents, agents).unwrap();
        let mut cluster = Cluster::start(fixture, 0, 1, None).await;
        let id = cluster.submit("DIE-1").await;
        for n in 0..5 {
            let worker = cluster.start_worker(&format!("w{n}"), 1);
            // This worker's execution has started the implementer (it sleeps): kill it there.
            let started = Instant::now();
            loop {
                let stream = cluster
                    .event_stream_until(&id, Duration::from_millis(500))
                    .await;
                if stage_runs(&stream, "implement") > n {
                    break;
                }
                assert!(
                    started.elapsed() < Duration::from_secs(90),
                    "execution {n} did not start the implementer\n{}",
                    cluster.logs()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            cluster.workers[worker].kill();
        }
        cluster.start_worker_with("last", 1, &[("SLEEP_DONE", "yes")]);
        let views = cluster
            .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(180))
            .await;
        assert_eq!(
            views[0]["state"],
            "delivered",
            "{}\n{}",
            views[0]["states"],
            cluster.logs()
        );
        wait_settled(&cluster).await;
        assert_eq!(cluster.pushes("forge/die-1"), 1, "delivered once");
        let stream = cluster.event_stream(&id).await;
        assert_eq!(
            stage_runs(&stream, "implement"),
            6,
            "one implementer per execution: five killed, one finished"
        );
        assert!(
            cluster.dead_letters().await.is_empty(),
            "the job was not dead-lettered"
        );
        wait_no_containers(&cluster, &id).await;
        cluster.delete_queues().await;
    }
}
