#!/usr/bin/env bash
# The exactly-once soak (docs/RELIABILITY.md): services, images, a release build, then
# scripts/soak.py [RUNS [MINUTES]]; with --hosts first, the soak across worker hosts and three
# broker nodes (scripts/soak-hosts.py [RUNS [MINUTES]]). Not part of CI: it takes up to 20 minutes and restarts the
# shared broker and database.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
scripts/build-images.sh
cargo build --release
if [ "${1:-}" = --hosts ]; then
  # The pool across hosts and broker nodes: scripts/soak-hosts.py (docs/RELIABILITY.md).
  shift
  scripts/rabbit-cluster.sh up
  exec python3 scripts/soak-hosts.py "$@"
fi
exec python3 scripts/soak.py "$@"
