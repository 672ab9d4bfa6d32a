#!/usr/bin/env bash
# Fetches the tools the forge API tests use into .tools/forge (npm, on first use):
#   @stoplight/prism-cli 5.12.0   a mock server that validates requests against an OpenAPI
#                                 description (5.12 is the newest that runs on Debian 12's
#                                 Node.js 18/20), used here as a validating proxy;
#   @octokit/openapi 23.0.2       GitHub's own published OpenAPI description of its REST API.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
dir="$PWD/.tools/forge"
if [ -x "$dir/node_modules/.bin/prism" ] && [ -f "$dir/node_modules/@octokit/openapi/generated/api.github.com.json" ]; then
  exit 0
fi
command -v npm >/dev/null || apt_install npm
mkdir -p "$dir"
npm install --silent --no-audit --no-fund --prefix "$dir" \
  @stoplight/prism-cli@5.12.0 @octokit/openapi@23.0.2 >/dev/null
echo "forge tools: prism $("$dir/node_modules/.bin/prism" --version) and GitHub's OpenAPI description"
