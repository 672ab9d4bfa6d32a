#!/usr/bin/env bash
# Installs what the web view's browser tests use (tests/web_view.rs), on first use:
#   chromium               Debian's Chromium (Playwright's own browser download is not used);
#   playwright-core 1.57.0 Playwright's library without a browser download (npm), in
#                          .tools/browser; tests/browser/view.js drives Chromium with it;
#   axe-core 4.14.1        Deque's accessibility rules, run in the pages by the same test.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
dir="$PWD/.tools/browser"
version=1.57.0
axe=4.14.1
if ! command -v chromium >/dev/null; then
  apt_install chromium
fi
command -v npm >/dev/null || apt_install npm
if [ -f "$dir/node_modules/playwright-core/package.json" ] &&
  grep -q "\"version\": \"$version\"" "$dir/node_modules/playwright-core/package.json" &&
  grep -qs "\"version\": \"$axe\"" "$dir/node_modules/axe-core/package.json"; then
  exit 0
fi
mkdir -p "$dir"
npm install --silent --no-audit --no-fund --prefix "$dir" "playwright-core@$version" "axe-core@$axe" >/dev/null
echo "browser tools: $(chromium --version 2>/dev/null), playwright-core $version, axe-core $axe"
