#!/usr/bin/env bash
# The exactly-once soak (docs/RELIABILITY.md): services, images, a release build, then
# scripts/soak.py [RUNS [MINUTES]]. Not part of CI: it takes up to 20 minutes and restarts the
# shared broker and database.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
scripts/build-images.sh
cargo build --release
exec python3 scripts/soak.py "$@"
