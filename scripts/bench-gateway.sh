#!/usr/bin/env bash
# The model gateway's latency, side by side with one LiteLLM proxy process on the same fake
# provider and the same load generator (crates/gateway/benches/latency.rs; results in
# docs/BENCHMARKS.md, "The model gateway"). Installs LiteLLM into .tools/litellm (PyPI
# `litellm[proxy]`, on first use). Usage: scripts/bench-gateway.sh [--no-litellm]
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
dir="$PWD/.tools/litellm"
version=1.108.7
if [ "${1:-}" != --no-litellm ]; then
  if ! [ -x "$dir/bin/litellm" ] || ! "$dir/bin/pip" show litellm 2>/dev/null | grep -q "^Version: $version$"; then
    echo "bench-gateway: installing litellm[proxy] $version into .tools/litellm (about a minute)"
    python3 -m venv "$dir" 2>/dev/null || {
      apt_install python3-venv
      python3 -m venv "$dir"
    }
    "$dir/bin/pip" install --quiet --disable-pip-version-check "litellm[proxy]==$version"
  fi
  export LITELLM="$dir/bin/litellm"
fi
exec cargo bench -p forgepool-gateway --bench latency
