#!/usr/bin/env bash
# Installs (when missing) and starts the services forgepool's tests and examples use:
# the Docker engine and RabbitMQ. Safe to run again: running services are left alone.
# RABBITMQ_CONSUMER_TIMEOUT_MS sets the broker's consumer acknowledgement timeout (default:
# RabbitMQ's own, 30 minutes).
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
command -v rabbitmq-server >/dev/null || missing+=(rabbitmq-server)
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

if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  log "starting rabbitmq-server"
  mkdir -p /etc/rabbitmq
  if [ -n "${RABBITMQ_CONSUMER_TIMEOUT_MS:-}" ]; then
    echo "consumer_timeout = ${RABBITMQ_CONSUMER_TIMEOUT_MS}" > /etc/rabbitmq/rabbitmq.conf
  fi
  rabbitmq-server -detached >/dev/null 2>&1 || true
  for _ in $(seq 1 120); do
    rabbitmq-diagnostics -q ping >/dev/null 2>&1 && break
    sleep 0.5
  done
  rabbitmq-diagnostics -q ping >/dev/null 2>&1 || { log "rabbitmq-server did not start; see /var/log/rabbitmq/"; exit 1; }
  rabbitmqctl await_startup >/dev/null 2>&1 || true
fi
log "rabbitmq ready ($(rabbitmqctl version 2>/dev/null))"
