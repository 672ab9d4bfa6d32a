#!/usr/bin/env bash
# Builds forgepool's agent images from local files (no registry needed):
#   forgepool-test-agent:dev      the deterministic agents the end-to-end tests use
#   forgepool-example-agent:dev   the agents of the example in examples/
# Needs a running Docker engine (scripts/services.sh starts one) and Debian's busybox-static.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
export DOCKER_BUILDKIT=0

# The images need a statically linked busybox: Debian's busybox-static.
if ! (ldd /bin/busybox 2>&1 || true) | grep -q "not a dynamic"; then
  echo "installing busybox-static" >&2
  apt_install busybox-static
fi

build() {
  local tag="$1" dir="$2"
  local context
  context="$(mktemp -d)"
  cp -r "$dir"/. "$context"/
  cp /bin/busybox "$context/busybox"
  # The legacy builder's deprecation notice is noise here; any other output shows on failure.
  docker build -q -t "$tag" "$context" >/dev/null 2>"$context.err" || { cat "$context.err" >&2; exit 1; }
  rm -rf "$context" "$context.err"
  echo "built $tag"
}

build forgepool-test-agent:dev tests/images/agent
build forgepool-example-agent:dev examples/images/agent
