#!/usr/bin/env bash
# Installs (when missing) and starts the services forgepool's tests and examples use:
# the Docker engine, RabbitMQ and PostgreSQL (for the PostgreSQL run store); installs the
# forge tests' servers (nginx with fcgiwrap, openssh-server), which the tests start themselves,
# and promtool. Safe to run again: running services are left alone.
# RABBITMQ_CONSUMER_TIMEOUT_MS sets the broker's consumer acknowledgement timeout (default:
# RabbitMQ's own, 30 minutes).
# Needs root on Debian 12.
set -euo pipefail

log() { echo "services: $*" >&2; }
# shellcheck source=scripts/lib/apt.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/apt.sh"

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v rabbitmq-server >/dev/null || missing+=(rabbitmq-server)
command -v git >/dev/null || missing+=(git)
command -v curl >/dev/null || missing+=(curl)
command -v pg_ctlcluster >/dev/null || missing+=(postgresql)
(ldd /bin/busybox 2>&1 || true) | grep -q "not a dynamic" || missing+=(busybox-static)
# Real forges for the forge tests: git over HTTPS (nginx, fcgiwrap, a test CA from openssl) and
# over SSH (openssh-server); the tests start their own instances on loopback.
command -v nginx >/dev/null || missing+=(nginx-light)
command -v fcgiwrap >/dev/null || missing+=(fcgiwrap)
command -v openssl >/dev/null || missing+=(openssl)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  apt_install "${missing[@]}"
fi

# promtool (Prometheus's rule and exposition checker) comes with Debian's `prometheus`
# package; its server is not wanted here, so nothing the package installs is started.
if [ ! -x /usr/bin/promtool ]; then
  log "installing prometheus (for promtool; its server is not started)"
  made_policy=""
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    made_policy=1
  fi
  apt_install --no-install-recommends prometheus
  [ -z "$made_policy" ] || rm -f /usr/sbin/policy-rc.d
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

# RabbitMQ 3.10 reserves three file handles for every quorum queue and, once its handles run
# out, stalls new connections and queues without an error. Debian starts it through `su`, whose
# PAM limits give it 1024 open files: about 300 quorum queues. It gets the 65536 RabbitMQ's
# documentation asks for, or this machine's hard limit if that is lower.
nofile="$(ulimit -Hn)"
if [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ]; then nofile=65536; fi
rabbit_handles() { rabbitmqctl -q eval 'file_handle_cache:info([total_limit]).' 2>/dev/null | tr -dc '0-9'; }
enough=$(( nofile < 10000 ? nofile / 2 : 10000 ))
if rabbitmq-diagnostics -q ping >/dev/null 2>&1 && [ "$(rabbit_handles)" -lt "$enough" ] 2>/dev/null; then
  # Started elsewhere with a low open-files limit (see below): start it again with ours.
  log "restarting rabbitmq-server: it has $(rabbit_handles) file handles"
  rabbitmqctl -q stop >/dev/null 2>&1 || true
fi
if ! rabbitmq-diagnostics -q ping >/dev/null 2>&1; then
  log "starting rabbitmq-server"
  mkdir -p /etc/rabbitmq
  if [ -n "${RABBITMQ_CONSUMER_TIMEOUT_MS:-}" ]; then
    echo "consumer_timeout = ${RABBITMQ_CONSUMER_TIMEOUT_MS}" > /etc/rabbitmq/rabbitmq.conf
  fi
  { mkdir -p /etc/security/limits.d && echo "rabbitmq - nofile $nofile" > /etc/security/limits.d/rabbitmq.conf; } 2>/dev/null ||
    log "cannot write /etc/security/limits.d/rabbitmq.conf: RabbitMQ keeps the limit su gives it"
  # The limits file covers `su` with pam_limits; the ulimit covers a `su` without it.
  (ulimit -n "$nofile" 2>/dev/null || true; rabbitmq-server -detached >/dev/null 2>&1) || true
  for _ in $(seq 1 120); do
    rabbitmq-diagnostics -q ping >/dev/null 2>&1 && break
    sleep 0.5
  done
  rabbitmq-diagnostics -q ping >/dev/null 2>&1 || { log "rabbitmq-server did not start; see /var/log/rabbitmq/"; exit 1; }
  rabbitmqctl await_startup >/dev/null 2>&1 || true
fi
log "rabbitmq ready ($(rabbitmqctl version 2>/dev/null), $(rabbit_handles) file handles)"

# The newest PostgreSQL installed (its major version).
pg_version() { find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -printf '%f\n' | sort -n | tail -1; }
# PostgreSQL: a role and a database `forgepool` (password `forgepool`) on 127.0.0.1:5432. The
# role may create databases: the store tests make a fresh one per test.
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
  version="$(pg_version)"
  if ! pg_lsclusters -h | awk '{print $1"/"$2}' | grep -qx "$version/main"; then
    log "creating the PostgreSQL $version cluster"
    pg_createcluster "$version" main >/dev/null
  fi
  log "starting postgresql $version"
  pg_ctlcluster "$version" main start
  for _ in $(seq 1 60); do
    pg_isready -q -h 127.0.0.1 -p 5432 && break
    sleep 0.5
  done
  pg_isready -q -h 127.0.0.1 -p 5432 || { log "postgresql did not start; see /var/log/postgresql/"; exit 1; }
fi
as_postgres() { su postgres -s /bin/sh -c "$1"; }
if ! as_postgres "psql -tAc \"SELECT 1 FROM pg_roles WHERE rolname = 'forgepool'\"" | grep -q 1; then
  as_postgres "psql -qc \"CREATE ROLE forgepool LOGIN CREATEDB PASSWORD 'forgepool'\""
fi
if ! as_postgres "psql -tAc \"SELECT 1 FROM pg_database WHERE datname = 'forgepool'\"" | grep -q 1; then
  as_postgres "createdb -O forgepool forgepool"
fi
# TLS for the store's TLS test: a test CA and a certificate for `localhost` (and only that
# name) under /etc/postgresql/forgepool-tls, and a role `forgepool_tls` (password
# `forgepool`, database `forgepool_tls`) that pg_hba.conf lets in over TLS only.
tls_dir=/etc/postgresql/forgepool-tls
version="$(pg_version)"
if [ ! -f "$tls_dir/server.pem" ]; then
  log "making PostgreSQL's test certificates in $tls_dir"
  mkdir -p "$tls_dir"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=forgepool test CA" \
    -keyout "$tls_dir/ca.key" -out "$tls_dir/ca.pem" >/dev/null 2>&1
  openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
    -keyout "$tls_dir/server.key" -out "$tls_dir/server.csr" >/dev/null 2>&1
  printf 'subjectAltName=DNS:localhost\n' > "$tls_dir/san.ext"
  openssl x509 -req -in "$tls_dir/server.csr" -CA "$tls_dir/ca.pem" -CAkey "$tls_dir/ca.key" \
    -CAcreateserial -days 3650 -extfile "$tls_dir/san.ext" -out "$tls_dir/server.pem" >/dev/null 2>&1
  chown postgres:postgres "$tls_dir/server.key" "$tls_dir/server.pem"
  chmod 0600 "$tls_dir/server.key" "$tls_dir/ca.key"
  chmod 0644 "$tls_dir/ca.pem" "$tls_dir/server.pem"
fi
conf="/etc/postgresql/$version/main"
if [ ! -f "$conf/conf.d/forgepool-tls.conf" ]; then
  printf "ssl = on\nssl_cert_file = '%s/server.pem'\nssl_key_file = '%s/server.key'\n" "$tls_dir" "$tls_dir" \
    > "$conf/conf.d/forgepool-tls.conf"
fi
if ! grep -q forgepool_tls "$conf/pg_hba.conf"; then
  { printf 'hostssl all forgepool_tls 127.0.0.1/32 scram-sha-256\n'
    printf 'hostssl all forgepool_tls ::1/128 scram-sha-256\n'
    printf 'host    all forgepool_tls 127.0.0.1/32 reject\n'
    printf 'host    all forgepool_tls ::1/128 reject\n'
    cat "$conf/pg_hba.conf"; } > "$conf/pg_hba.conf.new"
  chown postgres:postgres "$conf/pg_hba.conf.new"
  mv "$conf/pg_hba.conf.new" "$conf/pg_hba.conf"
fi
pg_ctlcluster "$version" main reload >/dev/null 2>&1 || true
if ! as_postgres "psql -tAc \"SELECT 1 FROM pg_roles WHERE rolname = 'forgepool_tls'\"" | grep -q 1; then
  as_postgres "psql -qc \"CREATE ROLE forgepool_tls LOGIN PASSWORD 'forgepool'\""
fi
if ! as_postgres "psql -tAc \"SELECT 1 FROM pg_database WHERE datname = 'forgepool_tls'\"" | grep -q 1; then
  as_postgres "createdb -O forgepool_tls forgepool_tls"
fi
log "postgresql ready (postgres://forgepool:forgepool@127.0.0.1:5432/forgepool)"
