#!/usr/bin/env bash
# Runs the example end to end on this machine: starts Docker, builds the example's agent
# images and forgepool, creates a small git repository, and runs `forgepool run` on it.
# The run shows a rejection, the fix, and an approval, then delivers the branch forge/shop-42.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/services.sh
scripts/build-images.sh
cargo build --release --quiet

work="$(mktemp -d /tmp/forgepool-example.XXXXXX)"
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
  --skills examples/skills --agents examples/agents.toml \
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
