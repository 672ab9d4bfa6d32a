#!/usr/bin/env bash
# Sets up the services, builds the test images, checks the Helm chart, and runs every test:
# unit tests with in-memory seams and end-to-end tests against the real Docker engine,
# RabbitMQ, PostgreSQL and real git repositories.
# Afterwards it checks that no forgepool container is left on the engine.
set -euo pipefail
cd "$(dirname "$0")/.."
# A clone where the worker hosts of tests/hosts.rs cannot see it is refused now, not after
# half an hour.
scripts/hosts.sh check

scripts/services.sh
# The scripts themselves: every expansion quoted, so that they work from any folder (a path
# with a space included).
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
command -v shellcheck >/dev/null || apt_install shellcheck
shellcheck -x scripts/*.sh scripts/lib/*.sh .ci/run
# The check after the suite counts this suite's containers: any an earlier run on this machine
# left (a session or a CI run that was killed) go first.
stale="$(docker ps -aq --filter label=forgepool.managed=true)"
if [ -n "$stale" ]; then
  echo "removing $(echo "$stale" | wc -l) forgepool containers an earlier run left"
  # shellcheck disable=SC2086 # one container id per word
  docker rm -f $stale >/dev/null 2>&1 || true
fi
# Three more RabbitMQ nodes in one cluster, for the broker-failover test (tests/brokers.rs).
scripts/rabbit-cluster.sh up
scripts/build-images.sh
# The real agent CLIs' images (tests/agents.rs); an image already built at its pinned version is kept.
scripts/build-agent-images.sh
scripts/chart-check.sh
scripts/forge-tools.sh
scripts/api-tools.sh
scripts/browser-tools.sh
# The structural invariants of ARCHITECTURE.md (file and function sizes, where lapin and
# bollard may appear, no circle of files).
python3 scripts/structure-check.py
# Formatting and lints over every crate of the workspace, tests included.
cargo fmt --all --check
cargo clippy --workspace --all-targets --all-features -- -D warnings
# The forgepool image, from the debug build the tests use (tests/image.rs runs it).
scripts/build-forgepool-image.sh --debug

# The tests are built with the worker's fault points (the `fault-points` feature): the
# crash-point tests kill a worker at each phase boundary. No other build has them.
# The fault tests restart the shared broker and change its settings, so they run on their
# own, one at a time, after everything else, even when a test before them failed. Panics print
# no backtrace: a stuck run's failure message ends with a summary of each service's threads.
# When a test failed, scripts/diagnose.sh prints the services' state last.
failed=0
if cargo nextest --version >/dev/null 2>&1; then
  RUST_BACKTRACE=0 cargo nextest run --workspace --features fault-points --no-fail-fast -E 'not binary(faults)' || failed=1
  RUST_BACKTRACE=0 cargo nextest run --features fault-points --no-fail-fast --test faults -j 1 || failed=1
else
  RUST_BACKTRACE=0 cargo test --workspace --features fault-points --no-fail-fast -- --skip a_broker_restart --skip a_run_longer --skip sigterm_drains || failed=1
  RUST_BACKTRACE=0 cargo test --features fault-points --no-fail-fast --test faults -- --test-threads 1 || failed=1
fi
if [ "$failed" -ne 0 ]; then
  # The end of the output is what CI shows: the services' state when the suite failed.
  scripts/diagnose.sh || true
  echo "some tests failed (see above)" >&2
  exit 1
fi

left="$(docker ps -aq --filter label=forgepool.managed=true)"
if [ -n "$left" ]; then
  echo "forgepool containers were left after the suite:" >&2
  docker ps -a --filter label=forgepool.managed=true >&2
  exit 1
fi
echo "no forgepool container is left"
