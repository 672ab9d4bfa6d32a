#!/bin/sh
# Test final reviewer. Usage: final.sh MODE; writes /forge/output/review.json.
#   approve       approved, no findings
#   changes       changes_required with a real finding in feature.txt
#   fabricated    changes_required pointing at a file that does not exist
#   extra-file    approved, but also leaves notes.txt in the output folder
#   no-line       changes_required citing a line feature.txt does not have
#   no-evidence   changes_required quoting text that is not in feature.txt
#   approved-high approved while keeping a high finding
#   no-findings   changes_required without any finding
#   too-many      changes_required with 31 findings
#   oversized     approved with a summary that makes the report larger than 256 KiB
#   symlink       approved, plus a symlink in the output folder
#   credential    approved, with a cloud access key in the summary
#   slow-approve  sleeps 4 s, then approved (the test changes the source copy meanwhile)
#   hang          sleeps 60 s (the test kills the worker meanwhile)
set -eu
out=/forge/output/review.json
finding='{"severity": "low", "path": "feature.txt", "line": 1, "summary": "s", "evidence": "round 1"}'
case "${1:-approve}" in
  approve) echo '{"verdict": "approved", "summary": "The change does what the brief asks.", "findings": []}' > "$out" ;;
  changes) echo '{"verdict": "changes_required", "summary": "Round marker is wrong", "findings": [{"severity": "high", "path": "feature.txt", "line": 1, "summary": "says round 1", "evidence": "round 1"}]}' > "$out" ;;
  fabricated) echo '{"verdict": "changes_required", "summary": "x", "findings": [{"severity": "high", "path": "src/invented.py", "line": 3, "summary": "x", "evidence": "y"}]}' > "$out" ;;
  extra-file) echo '{"verdict": "approved", "summary": "ok", "findings": []}' > "$out"; echo hi > /forge/output/notes.txt ;;
  no-line) echo '{"verdict": "changes_required", "summary": "x", "findings": [{"severity": "medium", "path": "feature.txt", "line": 99, "summary": "x", "evidence": "round 1"}]}' > "$out" ;;
  no-evidence) echo '{"verdict": "changes_required", "summary": "x", "findings": [{"severity": "medium", "path": "feature.txt", "line": 1, "summary": "x", "evidence": "quantity < 0"}]}' > "$out" ;;
  approved-high) echo '{"verdict": "approved", "summary": "x", "findings": [{"severity": "high", "path": "feature.txt", "line": 1, "summary": "x", "evidence": "round 1"}]}' > "$out" ;;
  no-findings) echo '{"verdict": "changes_required", "summary": "needs work", "findings": []}' > "$out" ;;
  too-many)
    list="$finding"
    i=1
    while [ "$i" -lt 31 ]; do list="$list, $finding"; i=$((i + 1)); done
    echo "{\"verdict\": \"changes_required\", \"summary\": \"x\", \"findings\": [$list]}" > "$out" ;;
  oversized)
    big=$(head -c 270000 /dev/zero | tr '\0' 'a')
    echo "{\"verdict\": \"approved\", \"summary\": \"$big\", \"findings\": []}" > "$out" ;;
  symlink) echo '{"verdict": "approved", "summary": "ok", "findings": []}' > "$out"; ln -s /workspace/feature.txt /forge/output/feature-link ;;
  credential) echo '{"verdict": "approved", "summary": "deploy with AKIAIOSFODNN7EXAMPLE", "findings": []}' > "$out" ;;
  slow-approve) sleep 4; echo '{"verdict": "approved", "summary": "ok", "findings": []}' > "$out" ;;
  hang) sleep 60; echo '{"verdict": "approved", "summary": "late", "findings": []}' > "$out" ;;
  *) echo "unknown mode $1" >&2; exit 64 ;;
esac
