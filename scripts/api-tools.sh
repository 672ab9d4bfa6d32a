#!/usr/bin/env bash
# Installs the tool the API contract test uses into .tools/schemathesis (PyPI, on first use):
#   schemathesis 4.32.5   property-based tests of a live API against its OpenAPI document
#                         (tests/api_contract.rs runs `st run` with all its checks).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
dir="$PWD/.tools/schemathesis"
version=4.32.5
if [ -x "$dir/bin/st" ] && "$dir/bin/st" --version 2>/dev/null | grep -q "$version"; then
  exit 0
fi
python3 -m venv "$dir" 2>/dev/null || {
  apt_install python3-venv
  python3 -m venv "$dir"
}
"$dir/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$version"
echo "API tools: $("$dir/bin/st" --version)"
