//! The clients of the dispatcher as a script or a person uses them: JSON output, status
//! filters and headers, no escape codes off a terminal or with `NO_COLOR`, timestamps,
//! completions and the manual, the exit code of an unreachable dispatcher, and a watch that
//! survives broken streams without printing an event twice.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::cluster::Cluster;
use common::{output_within, Fixture};

const REVIEW: &str = "---\nmax_retries: 2\n---\n# Check\n";
const LIMIT: Duration = Duration::from_secs(120);

/// `forgepool ARGS` against `url`; its exit code, stdout and stderr.
fn forgepool(url: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_forgepool"));
    command
        .args(args)
        .env("FORGEPOOL_DISPATCHER_URL", url)
        .env_remove("FORGEPOOL_API_TOKEN")
        .env_remove("NO_COLOR")
        .envs(env.iter().copied());
    let output = output_within(&mut command, LIMIT);
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The JSON lines of `text`, each parsed; panics naming a line that is not JSON.
fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"))
        })
        .collect()
}

/// Catches: completions or a manual page that are empty, do not name the commands, or are
/// not valid for their shell; a manual without the exit codes.
#[test]
fn completions_and_the_manual_are_generated() {
    for shell in ["bash", "zsh", "fish"] {
        let (code, script, _) = forgepool("http://127.0.0.1:9", &["completions", shell], &[]);
        assert_eq!(code, 0, "{shell}");
        for word in [
            "submit",
            "watch",
            "status",
            "cancel",
            "resume",
            "output",
            "timestamps",
        ] {
            assert!(script.contains(word), "the {shell} completions lack {word}");
        }
    }
    let (_, bash, _) = forgepool("http://127.0.0.1:9", &["completions", "bash"], &[]);
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), bash).unwrap();
    let checked = output_within(Command::new("bash").arg("-n").arg(file.path()), LIMIT);
    assert!(checked.status.success(), "{checked:?}");
    let (code, page, _) = forgepool("http://127.0.0.1:9", &["man"], &[]);
    assert_eq!(code, 0);
    assert!(
        page.starts_with(".ie") || page.starts_with(".TH"),
        "{}",
        &page[..80.min(page.len())]
    );
    assert!(
        page.contains(".SH \"EXIT STATUS\"") && page.contains("69"),
        "{page}"
    );
}

/// A port that accepts connections and never answers.
fn black_hole() -> (String, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let held = std::thread::spawn(move || {
        let mut kept = Vec::new();
        listener.set_nonblocking(true).unwrap();
        for _ in 0..100 {
            if let Ok((stream, _)) = listener.accept() {
                kept.push(stream);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    (url, held)
}

/// Catches: a client that hangs on a dispatcher that never answers (no time limit), and an
/// unreachable dispatcher reported with the exit code of a failed run.
#[test]
fn an_unreachable_dispatcher_has_its_own_exit_code() {
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    for args in [
        vec!["status"],
        vec!["watch", "00000000-0000-0000-0000-000000000000"],
        vec!["cancel", "00000000-0000-0000-0000-000000000000"],
    ] {
        let (code, stdout, stderr) = forgepool(&closed, &args, &[]);
        assert_eq!(code, 69, "{args:?}: {stdout}{stderr}");
        assert!(
            stderr.contains("cannot reach the dispatcher") && stderr.contains(&closed),
            "{stderr}"
        );
    }
    let (silent, held) = black_hole();
    let (code, _, stderr) = forgepool(&silent, &["status", "--timeout", "1"], &[]);
    assert_eq!(code, 69, "{stderr}");
    assert!(stderr.contains("no answer within"), "{stderr}");
    let _ = held.join();
}

/// A proxy to `target` that cuts every connection in the middle of its sixth Server-Sent
/// Event: a client must connect again and go on after the last event it got. Returns its
/// address and the number of connections it cut.
fn cutting_proxy(target: String) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let cuts = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&cuts);
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let counted = Arc::clone(&counted);
            let target = target.clone();
            std::thread::spawn(move || relay(client, &target, &counted));
        }
    });
    (address, cuts)
}

fn relay(mut client: TcpStream, target: &str, cuts: &AtomicUsize) {
    let Ok(mut server) = TcpStream::connect(target) else {
        return;
    };
    let (mut client_reader, mut server_writer) =
        (client.try_clone().unwrap(), server.try_clone().unwrap());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut client_reader, &mut server_writer);
    });
    let mut events = 0;
    let mut previous = 0u8;
    let mut buffer = [0u8; 512];
    while let Ok(read) = server.read(&mut buffer) {
        if read == 0 {
            break;
        }
        for (at, byte) in buffer[..read].iter().enumerate() {
            if previous == b'\n' && *byte == b'\n' {
                events += 1;
                if events == 6 {
                    // Half of what follows the fifth event's end, then the cut.
                    let end = at + 1 + (read - at - 1) / 2;
                    let _ = client.write_all(&buffer[..end]);
                    cuts.fetch_add(1, Ordering::SeqCst);
                    let _ = client.shutdown(Shutdown::Both);
                    let _ = server.shutdown(Shutdown::Both);
                    return;
                }
            }
            previous = *byte;
        }
        if client.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    let _ = client.shutdown(Shutdown::Both);
}

/// Catches: JSON output that is not JSON (or mixes text in), a status list without headers or
/// that ignores its filters, escape codes written off a terminal or with `NO_COLOR` on one,
/// timestamps missing, and a watch that stops at a broken stream or prints an event twice
/// (or loses one) when it connects again.
#[tokio::test(flavor = "multi_thread")]
async fn the_clients_script_well_and_watch_through_broken_streams() {
    let fixture = Fixture::new(Some(REVIEW), &["change"], &["rules"]);
    let cluster = Cluster::start(fixture, 1, 2, None).await;
    let url = cluster.url();
    let request = cluster.fixture.dir.path().join("request.json");
    std::fs::write(
        &request,
        cluster
            .request_body("CLI-1", serde_json::json!({}))
            .to_string(),
    )
    .unwrap();

    // submit --output json: one JSON document.
    let (code, stdout, stderr) = tokio::task::block_in_place(|| {
        forgepool(
            &url,
            &["submit", request.to_str().unwrap(), "--output", "json"],
            &[],
        )
    });
    assert_eq!(code, 0, "{stderr}");
    let accepted: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    let run_id = accepted["run_id"].as_str().unwrap().to_string();

    // watch --output json through a proxy that cuts the stream again and again.
    let target = url.trim_start_matches("http://").to_string();
    let (proxied, cuts) = cutting_proxy(target);
    let (code, stdout, stderr) = tokio::task::block_in_place(|| {
        forgepool(&proxied, &["watch", &run_id, "--output", "json"], &[])
    });
    assert_eq!(code, 0, "{stderr}");
    assert!(
        cuts.load(Ordering::SeqCst) >= 2,
        "the proxy never cut the stream"
    );
    let watched: Vec<String> = json_lines(&stdout)
        .iter()
        .map(|event| event["event_id"].as_str().unwrap().to_string())
        .collect();
    let stored: Vec<String> = cluster
        .event_stream(&run_id)
        .await
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(|data| serde_json::from_str::<serde_json::Value>(data.trim()).unwrap())
        .map(|event| event["event_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        watched,
        stored[..watched.len()],
        "the watch printed an event twice, lost one, or changed their order"
    );
    assert!(watched.len() >= stored.len() - 1, "the watch stopped early");

    // Plain text off a terminal: no escape code; timestamps when asked.
    let (code, stdout, stderr) =
        tokio::task::block_in_place(|| forgepool(&url, &["watch", &run_id, "--timestamps"], &[]));
    assert_eq!(code, 0, "{stderr}");
    assert!(
        !stdout.contains('\x1b') && !stderr.contains('\x1b'),
        "{stdout:?}"
    );
    let cycle = stdout
        .lines()
        .find(|line| line.contains("Review cycle 1/"))
        .unwrap_or_else(|| panic!("no review line: {stdout}"));
    assert!(
        cycle.starts_with("20") && cycle.contains('T') && cycle.contains("Z Review cycle"),
        "{cycle}"
    );

    // On a terminal (a pseudo-terminal made by `script`), NO_COLOR keeps escape codes out.
    let watch = format!(
        "{} watch {run_id} --dispatcher-url {url}",
        shell_quoted(env!("CARGO_BIN_EXE_forgepool"))
    );
    let on_terminal = |no_color: &str| {
        let mut command = Command::new("script");
        command
            .args(["-qec", &watch, "/dev/null"])
            .env("NO_COLOR", no_color);
        String::from_utf8_lossy(&output_within(&mut command, LIMIT).stdout).into_owned()
    };
    let coloured = tokio::task::block_in_place(|| on_terminal(""));
    assert!(
        coloured.contains("\x1b["),
        "a terminal gets colour: {coloured:?}"
    );
    let plain = tokio::task::block_in_place(|| on_terminal("1"));
    assert!(
        plain.contains("Review cycle") && !plain.contains('\x1b'),
        "{plain:?}"
    );

    // status: headers and filters, and JSON.
    let other = cluster.submit("CLI-2").await;
    cluster
        .wait_terminal(std::slice::from_ref(&other), LIMIT)
        .await;
    let (code, stdout, _) = tokio::task::block_in_place(|| {
        forgepool(
            &url,
            &["status", "--ticket", "CLI-1", "--state", "delivered"],
            &[],
        )
    });
    assert_eq!(code, 0);
    let mut lines = stdout.lines();
    let header = lines.next().unwrap();
    assert!(
        header.starts_with("RUN") && header.contains("STATE") && header.contains("TICKET"),
        "{header}"
    );
    let rows: Vec<&str> = lines.by_ref().take_while(|l| !l.is_empty()).collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert!(
        rows[0].starts_with(&run_id) && rows[0].contains("CLI-1"),
        "{stdout}"
    );
    // The live workers follow, by host: the one worker, on this machine.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let pool: Vec<&str> = lines.collect();
    assert!(
        pool.first() == Some(&"1 live worker on 1 host:") && pool.len() == 3,
        "{stdout}"
    );
    assert!(
        pool[2].starts_with(host.trim()) && pool[2].contains(&format!("{}-w0", cluster.prefix)),
        "{stdout}"
    );
    let (code, stdout, _) = tokio::task::block_in_place(|| {
        forgepool(&url, &["status", "--limit", "1", "--output", "json"], &[])
    });
    assert_eq!(code, 0);
    let list: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert_eq!(list["runs"].as_array().unwrap().len(), 1);
    assert_eq!(list["runs"][0]["run_id"], other.as_str());
    assert!(list["next_cursor"].is_string(), "{list}");
    let (code, _, stderr) =
        tokio::task::block_in_place(|| forgepool(&url, &["status", "--state", "sleeping"], &[]));
    assert_eq!(code, 2, "a bad filter is the caller's mistake: {stderr}");
    assert!(stderr.contains("state"), "{stderr}");

    // cancel --output json of a finished run: refused, exit 2, no JSON on stdout.
    let (code, stdout, _) = tokio::task::block_in_place(|| {
        forgepool(&url, &["cancel", &run_id, "--output", "json"], &[])
    });
    assert_eq!(code, 2);
    assert!(stdout.is_empty(), "{stdout}");
}

/// Catches: a terminal that gets no spinner, a spinner without the stage, and a queued run
/// whose watcher is not told its place in the queue.
#[tokio::test(flavor = "multi_thread")]
async fn a_terminal_shows_the_stage_and_the_queue_position() {
    let fixture = Fixture::new(None, &["sleep", "3"], &["approve"]);
    // No worker yet: the runs wait in the queue.
    let mut cluster = Cluster::start(fixture, 0, 1, None).await;
    let url = cluster.url();
    let first = cluster.submit("SPIN-1").await;
    let second = cluster.submit("SPIN-2").await;
    let on_terminal = |run: &str, seconds: &str| {
        let watch = format!(
            "{} watch {run} --dispatcher-url {url}",
            shell_quoted(env!("CARGO_BIN_EXE_forgepool"))
        );
        let mut command = Command::new("timeout");
        command
            .args(["-s", "INT", seconds, "script", "-qefc", &watch, "/dev/null"])
            .env_remove("NO_COLOR");
        let output = output_within(&mut command, LIMIT);
        (
            output.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        )
    };
    let (code, queued) = tokio::task::block_in_place(|| on_terminal(&second, "4"));
    assert!(
        queued.contains("queued") && queued.contains("1 ahead in the queue"),
        "{code:?} {queued:?}"
    );
    assert!(
        queued.contains('⠋') || queued.contains('⠙'),
        "no spinner: {queued:?}"
    );
    cluster.start_worker("w0", 1);
    let (code, running) = tokio::task::block_in_place(|| on_terminal(&first, "60"));
    assert_eq!(code, Some(0), "{running:?}");
    assert!(running.contains("implement (round 1) 0m0"), "{running:?}");
    cluster
        .wait_terminal(&[first.clone(), second.clone()], LIMIT)
        .await;
}

/// The dispatcher migrates its store in a short-lived child (so refinery's regex engine never
/// lives in the dispatcher). A store the migrations refuse (its history names a V1 that is not
/// this release's) stops the dispatcher at once with refinery's reason; a store that cannot be
/// opened too, and a password in a PostgreSQL URL is shown nowhere.
/// Catches: a child whose failure is lost (the dispatcher, which no longer migrates, starting
/// on a store whose schema it does not know) or whose message is replaced by a bare status.
#[test]
fn a_store_that_cannot_be_migrated_stops_the_dispatcher_with_its_reason() {
    let dir = tempfile::tempdir().unwrap();
    let skills = dir.path().join("skills");
    std::fs::create_dir_all(&skills).unwrap();
    let agents = dir.path().join("agents.toml");
    std::fs::write(&agents, "").unwrap();
    let database = dir.path().join("no-such-folder/runs.db");
    let dispatcher = |database: &str| {
        let (skills, agents) = (skills.to_str().unwrap(), agents.to_str().unwrap());
        forgepool(
            "http://127.0.0.1:9",
            &[
                "dispatcher",
                "--listen",
                "127.0.0.1:0",
                "--skills",
                skills,
                "--agents",
                agents,
            ],
            &[
                ("FORGEPOOL_JOB_KEY", "cli-test-job-key-0123456789"),
                ("FORGEPOOL_DATABASE_URL", database),
            ],
        )
    };
    // Opens fine, but the migrations refuse it: only the child can tell.
    let diverged = dir.path().join("diverged.db");
    rusqlite::Connection::open(&diverged)
        .unwrap()
        .execute_batch(
            "CREATE TABLE refinery_schema_history (version INT4 PRIMARY KEY, name VARCHAR(255), \
             applied_on VARCHAR(255), checksum VARCHAR(255)); \
             INSERT INTO refinery_schema_history VALUES (1, 'another', '2020-01-01T00:00:00Z', '1');",
        )
        .unwrap();
    let (code, stdout, stderr) = dispatcher(diverged.to_str().unwrap());
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(stderr.contains("migrating the schema"), "{stderr}");
    assert!(!stdout.contains("dispatcher listening"), "{stdout}");
    let started = std::time::Instant::now();
    let (code, stdout, stderr) = dispatcher(database.to_str().unwrap());
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(stderr.contains("no-such-folder/runs.db"), "{stderr}");
    assert!(!stdout.contains("dispatcher listening"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(60));
    let (code, _, stderr) =
        dispatcher("postgres://forgepool:hunter2-secret@127.0.0.1:5432/forgepool");
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("127.0.0.1:5432"), "{stderr}");
    assert!(!stderr.contains("hunter2-secret"), "{stderr}");
}

/// `text` as one word of a shell command line (`script -c` runs one): a binary path with a
/// space in it stays one word.
fn shell_quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}
