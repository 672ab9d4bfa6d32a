#!/bin/sh
# The example reviewer: checks review.md's rules against the diff and prints a verdict with
# specific feedback.
set -eu
diff=/forge/input/diff.patch
problems=""
if grep -q '^+++ b/inventory/' "$diff" && ! grep -q '^+++ b/tests/' "$diff"; then
  problems="${problems}- [Tests] inventory/reservations.py: reserve() changed but no test exercises a negative quantity. Add a test under tests/ that expects ValueError.
"
fi
if grep -q '^+.*raise Exception' "$diff"; then
  problems="${problems}- [Error handling] raise a specific exception, not Exception.
"
fi
if [ -z "$problems" ]; then
  echo "APPROVED"
  echo "Notes: the negative-quantity check is covered by a test."
else
  echo "REJECTED"
  echo
  printf '%s' "$problems"
fi
