#!/usr/bin/env bash
# Worker "hosts" that share nothing with this machine but the network: each is a network
# namespace with its own address on a private bridge, a mount namespace with its own /tmp
# (so its own workspaces, cache and state), its own host name (fphI), and its own Docker engine
# (socket, data root, exec root and containerd, all under its own /tmp; no default bridge, no
# iptables). On a host, this machine's engine (its socket, data root and containerd) and every
# host's folders are hidden under empty file systems, so no host can reach another's engine.
# The rest of the file system is this machine's (binaries, the operator's files, and the
# tests' repositories, which stand in for a forge); the folders a host needs that live under
# the machine's /tmp (this repository, when cloned there; $CARGO_TARGET_DIR; the folders of
# $FORGEPOOL_HOSTS_SHARE) are bound read-only into the host's /tmp at the same path. Hosts reach the dispatcher and the broker
# only over TCP, at this machine's address on the bridge, with a broker user of their own
# whose password is made at `up` and removed at `down`. tests/hosts.rs, scripts/soak-hosts.py
# and scripts/bench-hosts.py use it; one set of hosts per machine.
#   scripts/hosts.sh up N          start hosts 1..N (those not running); prints nothing else
#   scripts/hosts.sh check         fail, naming it, when a folder the hosts need is one they hide
#   scripts/hosts.sh exec I CMD…   run CMD on host I (DOCKER_HOST names its engine)
#   scripts/hosts.sh load I IMAGE… copy images from this machine's engine to host I's
#   scripts/hosts.sh addr I        host I's address; `addr 0` is this machine's on the bridge
#   scripts/hosts.sh amqp-url [cluster]
#                                  the broker URL a host uses (user forgepool-hosts): the
#                                  single node, or scripts/rabbit-cluster.sh's three nodes
#   scripts/hosts.sh down          stop every host's engine, remove its containers, namespaces
#                                  and folders, and the bridge
# Needs root, iproute2 and util-linux (Debian's own), and Docker and RabbitMQ
# (scripts/services.sh installs them).
set -euo pipefail
bridge=fphosts0
net=10.231.0
run=/run/forgepool-hosts
data=/var/lib/forgepool-hosts
amqp_user=forgepool-hosts
log() { echo "hosts: $*" >&2; }
addr() { if [ "$1" = 0 ]; then echo "$net.1"; else echo "$net.$((10 + $1))"; fi; }
# Host I's engine, as the host sees it (its /tmp is its own).
state=/tmp/.forgepool-host
engine=$state/docker.sock
# Runs a command inside host I's namespaces.
inside() {
  local i="$1"; shift
  nsenter --net="/run/netns/fph$i" --mount="$run/h$i.mnt" --uts="$run/h$i.uts" -- \
    env DOCKER_HOST="unix://$engine" "$@"
}

# The folders every host sees at the same path although its /tmp is its own: this repository
# (its scripts and its cargo target folder), $CARGO_TARGET_DIR when set, and the folders of
# $FORGEPOOL_HOSTS_SHARE (separated by ':'), each resolved; those outside /tmp are the
# machine's own on every host anyway.
shared_folders() {
  local folder list=()
  list+=("$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)")
  [ -z "${CARGO_TARGET_DIR:-}" ] || list+=("$CARGO_TARGET_DIR")
  if [ -n "${FORGEPOOL_HOSTS_SHARE:-}" ]; then
    local extra=()
    IFS=: read -r -a extra <<<"$FORGEPOOL_HOSTS_SHARE"
    list+=("${extra[@]}")
  fi
  for folder in "${list[@]}"; do
    [ -n "$folder" ] || continue
    [ -d "$folder" ] || { log "$folder (shared with the hosts) is not a folder"; return 1; }
    (cd "$folder" && pwd -P)
  done
}

# Fails, naming the folder, when a shared folder lives where a host hides the machine's state
# (its engine's folders, the hosts' own folders): a host could not see it.
check_folders() {
  local folder hidden listed shared=()
  listed="$(shared_folders)" || return 1
  mapfile -t shared <<<"$listed"
  for folder in "${shared[@]}"; do
    for hidden in /run/docker /run/containerd /var/lib/docker /var/lib/containerd "$data" "$run" /tmp/.forgepool-host; do
      case "$folder/" in
        "$hidden"/*)
          log "$folder is under $hidden, which every worker host hides: clone the repository" \
            "(or set CARGO_TARGET_DIR) somewhere else, such as /root or /tmp/forgepool-clone"
          return 1 ;;
      esac
    done
  done
}

make_bridge() {
  ip link show "$bridge" >/dev/null 2>&1 && return 0
  ip link add "$bridge" type bridge
  ip addr add "$(addr 0)/24" dev "$bridge"
  ip link set "$bridge" up
}

# The folder the mount namespaces' files live in must be a private mount of its own.
make_run_folder() {
  mkdir -p "$run"
  if ! findmnt -n "$run" >/dev/null; then
    mount --bind "$run" "$run"
    mount --make-private "$run"
  fi
}

make_host() {
  local i="$1"
  local dir="$data/h$i"
  if [ ! -e "/run/netns/fph$i" ]; then
    ip netns add "fph$i"
    ip link add "fph$i-out" type veth peer name eth0 netns "fph$i"
    ip link set "fph$i-out" master "$bridge" up
    ip -n "fph$i" addr add "$(addr "$i")/24" dev eth0
    ip -n "fph$i" link set eth0 up
    ip -n "fph$i" link set lo up
  fi
  mkdir -p "$dir/tmp" "$run/h$i"
  chmod 1777 "$dir/tmp"
  if ! findmnt -n "$run/h$i.uts" >/dev/null 2>&1; then
    touch "$run/h$i.uts"
    unshare --uts="$run/h$i.uts" hostname "fph$i"
  fi
  if ! findmnt -n "$run/h$i.mnt" >/dev/null 2>&1; then
    touch "$run/h$i.mnt"
    # Its own /tmp, with the shared folders that live under the machine's /tmp bound into it
    # (read-only) first; this machine's engine and the hosts' folders hidden.
    local listed shared=()
    listed="$(shared_folders)"
    mapfile -t shared <<<"$listed"
    # shellcheck disable=SC2016 # expanded by the inner shell, from its arguments
    unshare --mount="$run/h$i.mnt" --propagation private bash -c '
      set -euo pipefail
      dir="$1" state="$2" data="$3" run="$4"; shift 4
      for folder in "$@"; do
        case "$folder" in /tmp/*) ;; *) continue ;; esac
        mkdir -p "$dir/tmp/${folder#/tmp/}"
        mount --bind "$folder" "$dir/tmp/${folder#/tmp/}"
        mount -o remount,bind,ro "$dir/tmp/${folder#/tmp/}"
      done
      mount --rbind "$dir/tmp" /tmp
      mkdir -p "$state"
      for socket in /run/docker.sock /var/run/docker.sock; do
        if [ -S "$socket" ]; then mount --bind /dev/null "$socket"; fi
      done
      for folder in /run/docker /run/containerd /var/lib/docker /var/lib/containerd "$data" "$run"; do
        if [ -d "$folder" ]; then mount -t tmpfs -o size=1m,mode=0700 none "$folder"; fi
      done' bash "$dir" "$state" "$data" "$run" "${shared[@]}"
  fi
  if ! inside "$i" docker version >/dev/null 2>&1; then
    # cgroupfs: a systemd machine's driver wants a `.slice` parent.
    inside "$i" setsid dockerd --host "unix://$engine" --data-root "$state/docker" \
      --exec-root "$state/exec" --pidfile "$state/docker.pid" --bridge none \
      --iptables=false --ip6tables=false --ip-masq=false --cgroup-parent "forgepool-h$i" \
      --exec-opt native.cgroupdriver=cgroupfs \
      >"$run/h$i/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 60); do inside "$i" docker version >/dev/null 2>&1 && break; sleep 0.5; done
    inside "$i" docker version >/dev/null 2>&1 ||
      { tail -20 "$run/h$i/dockerd.log" >&2; log "host $i's Docker engine did not start"; exit 1; }
  fi
}

# The nodes the hosts' broker user lives on: the single node and, when it runs,
# scripts/rabbit-cluster.sh's cluster.
broker_nodes() {
  local node
  for node in "rabbit@$(hostname -s)" "fp1@$(hostname -s)"; do
    rabbitmq-diagnostics -q -n "$node" ping >/dev/null 2>&1 && echo "$node"
  done
  true
}
# Hosts reach the broker from their bridge address, where RabbitMQ refuses `guest`: a user
# of their own, with a password made now and kept only here (mode 0600).
broker_user() {
  local node
  [ -s "$run/amqp-password" ] || (umask 077; head -c 18 /dev/urandom | base64 | tr '+/' 'xy' >"$run/amqp-password")
  for node in $(broker_nodes); do
    if ! rabbitmqctl -q -n "$node" list_users 2>/dev/null | grep -q "^$amqp_user\b"; then
      rabbitmqctl -q -n "$node" add_user "$amqp_user" "$(cat "$run/amqp-password")" >/dev/null
    else
      rabbitmqctl -q -n "$node" change_password "$amqp_user" "$(cat "$run/amqp-password")" >/dev/null
    fi
    rabbitmqctl -q -n "$node" set_permissions -p / "$amqp_user" '.*' '.*' '.*' >/dev/null
  done
}

down() {
  for ns in /run/netns/fph*; do
    [ -e "$ns" ] || continue
    local i="${ns##*/fph}"
    if inside "$i" docker version >/dev/null 2>&1; then
      local left
      left="$(inside "$i" docker ps -aq)"
      # shellcheck disable=SC2086 # one container id per word
      [ -z "$left" ] || inside "$i" docker rm -f $left >/dev/null 2>&1 || true
    fi
    if [ -f "$data/h$i/tmp/.forgepool-host/docker.pid" ]; then
      local pid
      pid="$(cat "$data/h$i/tmp/.forgepool-host/docker.pid")"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    umount "$run/h$i.mnt" "$run/h$i.uts" 2>/dev/null || true
    ip netns delete "fph$i" 2>/dev/null || true
  done
  ip link delete "$bridge" 2>/dev/null || true
  local node
  for node in $(broker_nodes); do
    rabbitmqctl -q -n "$node" delete_user "$amqp_user" >/dev/null 2>&1 || true
  done
  rm -f "$run/amqp-password"
  # The engines' overlay mounts were in the hosts' mount namespaces, gone with them.
  rm -rf "$data" "$run"/h* 2>/dev/null || true
  if umount "$run" 2>/dev/null; then rmdir "$run" 2>/dev/null || true; fi
}

case "${1:-}" in
  up)
    count="${2:?usage: $0 up N}"
    check_folders
    make_bridge
    make_run_folder
    broker_user
    for i in $(seq 1 "$count"); do make_host "$i"; done
    ;;
  exec)
    i="${2:?usage: $0 exec I CMD...}"; shift 2
    exec nsenter --net="/run/netns/fph$i" --mount="$run/h$i.mnt" --uts="$run/h$i.uts" -- \
      env DOCKER_HOST="unix://$engine" "$@"
    ;;
  load)
    i="${2:?usage: $0 load I IMAGE...}"; shift 2
    docker save "$@" | inside "$i" docker load -q >/dev/null
    ;;
  addr) addr "${2:?usage: $0 addr I}" ;;
  amqp-url)
    password="$(cat "$run/amqp-password" 2>/dev/null)" || { log "no hosts are up: $0 up N"; exit 1; }
    if [ "${2:-}" = cluster ]; then
      echo "amqp://$amqp_user:$password@$(addr 0):5681/%2f,$(addr 0):5682,$(addr 0):5683"
    else
      echo "amqp://$amqp_user:$password@$(addr 0):5672/%2f"
    fi
    ;;
  down) down ;;
  check) check_folders ;;
  *) log "usage: $0 up N | check | exec I CMD... | load I IMAGE... | addr I | amqp-url [cluster] | down"; exit 2 ;;
esac
