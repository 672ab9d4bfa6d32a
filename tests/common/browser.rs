//! The browser tests' driver: Debian's Chromium through Playwright (`tests/browser/view.js`,
//! installed by `scripts/browser-tools.sh`), one phase per call.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::cluster::Cluster;
use super::output_within;

/// The browser tools, or a failure saying how to install them.
pub fn browser_tools() -> PathBuf {
    let modules = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/browser/node_modules");
    assert!(
        modules.join("playwright-core/package.json").exists()
            && Path::new("/usr/bin/chromium").exists(),
        "the browser tests need Chromium and playwright-core: run scripts/browser-tools.sh"
    );
    modules
}

/// Runs one phase of the browser script (off the runtime: it takes a while); panics with its
/// output and the services' logs when a check failed.
pub async fn browse(cluster: &Cluster, token: &str, phase: &str, env: &[(&str, &str)]) -> String {
    let shots = Path::new(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let mut command = Command::new("node");
    command
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser/view.js"))
        .env("NODE_PATH", browser_tools())
        .env("URL", cluster.url())
        .env("TOKEN", token)
        .env("PHASE", phase)
        .env("SHOTS", &shots)
        .envs(env.iter().copied());
    let output =
        tokio::task::spawn_blocking(move || output_within(&mut command, Duration::from_secs(240)))
            .await
            .unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "the browser phase {phase} failed:\n{printed}\n{}",
        cluster.logs()
    );
    println!("{printed}");
    printed
}
