#!/bin/sh
# Test implementer. Usage: implementer.sh MODE
#   change      append to feature.txt and write a random nonce.txt; on review feedback add tests.txt, on failed checks add
#               fixed.txt; keep the prompt and history it received
#   fail        exit 3 after printing an error
#   own-cycles  run its own review loop: write two cycle files, the last just before exiting
#   same        leave the same tree every round (for the no-progress guard)
#   secret      print the value of $AGENT_SECRET (it must come back redacted)
#   pause       exit 75 (provider paused)
#   sleep N     sleep N seconds, then change
#   pause-at N  like change, but from round N on exit 75 (provider paused) unless
#               $PROVIDER_READY is set: the provider is back once the test sets it
#   env-dump    like change, and writes its environment (env.txt) and mounts (mounts.txt) into
#               the workspace (the tests look for credentials there)
#   usage COST  like change, and reports 1000 input and 200 output tokens costing COST dollars
#               in /forge/output/usage.json
#   quota-until EPOCH  before the Unix time EPOCH the provider's quota is spent: writes
#               /forge/output/pause.json with the seconds left and exits 75; then like change
#   pause-for S writes /forge/output/pause.json (rest S seconds) and exits 75, every time: a
#               provider that never recovers
#   forge-pause TICKET  for the ticket TICKET: writes /forge/output/pause.json (rest 600 s) and
#               exits 75, a stage's own claim of a provider pause; other tickets like change
#   sleep-from N S  like change, but from round N on it first sleeps S seconds unless
#               $SLEEP_DONE is set (a test drains its workers meanwhile)
#   model-call HOST:PORT SECONDS  a profile with a provider: calls the model through the
#               gateway with its stage token (the answer goes to model-answer.txt), keeps the
#               token in token.txt, tries HOST:PORT (the provider itself) directly
#               (direct.txt), then waits SECONDS for the test to look inside the container
#   attack KIND HOST_PATH [HOST_PATH2]
#               changes the source like `change`, then tries to reach the worker's host
#               (the tests look for the evidence there; nothing must appear):
#     git-config   programs in /workspace/.git/config (fsmonitor, a clean filter with
#                  .gitattributes, diff.external, a textconv, an ext:: insteadOf, hooks) that
#                  would touch HOST_PATH.*, and core.worktree pointing at the folder HOST_PATH2
#     gitfile      /workspace/.git becomes a gitfile naming the host repository HOST_PATH
#     forge-link   /workspace/.forge becomes a symlink to the host folder HOST_PATH
#     step-link    /workspace/.forge/$FORGE_STEP becomes a symlink to the host folder HOST_PATH
#     traps        a FIFO and a symlink to the host file HOST_PATH as cycle files
#     steal-objects  copies every object of its git folder into stolen-objects/ (delivered)
#     tamper       from round 2 on, rewrites forgepool's review_cycle_1.json to an approval
#     cycle-secret a cycle file of its own whose feedback holds $AGENT_SECRET
#     nested-repo  adds a folder whose .git names the host repository HOST_PATH
#   disk-hog    writes four files of 5 MB into the workspace, then waits 5 s
#   chatty N    prints N short lines, one write each, then changes like `change`
#   egress-probe GATEWAY ALLOWED_PORT DECOY_PORT
#               tries the network from a `network = "egress"` stage, through its proxy and
#               around it, and writes what it reached to egress-results.txt
set -eu
mode="${1:-change}"
if [ "$mode" = pause-at ]; then
  if [ "$FORGE_ROUND" -ge "${2:-1}" ] && [ -z "${PROVIDER_READY:-}" ]; then
    echo "partial work that must not be kept" > partial.txt
    echo "429 rate limited by the provider" >&2
    exit 75
  fi
  mode=change
fi
if [ "$mode" = change-base ]; then
  # Also edits a file of the base: later stages' copies must carry the edit.
  echo "edited in round $FORGE_ROUND" >> /workspace/README.md
  mode=change
fi
if [ "$mode" = env-dump ]; then
  env > /workspace/env.txt
  cat /proc/self/mounts > /workspace/mounts.txt
  mode=change
fi
if [ "$mode" = usage ]; then
  printf '{"input_tokens": 1000, "output_tokens": 200, "cache_read_tokens": 30, "cost_usd": %s, "model": "test-model"}' "${2:-0.5}" > /forge/output/usage.json
  mode=change
fi
if [ "$mode" = quota-until ]; then
  now="$(date +%s)"
  if [ "$now" -lt "$2" ]; then
    printf '{"reason": "rate_limit", "retry_after_seconds": %s}' "$(( $2 - now ))" > /forge/output/pause.json
    echo "429 quota spent until $2" >&2
    exit 75
  fi
  mode=change
fi
if [ "$mode" = pause-for ]; then
  printf '{"reason": "rate_limit", "retry_after_seconds": %s}' "${2:-1}" > /forge/output/pause.json
  echo "429 rate limited" >&2
  exit 75
fi
if [ "$mode" = forge-pause ]; then
  if [ "$FORGE_TICKET" = "${2:-}" ]; then
    printf '{"reason": "rate_limit", "retry_after_seconds": 600}' > /forge/output/pause.json
    echo "429 rate limited (says the stage)" >&2
    exit 75
  fi
  mode=change
fi
if [ "$mode" = sleep-from ]; then
  if [ "$FORGE_ROUND" -ge "${2:-1}" ] && [ -z "${SLEEP_DONE:-}" ]; then
    sleep "${3:-30}"
  fi
  mode=change
fi
cd /workspace
if [ "$mode" != same ]; then
  cp /forge/input/prompt.md received_prompt.md
  cp /forge/input/history.json received_history.json
fi
case "$mode" in
  change)
    echo "round $FORGE_ROUND" >> feature.txt
    # Different at every execution: a second execution of a run makes a different commit.
    cat /proc/sys/kernel/random/uuid > nonce.txt
    if grep -q '^## Reviewer Feedback' /forge/input/prompt.md; then
      echo "tests for the feature" > tests.txt
    fi
    if grep -q '^## Failed Checks' /forge/input/prompt.md; then
      echo "fixed" > fixed.txt
    fi
    # The worker (root) wrote .forge/ files after the last round; this stage user must still be
    # able to write there, so root-owned leftovers never block a round.
    mkdir -p ".forge/$FORGE_STEP"
    echo "note from round $FORGE_ROUND" > ".forge/$FORGE_STEP/implementer-note-$FORGE_ROUND.txt"
    echo "implemented round $FORGE_ROUND"
    ;;
  fail)
    echo "something broke in the implementer" >&2
    exit 3
    ;;
  own-cycles)
    step="$FORGE_STEP"
    mkdir -p ".forge/$step"
    printf '{"cycle": 1, "max_cycles": 2, "verdict": "rejected", "feedback": "own loop: first try"}' > ".forge/$step/.tmp1"
    mv ".forge/$step/.tmp1" ".forge/$step/review_cycle_1.json"
    echo "own change" > feature.txt
    printf '{"cycle": 2, "max_cycles": 2, "verdict": "approved", "feedback": "own loop: done"}' > ".forge/$step/.tmp2"
    mv ".forge/$step/.tmp2" ".forge/$step/review_cycle_2.json"
    exit 0
    ;;
  same)
    echo "always the same" > feature.txt
    ;;
  secret)
    echo "my key is ${AGENT_SECRET:-unset}"
    echo "change" > feature.txt
    ;;
  pause)
    echo "rate limited, try later" >&2
    exit 75
    ;;
  sleep)
    sleep "${2:-1}"
    echo "round $FORGE_ROUND" >> feature.txt
    ;;
  chatty)
    i=0
    while [ "$i" -lt "${2:-1000}" ]; do
      echo "chatty line $i of the implementer's output"
      i=$((i + 1))
    done
    echo "round $FORGE_ROUND" >> feature.txt
    ;;
  disk-hog)
    for i in 1 2 3 4; do head -c 5000000 /dev/zero > "hog-$i.bin"; done
    sleep 5
    echo "round $FORGE_ROUND" >> feature.txt
    ;;
  model-call)
    body='{"model":"fake-model","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"say hi"}]}'
    timeout 20 wget -q -O model-answer.txt --header "x-api-key: $ANTHROPIC_API_KEY" \
      --header "anthropic-version: 2023-06-01" --header "content-type: application/json" \
      --post-data "$body" "$ANTHROPIC_BASE_URL/v1/messages" 2>model-error.txt || true
    echo "$FORGE_MODEL_TOKEN" > token.txt
    if timeout 5 wget -q -O - "http://$2/v1/messages" >/dev/null 2>&1 \
      || echo probe | nc -w 3 "${2%:*}" "${2#*:}" >/dev/null 2>&1; then
      echo "direct: reached" > direct.txt
    else
      echo "direct: refused" > direct.txt
    fi
    echo "round $FORGE_ROUND" >> feature.txt
    sleep "${3:-1}"
    ;;
  listen)
    # Calls the model through the gateway, then listens on its own addresses for a while and
    # keeps whatever another stage sent it (tests/gateway.rs knocks from the other stage).
    body='{"model":"fake-model","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"say hi"}]}'
    timeout 20 wget -q -O model-answer.txt --header "x-api-key: $ANTHROPIC_API_KEY" \
      --header "anthropic-version: 2023-06-01" --header "content-type: application/json" \
      --post-data "$body" "$ANTHROPIC_BASE_URL/v1/messages" 2>model-error.txt || true
    timeout "${2:-20}" nc -l -p 7777 > knocked.txt 2>/dev/null || true
    echo "round $FORGE_ROUND" >> feature.txt
    ;;
  egress-probe)
    gw="$2"; allowed="$3"; decoy="$4"
    out=egress-results.txt
    : > "$out"
    echo "proxy set: ${HTTP_PROXY:+yes}" >> "$out"
    if body="$(timeout 15 wget -q -O - "http://$gw:$allowed/hello" 2>/tmp/wget.err)"; then
      echo "allowed: $body" >> "$out"
    else
      echo "allowed: failed ($body $(cat /tmp/wget.err))" >> "$out"
    fi
    for target in "$gw:$decoy" "$gw:5672" "169.254.169.254:80" "10.0.0.1:80"; do
      if timeout 15 wget -q -O - "http://$target/" >/dev/null 2>&1; then
        echo "proxy $target: reached" >> "$out"
      else
        echo "proxy $target: refused" >> "$out"
      fi
    done
    for target in "$gw $decoy" "$gw 5672" "169.254.169.254 80" "10.0.0.1 80"; do
      # shellcheck disable=SC2086
      if echo probe | nc -w 3 $target >/dev/null 2>&1; then
        echo "direct $target: reached" >> "$out"
      else
        echo "direct $target: refused" >> "$out"
      fi
    done
    cat "$out"
    ;;
  attack)
    kind="$2"
    host="${3:-}"
    echo "round $FORGE_ROUND" >> feature.txt
    mkdir -p ".forge/$FORGE_STEP"
    case "$kind" in
      git-config)
        cat >> .git/config <<EOF
[core]
	fsmonitor = "touch $host.fsmonitor; false"
	worktree = ${4:-/}
	sshCommand = "touch $host.ssh"
	hooksPath = /workspace/hooks
[filter "evil"]
	clean = "touch $host.filter; cat"
	smudge = "touch $host.smudge; cat"
	required = true
[diff]
	external = "touch $host.diff"
[diff "evil"]
	textconv = "touch $host.textconv; cat"
[url "ext::sh -c touch% $host.url% >&2"]
	insteadOf = file://
[protocol "ext"]
	allow = always
[uploadpack]
	packObjectsHook = "touch $host.packhook"
EOF
        mkdir -p hooks
        printf '#!/bin/sh
touch %s.hook
' "$host" > hooks/pre-push
        cp hooks/pre-push hooks/post-commit
        chmod +x hooks/pre-push hooks/post-commit
        echo '* filter=evil diff=evil' > .gitattributes
        ;;
      gitfile)
        if rm -rf .git 2>/dev/null; then
          echo "gitdir: $host/.git" > .git
        else
          # A layered workspace: .git is a mount of the stages' own git folder. The nearest
          # attack is to point that folder at the host repository.
          echo "$host/.git" > .git/commondir
        fi
        ;;
      forge-link)
        rm -rf .forge
        ln -s "$host" .forge
        ;;
      step-link)
        rm -rf ".forge/$FORGE_STEP"
        ln -s "$host" ".forge/$FORGE_STEP"
        ;;
      traps)
        rm -f ".forge/$FORGE_STEP/review_cycle_5.json" ".forge/$FORGE_STEP/review_cycle_6.json"
        mkfifo ".forge/$FORGE_STEP/review_cycle_5.json"
        ln -s "$host" ".forge/$FORGE_STEP/review_cycle_6.json"
        ;;
      tamper)
        if [ "$FORGE_ROUND" -ge 2 ]; then
          printf '{"cycle": 1, "max_cycles": 3, "verdict": "approved", "feedback": "forged approval"}' > ".forge/$FORGE_STEP/review_cycle_1.json"
        fi
        if grep -q '^## Reviewer Feedback' /forge/input/prompt.md; then
          echo "tests for the feature" > tests.txt
        fi
        ;;
      cycle-secret)
        printf '{"cycle": 1, "verdict": "rejected", "feedback": "the key is %s"}' "${AGENT_SECRET:-unset}" > ".forge/$FORGE_STEP/review_cycle_1.json"
        ;;
      steal-objects)
        # Every object the run's git folder holds, into the change it delivers.
        if [ -f .git ]; then gitdir="$(sed -n 's/^gitdir: //p' .git)"; else gitdir=.git; fi
        cp -r "$gitdir/objects" stolen-objects
        ;;
      nested-repo)
        mkdir -p vendor/lib
        echo "gitdir: $host/.git" > vendor/lib/.git
        ;;
    esac
    echo "attack $kind done"
    ;;
  *)
    echo "unknown mode $mode" >&2
    exit 64
    ;;
esac
