#!/usr/bin/env bash
# Prints, briefly, the state of the services the tests use: what explains a failed or stuck
# suite. scripts/test.sh runs it when a test fails, so it is the end of what CI shows.
# Every probe is bounded: a service that stopped answering is reported, never waited on.
set -uo pipefail

probe() { timeout "$1" "${@:2}" 2>&1; local code=$?; [ $code -eq 124 ] && echo "(no answer within $1 s)"; return 0; }

echo "=== diagnosis at $(date -u +%FT%TZ)"
echo "--- machine"
df -h / /var/lib/rabbitmq /var/lib/docker 2>/dev/null | awk '!seen[$0]++'
free -m | head -2
uptime
echo "--- docker"
start=$(date +%s%N)
probe 20 docker info --format 'containers {{.Containers}} running {{.ContainersRunning}}'
echo "docker info took $(( ($(date +%s%N) - start) / 1000000 )) ms"
echo "forgepool containers: $(timeout 20 docker ps -aq --filter label=forgepool.managed=true | wc -l)"
echo "--- rabbitmq"
probe 20 rabbitmq-diagnostics -q alarms
probe 20 rabbitmq-diagnostics -q check_running
# Once every file handle is in use, RabbitMQ stalls new connections and queues silently.
echo "file handles: $(probe 20 rabbitmqctl -q eval 'file_handle_cache:info([total_used, total_limit, sockets_used]).' | tr -d '\n ')"
start=$(date +%s%N)
queues="$(probe 60 rabbitmqctl -q list_queues --no-table-headers name type state consumers messages)"
echo "listing queues took $(( ($(date +%s%N) - start) / 1000000 )) ms"
echo "$queues" | awk '{ n[$2" "$3]++ } END { for (k in n) print n[k], "queues", k }'
echo "queues not running:"
echo "$queues" | awk '$3 != "running"' | head -20
log="$(find /var/log/rabbitmq -maxdepth 1 -name 'rabbit@*.log' ! -name '*upgrade*' -printf '%T@ %p\n' 2>/dev/null |
  sort -rn | head -1 | cut -d' ' -f2-)"
if [ -n "$log" ]; then
  echo "--- the broker's last errors and warnings ($log)"
  # The first line of each report (a report's lines share its timestamp).
  grep -E '\[(error|warning)\]' "$log" | grep -v 'client unexpectedly closed' |
    awk '$1" "$2 != last { print; last = $1" "$2 }' | cut -c1-220 | tail -20
fi
echo "=== end of diagnosis"
