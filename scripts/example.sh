#!/usr/bin/env bash
# Runs the example end to end on this machine: starts Docker, builds the example's agent
# images and forgepool, creates a small git repository, and runs `forgepool run` on it.
# The run shows a rejection, the fix, and an approval, then delivers the branch forge/shop-42.
#
# `scripts/example.sh --agent claude-code` runs the same ticket with the real Claude Code CLI
# (its image from scripts/build-agent-images.sh) as implementer and reviewer, through
# forgepool's model gateway to a local fake model server that plays the model's part
# (examples/fake_model.rs, the `anthropic` provider of a providers file): no key, no internet.
# The key forgepool holds never enters a stage: the stages get a token of their own.
set -euo pipefail
cd "$(dirname "$0")/.."
agent=""
case "${1:-}" in
  "") ;;
  --agent) agent="${2:-}"
    [ "$agent" = claude-code ] || { echo "usage: $0 [--agent claude-code]" >&2; exit 2; } ;;
  *) echo "usage: $0 [--agent claude-code]" >&2; exit 2 ;;
esac

scripts/services.sh
scripts/build-images.sh
if [ ! -x target/release/forgepool ]; then
  echo "== building forgepool (cargo build --release): the first build takes about 4 minutes on 2 cores" >&2
fi
cargo build --release --quiet
agents=examples/agents.toml

work="$(mktemp -d /tmp/forgepool-example.XXXXXX)"
if [ -n "$agent" ]; then
  scripts/build-agent-images.sh "$agent"
  # The gateway relay's image (the stage reaches only the gateway, through it).
  built="$(scripts/build-forgepool-image.sh 2>&1)" || { echo "$built" >&2; exit 1; }
  cargo build --release --quiet --example fake_model
  ./target/release/examples/fake_model "$work/model.port" "Output exactly one" \
    "[Tests] reserve() now rejects negative quantities but no test exercises it. Add a test under tests/ that expects ValueError." \
    inventory/reservations.py examples/agent/reservations.py \
    tests/test_reservations.py examples/agent/test_reservations.py &
  model=$!
  trap 'kill "$model" 2>/dev/null || true' EXIT
  for _ in $(seq 50); do [ -s "$work/model.port" ] && break; sleep 0.1; done
  [ -s "$work/model.port" ] || { echo "the fake model server did not start" >&2; exit 1; }
  # The gateway (in forgepool's process) forwards the `anthropic` provider to the fake.
  printf '[[provider]]\nname = "anthropic"\napi = "anthropic-messages"\nbase_url = "http://127.0.0.1:%s"\nkey_env = "ANTHROPIC_API_KEY"\n' \
    "$(cat "$work/model.port")" > "$work/providers.toml"
  export FORGEPOOL_PROVIDERS_FILE="$work/providers.toml"
  agents=examples/agent/agents.toml
  # What Claude does, tool by tool, under each stage.
  export FORGEPOOL_SHOW_LOGS=true
  # The fake model takes any key; the gateway needs one to forward. It stays in forgepool.
  export ANTHROPIC_API_KEY="${ANTHROPIC_API_KEY:-example-key-for-the-fake-model}"
  echo "== $agent against the fake model server on port $(cat "$work/model.port")"
fi
git init --quiet --bare --initial-branch=main "$work/shop.git"
git clone --quiet "$work/shop.git" "$work/seed" 2>/dev/null
cp -r examples/shop/. "$work/seed/"
git -C "$work/seed" add -A
git -C "$work/seed" -c user.name=example -c user.email=example@localhost commit --quiet -m "The shop"
git -C "$work/seed" push --quiet origin HEAD:main
sed "s|REPOSITORY_URL|file://$work/shop.git|" examples/request.toml > "$work/request.toml"

echo "== forgepool run $work/request.toml"
set +e
./target/release/forgepool run "$work/request.toml" \
  --skills examples/skills --agents "$agents" \
  --database "$work/forgepool.db" --workspace "$work/workspaces"
code=$?
set -e
echo "== exit code $code"
if git -C "$work/shop.git" rev-parse --verify --quiet forge/shop-42 >/dev/null; then
  echo "== delivered branch forge/shop-42:"
  git -C "$work/shop.git" log --stat --format='%h %s' -1 forge/shop-42
  git -C "$work/shop.git" diff main forge/shop-42 -- inventory
fi
echo "== the run's store is $work/forgepool.db; the repository is $work/shop.git"
exit "$code"
