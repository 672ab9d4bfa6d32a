#!/usr/bin/env bash
# Installs (when missing) and starts the services forgepool's tests and examples use:
# the Docker engine. Safe to run again: running services are left alone.
# Needs root on Debian 12.
set -euo pipefail

log() { echo "services: $*" >&2; }

apt_install() {
  if [ -z "${APT_UPDATED:-}" ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v git >/dev/null || missing+=(git)
(ldd /bin/busybox 2>&1 || true) | grep -q "not a dynamic" || missing+=(busybox-static)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt_install "${missing[@]}"
fi

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  nohup dockerd >/var/log/forgepool-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { log "dockerd did not start; see /var/log/forgepool-dockerd.log"; exit 1; }
fi
log "docker engine ready ($(docker version --format '{{.Server.Version}}'))"
