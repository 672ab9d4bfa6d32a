#!/usr/bin/env bash
# Starts a local cluster: one dispatcher on 127.0.0.1:8080 and N workers (default 2), using
# RabbitMQ and Docker from scripts/services.sh. Logs, the store and the API token (made when
# FORGEPOOL_API_TOKEN is unset) go to ./cluster/.
#   scripts/cluster.sh [WORKERS] [SKILLS_DIR] [AGENTS_FILE]
# Stop it with: pkill -TERM -f 'forgepool (dispatcher|worker)'
set -euo pipefail
# Dispatcher and workers sign and check jobs with the same key.
export FORGEPOOL_JOB_KEY="${FORGEPOOL_JOB_KEY:-$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
# A cluster on one machine, to try with local repositories: file:// is allowed here, which a
# pool refuses by default.
export FORGEPOOL_ALLOWED_URL_SCHEMES="${FORGEPOOL_ALLOWED_URL_SCHEMES:-https,ssh,file}"
cd "$(dirname "$0")/.."
workers="${1:-2}"
skills="${2:-examples/skills}"
agents="${3:-examples/agents.toml}"

scripts/services.sh
cargo build --release --quiet
mkdir -p cluster
# The API wants a token: a page open in a browser could otherwise drive the dispatcher.
export FORGEPOOL_API_TOKEN="${FORGEPOOL_API_TOKEN:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}"
(umask 077 && printf '%s\n' "$FORGEPOOL_API_TOKEN" > cluster/api-token)
./target/release/forgepool dispatcher --skills "$skills" --agents "$agents" \
  --database cluster/forgepool.db > cluster/dispatcher.log 2>&1 &
echo "dispatcher: pid $!, http://127.0.0.1:8080, log cluster/dispatcher.log"
for i in $(seq 1 "$workers"); do
  ./target/release/forgepool worker --worker-id "local-$i" --metrics-addr "127.0.0.1:$((9090 + i))" \
    --workspace "cluster/workspaces-$i" --agents "$agents" > "cluster/worker-$i.log" 2>&1 &
  echo "worker local-$i: pid $!, metrics http://127.0.0.1:$((9090 + i))/metrics, log cluster/worker-$i.log"
done
echo "the API token is in cluster/api-token: export FORGEPOOL_API_TOKEN=\$(cat cluster/api-token)"
echo "submit with: ./target/release/forgepool submit REQUEST.toml --wait"
