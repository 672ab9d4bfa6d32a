//! The fake model server of the agent tests (`tests/common/model.rs`), as a program for
//! `scripts/example.sh --agent KIND`: a real agent CLI works against it with no key and no
//! internet. It speaks Anthropic Messages, OpenAI Responses and Chat Completions, and Gemini.
//!
//! Usage: `fake_model PORT_FILE REVIEWER_MARK FEEDBACK FILE CONTENT_FILE [FILE CONTENT_FILE]`:
//! the implementer writes FILE (then the second FILE once the reviewer's feedback came back);
//! a reviewer (its prompt holds REVIEWER_MARK) rejects with FEEDBACK once, then approves. The
//! port it listens on (on every address) is written to PORT_FILE; it runs until stopped.

#[allow(dead_code)]
#[path = "../tests/common/model.rs"]
mod model;

use model::{FakeModel, Script};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 5 && args.len() != 7 {
        eprintln!("usage: fake_model PORT_FILE REVIEWER_MARK FEEDBACK FILE CONTENT_FILE [FILE CONTENT_FILE]");
        std::process::exit(2);
    }
    let read = |path: &str| {
        std::fs::read_to_string(path).unwrap_or_else(|e| {
            eprintln!("fake_model: cannot read {path}: {e}");
            std::process::exit(2)
        })
    };
    let mut script = Script::writing(&args[3], &read(&args[4]), 0);
    script.reviewer_mark = args[1].clone();
    script.feedback = args[2].clone();
    script.approval =
        "APPROVED: reserve() rejects negative quantities and a test covers it.".into();
    if args.len() == 7 {
        script.after_feedback = Some((args[5].clone(), read(&args[6])));
    }
    let model = FakeModel::start(script).await;
    if let Err(e) = std::fs::write(&args[0], model.port.to_string()) {
        eprintln!("fake_model: cannot write {}: {e}", args[0]);
        std::process::exit(2);
    }
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    model.stop();
}
