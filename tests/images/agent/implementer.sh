#!/bin/sh
# Test implementer. Usage: implementer.sh MODE
#   change      append to feature.txt; on feedback, add tests.txt; keep the prompt it received
#   fail        exit 3 after printing an error
#   own-cycles  run its own review loop: write two cycle files, the last just before exiting
#   same        write the same content every round (for the no-progress guard)
#   secret      print the value of $AGENT_SECRET (it must come back redacted)
#   pause       exit 75 (provider paused)
#   sleep N     sleep N seconds, then change
set -eu
mode="${1:-change}"
cd /workspace
cp /forge/input/prompt.md received_prompt.md
cp /forge/input/history.json received_history.json
case "$mode" in
  change)
    echo "round $FORGE_ROUND" >> feature.txt
    if grep -q '^## Reviewer Feedback' /forge/input/prompt.md; then
      echo "tests for the feature" > tests.txt
    fi
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
  *)
    echo "unknown mode $mode" >&2
    exit 64
    ;;
esac
