#!/bin/sh
# The example implementer: a scripted agent that makes the brief's change, and reacts to the
# reviewer's feedback by adding the missing test. Deterministic, so the example always shows
# REJECTED, then a fix, then APPROVED.
set -eu
cd /workspace
prompt=/forge/input/prompt.md
echo "implementer: round $FORGE_ROUND, reading $FORGE_PROMPT_FILE"
if ! grep -q "quantity < 0" inventory/reservations.py; then
  sed -i 's/^    if quantity > item.stock:/    if quantity < 0:\n        raise ValueError("quantity must not be negative")\n    if quantity > item.stock:/' inventory/reservations.py
  echo "implementer: reserve() now rejects negative quantities"
fi
if grep -q '^## Reviewer Feedback' "$prompt"; then
  echo "implementer: the reviewer said:"
  sed -n '/^## Reviewer Feedback/,$p' "$prompt" | sed 1d | sed 's/^/  > /'
  if grep -qi "test" "$prompt" && ! grep -q "test_reserve_rejects_negative" tests/test_reservations.py; then
    cat >> tests/test_reservations.py <<'PY'


def test_reserve_rejects_negative_quantities():
    item = Item("mug", 3)
    try:
        reserve(item, -1)
    except ValueError:
        assert item.stock == 3
    else:
        raise AssertionError("a negative quantity was accepted")
PY
    echo "implementer: added test_reserve_rejects_negative_quantities"
  fi
fi
