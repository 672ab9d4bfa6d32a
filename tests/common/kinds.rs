//! Profiles of the real agent kinds against the fake model server ([`super::model`]), shared
//! by `tests/agents.rs` and `benches/agent_kinds.rs`.

use std::process::Command;

use proto::AgentKind;

use super::model::{FakeModel, REVIEWER_MARK};
use super::Fixture;

/// The file the implementer writes.
pub const FILE: &str = "hello.txt";
/// Its content.
pub const CONTENT: &str = "hello from a real agent";

/// The variable each kind's key is read from, and the key the test gives it.
pub fn key_variable(kind: AgentKind) -> &'static str {
    match kind {
        AgentKind::ClaudeCode => "ANTHROPIC_API_KEY",
        AgentKind::GeminiCli => "GEMINI_API_KEY",
        _ => "OPENAI_API_KEY",
    }
}

/// The key a test gives a kind's CLI (the fake model takes any).
pub fn key(kind: AgentKind) -> String {
    format!("fake-key-{}-0123456789", kind.as_str())
}

/// Fails, saying how to build them, when the kind's image or the egress proxy's is missing.
pub fn require_images(kind: AgentKind) {
    for image in [kind.default_image().unwrap(), "forgepool:dev".to_string()] {
        let found = super::output_within(
            Command::new("docker").args(["image", "inspect", &image]),
            super::COMMAND_LIMIT,
        );
        assert!(
            found.status.success(),
            "the image {image} is missing: build it with `scripts/build-agent-images.sh {}` (agent images) and `scripts/build-forgepool-image.sh --debug` (the egress proxy)",
            kind.as_str()
        );
    }
}

/// The skill's review, which the fake model recognises as the reviewer's prompt.
pub fn review() -> String {
    format!(
        "---\nmax_retries: 3\n---\n# Review\n{REVIEWER_MARK}: check that {FILE} greets. Answer APPROVED or REJECTED with the reason.\n"
    )
}

/// The API a kind's CLI speaks, as a providers file names it.
pub fn api(kind: AgentKind) -> &'static str {
    match kind {
        AgentKind::ClaudeCode => "anthropic-messages",
        AgentKind::Codex => "openai-responses",
        AgentKind::GeminiCli => "gemini",
        _ => "openai-chat",
    }
}

/// The provider a kind's profile names for a fake model.
pub fn provider(kind: AgentKind, model: &FakeModel) -> String {
    format!("fake{}-{}", model.port, api(kind))
}

/// A providers file (SPEC 16) with, for each fake model, one provider per API at its
/// loopback address, its key read from the variable the kind's CLI would have used.
pub fn providers(models: &[&FakeModel]) -> String {
    let mut text = String::new();
    for model in models {
        for (api, key) in [
            ("anthropic-messages", "ANTHROPIC_API_KEY"),
            ("openai-responses", "OPENAI_API_KEY"),
            ("openai-chat", "OPENAI_API_KEY"),
            ("gemini", "GEMINI_API_KEY"),
        ] {
            text.push_str(&format!(
                "[[provider]]\nname = \"fake{}-{api}\"\napi = \"{api}\"\nbase_url = \"http://127.0.0.1:{}\"\nkey_env = \"{key}\"\n\n",
                model.port, model.port
            ));
        }
    }
    text
}

/// A profile `name` of `kind` against the fake model, through the worker's model gateway:
/// its provider, no key and no network of its own.
pub fn profile(kind: AgentKind, name: &str, model: &FakeModel) -> String {
    format!(
        "[agents.{name}]\nkind = \"{}\"\nmodel = \"fake-model\"\nprovider = \"{}\"\nmemory = \"2g\"\ncpus = 1.0\ntimeout_seconds = 300\n",
        kind.as_str(),
        provider(kind, model),
    )
}

/// A fixture whose implementer and reviewer are `kind`'s real CLI against the fake.
pub fn fixture(kind: AgentKind, model: &FakeModel) -> Fixture {
    require_images(kind);
    let fixture = Fixture::new(Some(&review()), &["change"], &["approve"]);
    std::fs::write(fixture.providers_file(), providers(&[model])).unwrap();
    std::fs::write(
        &fixture.agents,
        format!(
            "[defaults]\nimplementer = \"impl\"\nreviewer = \"rev\"\n\n{}\n{}",
            profile(kind, "impl", model),
            profile(kind, "rev", model)
        ),
    )
    .unwrap();
    fixture
}
