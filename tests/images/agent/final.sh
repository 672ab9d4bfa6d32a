#!/bin/sh
# Test final reviewer. Usage: final.sh MODE; writes /forge/output/review.json.
#   approve      approved, no findings
#   changes      changes_required with a real finding in feature.txt
#   fabricated   changes_required pointing at a file that does not exist
#   extra-file   approved, but also leaves notes.txt in the output folder
set -eu
out=/forge/output/review.json
case "${1:-approve}" in
  approve) echo '{"verdict": "approved", "summary": "The change does what the brief asks.", "findings": []}' > "$out" ;;
  changes) echo '{"verdict": "changes_required", "summary": "Round marker is wrong", "findings": [{"severity": "high", "path": "feature.txt", "line": 1, "summary": "says round 1", "evidence": "round 1"}]}' > "$out" ;;
  fabricated) echo '{"verdict": "changes_required", "summary": "x", "findings": [{"severity": "high", "path": "src/invented.py", "line": 3, "summary": "x", "evidence": "y"}]}' > "$out" ;;
  extra-file) echo '{"verdict": "approved", "summary": "ok", "findings": []}' > "$out"; echo hi > /forge/output/notes.txt ;;
  *) echo "unknown mode $1" >&2; exit 64 ;;
esac
