#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this machine, beside the single node scripts/services.sh
# starts: nodes fp1, fp2 and fp3 (AMQP on 127.0.0.1:5681-5683, Erlang distribution on
# 25681-25683, data under /var/lib/rabbitmq/fp-cluster), one cluster. The broker-failover
# tests (tests/brokers.rs) use it; RabbitMQ must be installed (scripts/services.sh does).
#   scripts/rabbit-cluster.sh up        start the nodes that are not running and join them
#   scripts/rabbit-cluster.sh stop N    stop node N's broker (its clients are dropped; the
#                                       node stays a member, so its queues' replicas wait)
#   scripts/rabbit-cluster.sh start N   start node N's broker again
#   scripts/rabbit-cluster.sh down      stop all three nodes
#   scripts/rabbit-cluster.sh url       print a FORGEPOOL_AMQP_URL naming the three nodes
set -euo pipefail
host="$(hostname -s)"
base=/var/lib/rabbitmq/fp-cluster
log() { echo "rabbit-cluster: $*" >&2; }
node() { echo "fp$1@$host"; }
ctl() { local n="$1"; shift; rabbitmqctl -q -n "$(node "$n")" "$@"; }
running() { rabbitmq-diagnostics -q -n "$(node "$1")" ping >/dev/null 2>&1; }

# Starts node N's Erlang VM and broker, detached; `await_node` waits for it.
start_node() {
  local n="$1" dir="$base/n$1"
  running "$n" && return 0
  mkdir -p "$dir" && chown -R rabbitmq:rabbitmq "$base"
  RABBITMQ_NODENAME="$(node "$n")" RABBITMQ_NODE_PORT=$((5680 + n)) \
    RABBITMQ_DIST_PORT=$((25680 + n)) RABBITMQ_MNESIA_BASE="$dir/mnesia" \
    RABBITMQ_LOG_BASE="$dir/log" RABBITMQ_PID_FILE="$dir/pid" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" \
    rabbitmq-server -detached >/dev/null 2>&1 || true
}
await_node() {
  local n="$1"
  for _ in $(seq 1 90); do running "$n" && break; sleep 1; done
  running "$n" && timeout 90 rabbitmqctl -q -n "$(node "$n")" await_startup >/dev/null 2>&1
}
# A node that was a cluster member waits at boot for the peers that stopped after it, so the
# nodes start together. Nodes killed together (a machine that stopped, a session that ended)
# may each wait for the others for ever; the cluster holds only test data, so then it is
# made again from nothing.
start_all() {
  local started=()
  for n in 1 2 3; do running "$n" || { start_node "$n"; started+=("$n"); }; done
  for n in "${started[@]}"; do await_node "$n" || return 1; done
}
kill_all() {
  for n in 1 2 3; do
    ctl "$n" stop >/dev/null 2>&1 || true
    if [ -f "$base/n$n/pid" ]; then kill -9 "$(cat "$base/n$n/pid")" 2>/dev/null || true; fi
  done
}

case "${1:-up}" in
  up)
    command -v rabbitmq-server >/dev/null || { log "RabbitMQ is not installed: run scripts/services.sh first"; exit 1; }
    alive=0
    for n in 1 2 3; do running "$n" && alive=1; done
    if ! start_all; then
      # A node that came back to running peers never loses their queues this way.
      [ "$alive" = 0 ] || { log "a node did not start beside the running ones; see $base/n*/log"; exit 1; }
      log "the nodes did not start together; making the cluster again from nothing"
      kill_all
      rm -rf "$base"
      start_all || { log "the nodes did not start; see $base/n*/log"; exit 1; }
    fi
    # A node whose broker a test stopped (`stop N`) is running but not serving.
    for n in 1 2 3; do ctl "$n" start_app >/dev/null 2>&1 || true; done
    for n in 2 3; do
      # Asked of node n itself: node 1 may still list a member whose data was wiped.
      if [ "$(ctl "$n" eval "lists:member('$(node 1)', rabbit_nodes:all_running())." 2>/dev/null)" != true ]; then
        log "joining $(node "$n") to $(node 1)"
        { ctl "$n" stop_app && ctl "$n" reset && ctl "$n" join_cluster "$(node 1)" &&
            ctl "$n" start_app; } >"$base/join.log" 2>&1 ||
          { cat "$base/join.log" >&2; log "$(node "$n") cannot join $(node 1)"; exit 1; }
      fi
    done
    log "three nodes ready: $("$0" url)"
    ;;
  stop) ctl "$2" stop_app ;;
  start) ctl "$2" start_app && timeout 120 rabbitmqctl -q -n "$(node "$2")" await_startup ;;
  down) for n in 1 2 3; do ctl "$n" stop >/dev/null 2>&1 || true; done ;;
  url) echo "amqp://guest:guest@127.0.0.1:5681/%2f,127.0.0.1:5682,127.0.0.1:5683" ;;
  *) log "usage: $0 up|stop N|start N|down|url"; exit 2 ;;
esac
