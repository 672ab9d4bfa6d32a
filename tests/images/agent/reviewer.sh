#!/bin/sh
# Test reviewer. Usage: reviewer.sh MODE
#   rules     APPROVED when the change adds tests.txt, else REJECTED with specific feedback
#   approve   always APPROVED
#   reject    always REJECTED, naming the cycle
#   nomarker  prints no verdict at all
#   sleep N   sleeps N seconds (to exceed the review timeout)
#   crash     exits 9
#   flood-line   prints 200 MB without a newline, then exits 0 (no verdict)
#   flood-lines  prints 60 MB of short lines (two million), then APPROVED
#   flood-forever  prints short lines until it is stopped
#   hostile URL  REJECTED on cycle 1 with feedback that would run script and load URL if a
#             page ever took it as markup (the web view must show it as text), APPROVED after
#   replay-token  a profile with a provider: calls the gateway with the implementer's token
#             (token.txt in the change), prints what the gateway answered, then APPROVED
#   leak      puts $AGENT_SECRET in its verdicts: REJECTED on cycle 1, APPROVED after (it must
#             come back redacted everywhere)
set -eu
mode="${1:-rules}"
case "$mode" in
  rules)
    if grep -q '^+++ b/tests.txt' /forge/input/diff.patch; then
      echo "APPROVED"
    else
      echo "REJECTED"
      echo "Missing tests for the feature: add tests.txt"
    fi
    ;;
  approve) echo "All criteria pass. APPROVED" ;;
  replay-token)
    body='{"model":"fake-model","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}'
    answer="$(timeout 20 wget -S -O - --header "x-api-key: $(cat /workspace/token.txt)" \
      --header "content-type: application/json" --post-data "$body" \
      "$ANTHROPIC_BASE_URL/v1/messages" 2>&1 || true)"
    echo "replayed token: $(echo "$answer" | grep -o 'HTTP/1.1 [0-9]*' | head -1)"
    echo "APPROVED"
    ;;
  reject) printf 'REJECTED\nCycle %s: error handling still missing\n' "$FORGE_CYCLE" ;;
  nomarker) echo "I looked at the change and have thoughts, but no verdict." ;;
  sleep) sleep "${2:-30}"; echo "APPROVED" ;;
  crash) echo "reviewer blew up" >&2; exit 9 ;;
  flood-line) head -c 200000000 /dev/zero | tr '\000' 'x' ;;
  flood-forever) yes 'a short line of review output, for ever' ;;
  flood-lines) yes 'a short line of review output' | head -c 60000000; echo "APPROVED" ;;
  leak)
    echo "debug: using key ${AGENT_SECRET:-unset}" >&2
    if [ "$FORGE_CYCLE" = 1 ]; then
      printf 'REJECTED\nthe key %s is hard-coded\n' "${AGENT_SECRET:-unset}"
    else
      printf 'key %s checked. APPROVED\n' "${AGENT_SECRET:-unset}"
    fi
    ;;
  hostile)
    if [ "$FORGE_CYCLE" = 1 ]; then
      printf 'REJECTED\n<script>window.__pwned = 1</script>\n![tracker](%s)\n<img src="%s" onerror="window.__pwned = 2">\n[a link](javascript:window.__pwned=3)\n**Fix the error handling.**\n' "$2" "$2"
    else
      echo "APPROVED"
    fi
    ;;
  *) echo "unknown mode $mode" >&2; exit 64 ;;
esac
