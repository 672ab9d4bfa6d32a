#!/usr/bin/env bash
# Builds the forgepool image `forgepool:dev` on a machine without a container registry:
#   1. a Debian bookworm base with git and CA certificates, from debootstrap, imported once as
#      `forgepool-base:bookworm` (about a minute; reused afterwards);
#   2. the forgepool binary, built here with cargo (`--debug` takes the debug build, as the
#      tests do; the default is a release build);
#   3. docker/Dockerfile.local: the base plus the binary, as the non-root user 10001.
# With a registry, the multi-stage `Dockerfile` at the top of the repository does the same.
# Needs root, a running Docker engine (scripts/services.sh), and Debian's mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
export DOCKER_BUILDKIT=0
profile=release
[ "${1:-}" = "--debug" ] && profile=debug
tag="${FORGEPOOL_IMAGE:-forgepool:dev}"

if ! docker image inspect forgepool-base:bookworm >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || {
    apt_install debootstrap
  }
  root="$(mktemp -d)"
  trap 'rm -rf "$root"' EXIT
  echo "building forgepool-base:bookworm with debootstrap" >&2
  debootstrap --variant=minbase --include=git,ca-certificates,openssh-client \
    bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import - forgepool-base:bookworm >/dev/null
fi

if [ "$profile" = release ]; then
  cargo build --release --bin forgepool
else
  cargo build --bin forgepool
fi
context="$(mktemp -d)"
cp "target/$profile/forgepool" "$context/forgepool"
cp docker/Dockerfile.local "$context/Dockerfile"
docker build -q -t "$tag" "$context" >/dev/null 2>"$context.err" || { cat "$context.err" >&2; exit 1; }
rm -rf "$context" "$context.err"
echo "built $tag ($profile)"
