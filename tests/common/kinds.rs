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

/// A profile `name` of `kind` against the fake model: its endpoint, its key's variable, and
/// `network = "egress"` allowing only the fake.
pub fn profile(kind: AgentKind, name: &str, model: &FakeModel) -> String {
    let host = format!("{}:{}", super::bridge_gateway(), model.port);
    format!(
        "[agents.{name}]\nkind = \"{}\"\nmodel = \"fake-model\"\nbase_url = \"http://{host}{}\"\nenv = [\"{}\"]\nnetwork = \"egress\"\negress = [\"{host}\"]\nmemory = \"2g\"\ncpus = 1.0\ntimeout_seconds = 300\n",
        kind.as_str(),
        if matches!(kind, AgentKind::ClaudeCode | AgentKind::GeminiCli) { "" } else { "/v1" },
        key_variable(kind),
    )
}

/// A fixture whose implementer and reviewer are `kind`'s real CLI against the fake.
pub fn fixture(kind: AgentKind, model: &FakeModel) -> Fixture {
    require_images(kind);
    let fixture = Fixture::new(Some(&review()), &["change"], &["approve"]);
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
