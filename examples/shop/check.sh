#!/bin/sh
# The shop's verification command: a light static check that runs anywhere (busybox sh).
set -eu
fail=0
for f in inventory/*.py tests/*.py; do
  if grep -n "	" "$f"; then echo "$f: tabs are not allowed"; fail=1; fi
done
grep -q "def reserve" inventory/reservations.py || { echo "reserve() is missing"; fail=1; }
[ "$fail" = 0 ] && echo "check.sh: all checks passed"
exit "$fail"
