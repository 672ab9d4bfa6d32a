//! The run store contract, held by both backends: SQLite (a file) and PostgreSQL (the server
//! `scripts/services.sh` starts). Each check opens the store, closes it, and opens it again.

mod common;

use common::postgres::TestDatabase;
use dispatcher::store::{Prune, Pruned, RunFilter, RunStore, Store};
use proto::{CycleRecord, Event, EventKind, Job, RunState};
use uuid::Uuid;

fn job(ticket: &str, submitted_at: &str) -> Job {
    serde_json::from_value(serde_json::json!({
        "schema_version": 1, "run_id": Uuid::new_v4(), "ticket": ticket, "project": "shop",
        "skill": "implement-task", "step": "implement_task", "brief": "b",
        "repository": {"url": "file:///r.git"}, "commands": [], "skill_md": "s", "review": null,
        "repair_budget": 2,
        "implementer": {"name": "i", "image": "i", "command": [], "env": [], "network": "none",
                        "memory_bytes": 1073741824u64, "cpus": 1.0, "timeout_seconds": 60, "user": null},
        "reviewer": null, "final_reviewer": null, "warnings": [], "submitted_at": submitted_at
    }))
    .unwrap()
}

fn state(run_id: Uuid, state: RunState, reason: &str) -> Event {
    Event::new(
        run_id,
        EventKind::State {
            state,
            reason: reason.into(),
        },
    )
}

fn cycle(run_id: Uuid, n: u32, verdict: &str) -> Event {
    Event::new(
        run_id,
        EventKind::Cycle {
            cycle: CycleRecord {
                step: "implement_task".into(),
                file: format!("review_cycle_{n}.json"),
                cycle: n,
                max_cycles: Some(3),
                verdict: verdict.into(),
                feedback: String::new(),
                content: serde_json::json!({"cycle": n}),
                origin: Default::default(),
            },
        },
    )
}

/// Everything a store must do, checked through the seam.
async fn store_contract(url: &str) {
    let first = job("SHOP-1", "2024-01-15T10:30:00Z");
    {
        let store = Store::open(url).await.unwrap();
        store.insert_run(&first).await.unwrap();
        store.insert_run(&first).await.unwrap();
        let running = state(first.run_id, RunState::Running, "go");
        assert!(store.record_event(&running).await.unwrap());
        assert!(
            !store.record_event(&running).await.unwrap(),
            "a redelivered event is stored once"
        );
        for event in [
            cycle(first.run_id, 1, "rejected"),
            cycle(first.run_id, 1, "rejected"),
            cycle(first.run_id, 2, "approved"),
            state(first.run_id, RunState::Delivered, "ok"),
            state(first.run_id, RunState::Running, "late"),
        ] {
            store.record_event(&event).await.unwrap();
        }
    }
    let store = Store::open(url).await.unwrap();
    store.ping().await.unwrap();
    let record = store.get_run(first.run_id).await.unwrap().unwrap();
    assert_eq!(record.job, first, "the frozen job reads back unchanged");
    assert_eq!(
        record.state,
        RunState::Delivered,
        "a terminal state is never left"
    );
    let states: Vec<RunState> = record.states.iter().map(|s| s.0).collect();
    assert_eq!(
        states,
        [RunState::Queued, RunState::Running, RunState::Delivered],
        "one history entry per change; a second insert adds none"
    );
    assert_eq!(record.cycles.len(), 2, "one record per cycle file");
    assert_eq!(record.cycles[1].verdict, "approved");
    let events = store.events(first.run_id, 0).await.unwrap();
    assert_eq!(events.len(), 6, "every distinct event is kept");
    let after = store.events(first.run_id, events[2].0).await.unwrap();
    assert_eq!(
        after.len(),
        3,
        "reading after a position skips what came before"
    );
    assert_eq!(after[0].1.event_id, events[3].1.event_id);
    assert!(store.get_run(Uuid::new_v4()).await.unwrap().is_none());

    // Unpublished jobs are offered again until they are marked published.
    let second = job("SHOP-2", "2024-01-15T10:31:00Z");
    let third = job("SHOP-2", "2024-01-15T10:32:00Z");
    store.insert_run(&second).await.unwrap();
    store.insert_run(&third).await.unwrap();
    store.mark_published(first.run_id).await.unwrap();
    store.mark_published(third.run_id).await.unwrap();
    let pending = store
        .unpublished_jobs("2024-01-15T10:35:00Z".into())
        .await
        .unwrap();
    assert_eq!(
        pending.iter().map(|j| j.run_id).collect::<Vec<_>>(),
        [second.run_id]
    );
    let pending = store
        .unpublished_jobs("2024-01-15T10:30:30Z".into())
        .await
        .unwrap();
    assert!(pending.is_empty(), "only jobs accepted before the cutoff");

    // Listing: newest first, pages joined by a cursor, filters.
    let all = |cursor: Option<i64>| RunFilter {
        limit: 2,
        cursor,
        ..RunFilter::default()
    };
    let (page, next) = store.list_runs(all(None)).await.unwrap();
    assert_eq!(
        page.iter().map(|r| r.run_id).collect::<Vec<_>>(),
        [third.run_id, second.run_id]
    );
    let (page, next) = store.list_runs(all(next)).await.unwrap();
    assert_eq!(
        page.iter().map(|r| r.run_id).collect::<Vec<_>>(),
        [first.run_id]
    );
    assert!(next.is_none(), "the last page has no cursor");
    let (page, _) = store
        .list_runs(RunFilter {
            ticket: Some("SHOP-2".into()),
            limit: 10,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(page.len(), 2);
    let (page, _) = store
        .list_runs(RunFilter {
            state: Some(RunState::Delivered),
            limit: 10,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(
        page.iter().map(|r| (r.run_id, r.state)).collect::<Vec<_>>(),
        [(first.run_id, RunState::Delivered)]
    );
    let mut counts = store.count_by_state().await.unwrap();
    counts.sort_by_key(|(state, _)| state.as_str());
    assert_eq!(
        counts,
        [(RunState::Delivered, 1), (RunState::Queued, 2)],
        "runs counted by their current state"
    );

    // A finished run's result is final: a late execution's result is kept as an event only.
    let late: proto::RunResult = serde_json::from_value(serde_json::json!({
        "state": "failed", "reason": "late", "branch": null, "commit": null, "tree": null,
        "report": "late report", "warnings": [], "repair_budget": 2,
        "implementation_rounds": 9, "repair_history": [], "review": "not_requested"
    }))
    .unwrap();
    let before = store.get_run(first.run_id).await.unwrap().unwrap().result;
    let event = Event::new(first.run_id, EventKind::Result { result: late });
    assert!(
        store.record_event(&event).await.unwrap(),
        "the event is stored"
    );
    let after = store.get_run(first.run_id).await.unwrap().unwrap().result;
    assert_eq!(after, before, "the result of a finished run did not change");

    // A cancel request is recorded with the run.
    assert!(!store.cancel_requested(first.run_id).await.unwrap());
    let asked = Event::new(
        first.run_id,
        EventKind::CancelRequested {
            reason: "by a test".into(),
        },
    );
    store.record_event(&asked).await.unwrap();
    assert!(store.cancel_requested(first.run_id).await.unwrap());

    // Fencing: once a second execution runs the run, the first one's events change nothing.
    let fenced = job(
        "SHOP-5",
        &proto::format_timestamp(std::time::SystemTime::now()),
    );
    store.insert_run(&fenced).await.unwrap();
    let (first_execution, second_execution) = (Uuid::new_v4(), Uuid::new_v4());
    let id = fenced.run_id;
    store
        .record_event(&state(id, RunState::Running, "first").by(first_execution))
        .await
        .unwrap();
    store
        .record_event(&cycle(id, 1, "rejected").by(first_execution))
        .await
        .unwrap();
    store
        .record_event(&state(id, RunState::Running, "second").by(second_execution))
        .await
        .unwrap();
    let late = store
        .record_event(&cycle(id, 2, "approved").by(first_execution))
        .await
        .unwrap();
    assert!(!late, "a superseded execution's event is not news");
    store
        .record_event(&state(id, RunState::Delivered, "first again").by(first_execution))
        .await
        .unwrap();
    let record = store.get_run(id).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RunState::Running,
        "the old execution did not end the run"
    );
    assert_eq!(record.cycles.len(), 1, "nor add a cycle");
    store
        .record_event(&state(id, RunState::Blocked, "second ends").by(second_execution))
        .await
        .unwrap();
    assert_eq!(
        store.get_run(id).await.unwrap().unwrap().state,
        RunState::Blocked
    );

    // Silent runs: a running run is silent once nothing was heard of it since the cutoff.
    let soon =
        proto::format_timestamp(std::time::SystemTime::now() + std::time::Duration::from_secs(60));
    let past =
        proto::format_timestamp(std::time::SystemTime::now() - std::time::Duration::from_secs(60));
    let watched = job(
        "SHOP-6",
        &proto::format_timestamp(std::time::SystemTime::now()),
    );
    store.insert_run(&watched).await.unwrap();
    let silent_ids = |jobs: Vec<Job>| jobs.iter().map(|j| j.run_id).collect::<Vec<_>>();
    assert!(
        !silent_ids(store.silent_runs(soon.clone()).await.unwrap()).contains(&watched.run_id),
        "a queued run is never silent"
    );
    store
        .record_event(&state(watched.run_id, RunState::Running, "go"))
        .await
        .unwrap();
    assert!(
        silent_ids(store.silent_runs(soon).await.unwrap()).contains(&watched.run_id),
        "unheard of since the cutoff"
    );
    assert!(
        !silent_ids(store.silent_runs(past).await.unwrap()).contains(&watched.run_id),
        "heard of after the cutoff"
    );

    // A submission key seen in the last day returns the first run, and stores nothing.
    let now = proto::format_timestamp(std::time::SystemTime::now());
    let keyed = job("SHOP-3", &now);
    let fresh = store
        .insert_run_once(&keyed, Some("http:k1"))
        .await
        .unwrap();
    assert_eq!(fresh, None, "a new key stores the run");
    let again = job("SHOP-3", &now);
    let repeat = store
        .insert_run_once(&again, Some("http:k1"))
        .await
        .unwrap();
    assert_eq!(repeat, Some(keyed.run_id), "the repeat names the first run");
    assert!(
        store.get_run(again.run_id).await.unwrap().is_none(),
        "the repeat stored nothing"
    );
    assert_eq!(
        store.run_of_key("http:k1").await.unwrap(),
        Some(keyed.run_id)
    );
    assert_eq!(store.run_of_key("http:k2").await.unwrap(), None);
    // A key older than a day is forgotten.
    let old = job("SHOP-4", "2024-01-15T10:30:00Z");
    store.insert_run_once(&old, Some("http:old")).await.unwrap();
    assert_eq!(store.run_of_key("http:old").await.unwrap(), None);
}

/// An event of `run_id` stored as if it happened at `time`.
fn at(mut event: Event, time: &str) -> Event {
    event.time = time.into();
    event
}

/// Retention, on either backend. Catches: deleting what a run that has not ended stored;
/// deleting a run that ended after the cut-off; leaving a pruned run's events, states or
/// cycles behind; counting what was not deleted.
async fn retention_contract(url: &str) {
    let store = Store::open(url).await.unwrap();
    let chatter = |run_id| {
        [
            Event::new(run_id, EventKind::Heartbeat { worker: "w".into() }),
            Event::new(
                run_id,
                EventKind::Log {
                    stage: proto::Stage::Implement,
                    stream: proto::LogStream::Stdout,
                    text: "working\n".into(),
                },
            ),
        ]
    };
    // Old and ended; old and still running; recent and ended.
    let (old, stuck, recent) = (
        job("OLD-1", "2020-01-01T00:00:00Z"),
        job("STUCK-1", "2020-01-01T00:00:00Z"),
        job("NEW-1", "2020-01-01T00:00:00Z"),
    );
    for (job, end) in [
        (&old, Some("2020-01-02T00:00:00Z")),
        (&stuck, None),
        (&recent, Some("2020-03-01T00:00:00Z")),
    ] {
        store.insert_run(job).await.unwrap();
        let time = end.unwrap_or("2020-01-02T00:00:00Z");
        store
            .record_event(&at(state(job.run_id, RunState::Running, "go"), time))
            .await
            .unwrap();
        for event in chatter(job.run_id) {
            store.record_event(&at(event, time)).await.unwrap();
        }
        store
            .record_event(&at(cycle(job.run_id, 1, "approved"), time))
            .await
            .unwrap();
        if let Some(end) = end {
            store
                .record_event(&at(state(job.run_id, RunState::Cancelled, "stop"), end))
                .await
                .unwrap();
        }
    }
    let kinds = |events: Vec<(i64, Event)>| {
        events
            .iter()
            .map(|(_, e)| e.kind.name())
            .collect::<Vec<_>>()
    };
    // Chatter of runs that ended before February goes; everything else stays.
    let pruned = store
        .prune(Prune {
            chatter_before: Some("2020-02-01T00:00:00Z".into()),
            runs_before: None,
        })
        .await
        .unwrap();
    assert_eq!(
        pruned,
        Pruned {
            chatter: 2,
            runs: 0
        }
    );
    assert_eq!(
        kinds(store.events(old.run_id, 0).await.unwrap()),
        ["state", "cycle", "state"]
    );
    assert_eq!(
        kinds(store.events(stuck.run_id, 0).await.unwrap()),
        ["state", "heartbeat", "log", "cycle"]
    );
    assert_eq!(
        kinds(store.events(recent.run_id, 0).await.unwrap()),
        ["state", "heartbeat", "log", "cycle", "state"]
    );
    // More old runs than one batch of the prune deletes: all of them go.
    for n in 0..205 {
        let many = job(&format!("MANY-{n}"), "2020-01-01T00:00:00Z");
        store.insert_run(&many).await.unwrap();
        store
            .record_event(&at(
                state(many.run_id, RunState::Failed, "old"),
                "2020-01-03T00:00:00Z",
            ))
            .await
            .unwrap();
    }
    // Runs that ended before February go, with everything of theirs.
    let pruned = store
        .prune(Prune {
            chatter_before: None,
            runs_before: Some("2020-02-01T00:00:00Z".into()),
        })
        .await
        .unwrap();
    assert_eq!(
        pruned,
        Pruned {
            chatter: 0,
            runs: 206
        }
    );
    assert!(store.get_run(old.run_id).await.unwrap().is_none());
    assert!(store.events(old.run_id, 0).await.unwrap().is_empty());
    let kept = store
        .get_run(stuck.run_id)
        .await
        .unwrap()
        .expect("a running run is kept");
    assert_eq!(kept.cycles.len(), 1);
    let kept = store
        .get_run(recent.run_id)
        .await
        .unwrap()
        .expect("a recent run is kept");
    assert_eq!((kept.state, kept.cycles.len()), (RunState::Cancelled, 1));
    let (listed, _) = store
        .list_runs(RunFilter {
            limit: 10,
            ..RunFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.len(), 2, "{listed:?}");
}

#[tokio::test]
async fn the_sqlite_store_prunes_only_what_retention_lets_go() {
    let dir = tempfile::tempdir().unwrap();
    retention_contract(&format!(
        "sqlite://{}",
        dir.path().join("runs.db").display()
    ))
    .await;
}

#[tokio::test]
async fn the_postgres_store_prunes_only_what_retention_lets_go() {
    let database = TestDatabase::create().await;
    retention_contract(&database.url).await;
    database.drop_database().await;
}

/// The schema a store of the release before migrations has: `migrations/*/V1__initial.sql`
/// is that release's schema, word for word.
fn previous_schema(backend: &str) -> String {
    let path = format!(
        "{}/crates/dispatcher/migrations/{backend}/V1__initial.sql",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// What an upgraded store must show: the old run readable and changeable, every migration
/// recorded once, and the new index there.
async fn check_upgraded(url: &str, old: &Job) {
    for _ in 0..2 {
        let store = Store::open(url).await.unwrap();
        let record = store
            .get_run(old.run_id)
            .await
            .unwrap()
            .expect("the old run is kept");
        assert_eq!(record.job, *old);
        assert_eq!(record.state, RunState::Queued);
    }
    let store = Store::open(url).await.unwrap();
    store
        .record_event(&state(old.run_id, RunState::Running, "upgraded"))
        .await
        .unwrap();
    assert_eq!(
        store.get_run(old.run_id).await.unwrap().unwrap().state,
        RunState::Running
    );
}

/// Catches: a schema change that breaks a store made by the release before it (the first
/// one always did, with `CREATE TABLE IF NOT EXISTS` only), or a migration run twice.
#[tokio::test]
async fn a_sqlite_store_of_the_previous_release_is_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("runs.db");
    let old = job("OLD-7", "2026-11-30T10:00:00Z");
    {
        let connection = rusqlite::Connection::open(&path).unwrap();
        connection
            .execute_batch(&previous_schema("sqlite"))
            .unwrap();
        connection
            .execute(
                "INSERT INTO runs (run_id, ticket, state, job, created_at, updated_at) VALUES (?1, 'OLD-7', 'queued', ?2, ?3, ?3)",
                rusqlite::params![old.run_id.to_string(), serde_json::to_string(&old).unwrap(), old.submitted_at],
            )
            .unwrap();
    }
    check_upgraded(&format!("sqlite://{}", path.display()), &old).await;
    let connection = rusqlite::Connection::open(&path).unwrap();
    let versions: Vec<i64> = connection
        .prepare("SELECT version FROM refinery_schema_history ORDER BY version")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        versions,
        [1, 2, 3, 4, 5, 6],
        "every migration, once (V6: the trackers' tables)"
    );
    let index: i64 = connection
        .query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name IN ('runs_by_state_and_change', 'events_by_run_and_kind', 'runs_by_skill')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(index, 3);
}

/// The same for PostgreSQL.
#[tokio::test]
async fn a_postgres_store_of_the_previous_release_is_migrated() {
    let database = TestDatabase::create().await;
    let old = job("OLD-8", "2026-11-30T10:00:00Z");
    let (client, connection) = tokio_postgres::connect(&database.url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let driving = tokio::spawn(connection);
    client
        .batch_execute(&previous_schema("postgres"))
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO runs (run_id, ticket, state, job, created_at, updated_at) VALUES ($1, 'OLD-8', 'queued', $2, $3, $3)",
            &[&old.run_id.to_string(), &serde_json::to_string(&old).unwrap(), &old.submitted_at],
        )
        .await
        .unwrap();
    check_upgraded(&database.url, &old).await;
    let versions: Vec<i32> = client
        .query(
            "SELECT version FROM refinery_schema_history ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        versions,
        [1, 2, 3, 4, 5, 6],
        "every migration, once (V6: the trackers' tables)"
    );
    let index = client
        .query_one(
            "SELECT COUNT(*) FROM pg_indexes WHERE indexname IN ('runs_by_state_and_change', 'events_by_run_and_kind', 'runs_by_skill')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(index.get::<_, i64>(0), 3);
    drop(client);
    let _ = driving.await;
    database.drop_database().await;
}

/// The test CA `scripts/services.sh` made for PostgreSQL's certificate (for `localhost` only).
const TEST_CA: &str = "/etc/postgresql/forgepool-tls/ca.pem";

/// The store's URL for the role `scripts/services.sh` lets in over TLS only.
fn tls_url(host: &str, query: &str) -> String {
    format!("postgres://forgepool_tls:forgepool@{host}:5432/forgepool_tls?{query}")
}

/// Catches: `sslmode` ignored (the role is refused without TLS, so only a TLS connection
/// opens the store), a certificate accepted from an unknown CA or for another name under
/// `verify-full`, a setting the store does not implement taken silently, or a refusal waited
/// on for 30 s as if the server were starting.
#[tokio::test]
async fn the_postgres_store_speaks_tls_and_verify_full_checks_the_server() {
    assert!(
        std::path::Path::new(TEST_CA).is_file(),
        "{TEST_CA} is missing: run `scripts/services.sh` (it sets PostgreSQL up with a test CA)"
    );
    let verified = tls_url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={TEST_CA}"),
    );
    let store = Store::open(&verified).await.unwrap();
    let run = job("TLS-1", "2026-12-04T10:00:00Z");
    store.insert_run(&run).await.unwrap();
    assert_eq!(store.get_run(run.run_id).await.unwrap().unwrap().job, run);
    // Encrypted without checking the server, as libpq's `require`.
    Store::open(&tls_url("127.0.0.1", "sslmode=require"))
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let stranger = dir.path().join("other-ca.pem");
    let made = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=another CA", "-keyout"])
        .arg(dir.path().join("other-ca.key"))
        .arg("-out")
        .arg(&stranger)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let refusals = [
        (tls_url("127.0.0.1", "sslmode=disable"), "no encryption"),
        (tls_url("127.0.0.1", ""), "no encryption"),
        (
            tls_url(
                "localhost",
                &format!("sslmode=verify-full&sslrootcert={}", stranger.display()),
            ),
            "certificate",
        ),
        (
            tls_url(
                "127.0.0.1",
                &format!("sslmode=verify-full&sslrootcert={TEST_CA}"),
            ),
            "certificate",
        ),
        (tls_url("localhost", "sslmode=verify-ca"), "sslmode"),
        (
            tls_url(
                "localhost",
                "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
            ),
            "sslrootcert",
        ),
    ];
    for (url, named) in refusals {
        let started = std::time::Instant::now();
        let error = Store::open(&url).await.map(|_| ()).unwrap_err().to_string();
        assert!(
            error.to_lowercase().contains(named) && error.contains("FORGEPOOL_DATABASE_URL"),
            "{url}: {error}"
        );
        assert!(
            !error.contains(":forgepool@"),
            "the password is never shown: {error}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "{url}: a refusal is not waited on like a server that is starting"
        );
    }
}

#[tokio::test]
async fn the_sqlite_store_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("runs.db").display());
    let store = Store::open(&url).await.unwrap();
    assert_eq!(store.kind(), "sqlite");
    store_contract(&url).await;
}

#[tokio::test]
async fn the_postgres_store_keeps_the_contract() {
    let database = TestDatabase::create().await;
    let store = Store::open(&database.url).await.unwrap();
    assert_eq!(store.kind(), "postgres");
    drop(store);
    store_contract(&database.url).await;
    database.drop_database().await;
}

#[tokio::test]
async fn a_bad_database_url_names_the_setting() {
    let error = Store::open("postgres://nobody:hunter2@db.example:notaport/runs")
        .await
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(error.contains("FORGEPOOL_DATABASE_URL"), "{error}");
    assert!(
        error.contains("db.example"),
        "the message names the server: {error}"
    );
    assert!(
        !error.contains("hunter2"),
        "the password stays out: {error}"
    );
    let error = Store::open("/nonexistent/dir/runs.db")
        .await
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("/nonexistent/dir/runs.db") && error.contains("FORGEPOOL_DATABASE_URL"),
        "{error}"
    );
}

fn log(run_id: Uuid, n: usize) -> Event {
    Event::new(
        run_id,
        EventKind::Log {
            stage: proto::Stage::Implement,
            stream: proto::LogStream::Stdout,
            text: format!("line {n}\n"),
        },
    )
}

/// What the web view reads: the list's skill, profile and cycle count with a skill filter, a
/// run's timeline without its log, its log's tail, and an event's position.
async fn run_view_contract(url: &str) {
    let store = Store::open(url).await.unwrap();
    let run = job("VIEW-1", "2024-02-01T10:00:00Z");
    store.insert_run(&run).await.unwrap();
    let id = run.run_id;
    let running = state(id, RunState::Running, "go");
    store.record_event(&running).await.unwrap();
    for n in 0..30 {
        store.record_event(&log(id, n)).await.unwrap();
    }
    store.record_event(&cycle(id, 1, "REJECTED")).await.unwrap();
    for n in 30..60 {
        store.record_event(&log(id, n)).await.unwrap();
    }
    store.record_event(&cycle(id, 2, "APPROVED")).await.unwrap();

    let filter = |skill: &str| RunFilter {
        ticket: Some("VIEW-1".into()),
        skill: Some(skill.into()),
        limit: 10,
        ..RunFilter::default()
    };
    let (listed, _) = store.list_runs(filter("implement-task")).await.unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let summary = &listed[0];
    assert_eq!(
        (
            summary.skill.as_str(),
            summary.profile.as_str(),
            summary.cycles,
            summary.rounds
        ),
        ("implement-task", "i", 2, 0)
    );
    let (other, _) = store.list_runs(filter("review-only")).await.unwrap();
    assert!(
        other.is_empty(),
        "the skill filter lets another skill's run through"
    );

    let timeline = store
        .events_of_kinds(id, dispatcher::store::TIMELINE_KINDS, false, 100)
        .await
        .unwrap();
    let kinds: Vec<&str> = timeline.iter().map(|(_, e)| e.kind.name()).collect();
    assert_eq!(
        kinds,
        ["state", "cycle", "cycle"],
        "the timeline holds no log line"
    );
    let tail = store.events_of_kinds(id, &["log"], true, 5).await.unwrap();
    let lines: Vec<String> = tail
        .iter()
        .map(|(_, e)| match &e.kind {
            EventKind::Log { text, .. } => text.trim().to_string(),
            other => panic!("not a log line: {other:?}"),
        })
        .collect();
    assert_eq!(
        lines,
        ["line 55", "line 56", "line 57", "line 58", "line 59"]
    );
    assert!(
        tail.windows(2).all(|w| w[0].0 < w[1].0),
        "the tail is oldest first"
    );
    let (position, last) = store.events(id, 0).await.unwrap().pop().unwrap();
    assert_eq!(
        store.position_of(last.event_id).await.unwrap(),
        Some(position)
    );
    assert_eq!(store.position_of(Uuid::new_v4()).await.unwrap(), None);
}

/// Catches: a list that loses the skill, profile or cycle count, a skill filter that filters
/// nothing, a timeline that carries the log (a run page would read every line), a log tail
/// that is the log's head or out of order, and a live event sent at a wrong position.
#[tokio::test]
async fn the_sqlite_store_serves_the_run_view() {
    let dir = tempfile::tempdir().unwrap();
    run_view_contract(dir.path().join("runs.db").to_str().unwrap()).await;
}

/// The same for PostgreSQL.
#[tokio::test]
async fn the_postgres_store_serves_the_run_view() {
    let database = TestDatabase::create().await;
    run_view_contract(&database.url).await;
    database.drop_database().await;
}

/// A profile's daily allotments, held by both backends: 64 gateways asking at once (each for
/// 30 tokens on a day of 1,600) are granted at most the day's budget and one request; hand-backs
/// free budget again; another day, and another profile, start from nothing; the refusal names
/// the setting; the total survives reopening the store.
/// Catches: a read-then-write without a lock (racing grants pass the limit), hand-backs lost,
/// days or profiles sharing a total, allotments kept in memory only.
async fn allotment_contract(url: &str) {
    use dispatcher::store::Allot;
    use proto::allotment::Spend;
    let tokens = |n: u64| Spend {
        tokens: n,
        cost_usd: 0.0,
    };
    let allot = |profile: &str, day: &str, want: u64, returned: u64| Allot {
        profile: profile.into(),
        day: day.into(),
        limits: proto::Budget {
            max_cost_usd: None,
            max_tokens: Some(1600),
        },
        want: tokens(want),
        returned: tokens(returned),
    };
    let store = std::sync::Arc::new(Store::open(url).await.unwrap());
    let asks = (0..64).map(|_| {
        let store = std::sync::Arc::clone(&store);
        let allot = allot("claude", "2026-12-06", 30, 0);
        tokio::spawn(async move { store.allot(allot).await.unwrap() })
    });
    let answers = futures_util::future::join_all(asks).await;
    let granted: u64 = answers
        .iter()
        .filter_map(|a| a.as_ref().unwrap().as_ref().ok())
        .map(|g| g.tokens)
        .sum();
    let refusals: Vec<String> = answers
        .into_iter()
        .filter_map(|a| a.unwrap().err())
        .collect();
    assert!((1600..=1630).contains(&granted), "{url}: granted {granted}");
    assert!(!refusals.is_empty(), "{url}");
    assert!(
        refusals[0].contains("agents.claude.daily_budget.max_tokens"),
        "{url}: {}",
        refusals[0]
    );
    drop(store);
    let store = Store::open(url).await.unwrap();
    // Nothing more today, until a gateway hands back what it did not spend.
    assert!(store
        .allot(allot("claude", "2026-12-06", 1, 0))
        .await
        .unwrap()
        .is_err());
    let after_return = store
        .allot(allot("claude", "2026-12-06", 50, 500))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(after_return.tokens, 100, "{url}: a sixteenth of the day");
    // Another day, another profile: each starts at nothing.
    for (profile, day) in [("claude", "2026-12-07"), ("codex", "2026-12-06")] {
        let first = store
            .allot(allot(profile, day, 30, 0))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(first.tokens, 100, "{url}: {profile} on {day}");
    }
}

#[tokio::test]
async fn the_sqlite_store_keeps_daily_allotments() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("runs.db").display());
    allotment_contract(&url).await;
}

#[tokio::test]
async fn the_postgres_store_keeps_daily_allotments() {
    let database = TestDatabase::create().await;
    allotment_contract(&database.url).await;
    database.drop_database().await;
}

/// Lost executions: the highest count reported is kept (a late, lower report does not lower
/// it), per run, across reopening the store; a run the store does not hold counts nothing.
/// Catches: a count overwritten by an older copy's (the limit never reached), runs sharing a
/// count, a count kept in memory only.
async fn lost_executions_contract(url: &str) {
    let (first, second) = (
        job("LOST-1", "2026-12-06T10:00:00Z"),
        job("LOST-2", "2026-12-06T10:00:01Z"),
    );
    {
        let store = Store::open(url).await.unwrap();
        store.insert_run(&first).await.unwrap();
        store.insert_run(&second).await.unwrap();
        assert_eq!(store.record_lost(first.run_id, 3).await.unwrap(), 3);
        assert_eq!(
            store.record_lost(first.run_id, 2).await.unwrap(),
            3,
            "{url}"
        );
        assert_eq!(
            store.record_lost(first.run_id, 7).await.unwrap(),
            7,
            "{url}"
        );
        assert_eq!(store.record_lost(Uuid::new_v4(), 4).await.unwrap(), 0);
    }
    let store = Store::open(url).await.unwrap();
    assert_eq!(
        store.record_lost(first.run_id, 1).await.unwrap(),
        7,
        "{url}"
    );
    assert_eq!(
        store.record_lost(second.run_id, 1).await.unwrap(),
        1,
        "{url}"
    );
}

#[tokio::test]
async fn the_sqlite_store_keeps_lost_executions() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("runs.db").display());
    lost_executions_contract(&url).await;
}

#[tokio::test]
async fn the_postgres_store_keeps_lost_executions() {
    let database = TestDatabase::create().await;
    lost_executions_contract(&database.url).await;
    database.drop_database().await;
}

/// The trackers' part of the store (SPEC 17), on one backend: a delivery id is seen once in
/// 24 hours and can be forgotten; a claim is stored once whoever races for it, found again
/// after the store is reopened (a dispatcher restart), listed by issue and, until its comment
/// is final, among the unfinished.
async fn trackers_contract(url: &str) {
    use dispatcher::store::trackers::Claim;
    let store = Store::open(url).await.unwrap();
    assert!(!store.tracker_delivery_seen("gh", "d-1").await.unwrap());
    assert!(store.tracker_delivery_seen("gh", "d-1").await.unwrap());
    assert!(
        !store.tracker_delivery_seen("other", "d-1").await.unwrap(),
        "per tracker"
    );
    store.tracker_delivery_forget("gh", "d-1").await.unwrap();
    assert!(
        !store.tracker_delivery_seen("gh", "d-1").await.unwrap(),
        "forgotten"
    );
    let claim = Claim {
        tracker: "gh".into(),
        claim: "acme/shop#7#label".into(),
        issue: "acme/shop#7".into(),
        run_id: Uuid::new_v4(),
        comment_id: None,
        finished: false,
    };
    // Eight racers for one claim: one wins.
    let racers = (0..8).map(|_| {
        let (store, mut claim) = (store.clone(), claim.clone());
        claim.run_id = Uuid::new_v4();
        tokio::spawn(async move { store.tracker_claim(&claim).await.unwrap() })
    });
    let won: Vec<bool> = futures_util::future::join_all(racers)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    assert_eq!(won.iter().filter(|w| **w).count(), 1, "{won:?}");
    drop(store);
    let store = Store::open(url).await.unwrap();
    let kept = store
        .tracker_claim_of("gh", "acme/shop#7#label")
        .await
        .unwrap()
        .expect("the claim survives a reopen");
    assert_eq!(
        store
            .tracker_claims(Some("gh"), Some("acme/shop#7"))
            .await
            .unwrap(),
        vec![kept.clone()]
    );
    assert_eq!(store.tracker_claims(None, None).await.unwrap().len(), 1);
    store.tracker_comment(&kept, 42, true).await.unwrap();
    let done = store
        .tracker_claim_of("gh", "acme/shop#7#label")
        .await
        .unwrap()
        .unwrap();
    assert_eq!((done.comment_id, done.finished), (Some(42), true));
    assert!(store.tracker_claims(None, None).await.unwrap().is_empty());
}

/// Catches: a claim or delivery that does not hold across racers or a restart on SQLite.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_store_keeps_tracker_claims_and_deliveries() {
    let dir = tempfile::tempdir().unwrap();
    trackers_contract(&format!(
        "sqlite://{}",
        dir.path().join("runs.db").display()
    ))
    .await;
}

/// Catches: the same on PostgreSQL (two dispatcher replicas share it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_keeps_tracker_claims_and_deliveries() {
    let database = TestDatabase::create().await;
    trackers_contract(&database.url).await;
    database.drop_database().await;
}
