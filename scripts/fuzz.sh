#!/usr/bin/env bash
# Fuzzes every parser of untrusted input with AFL++ on stable Rust (cargo-afl):
#   verdict       the reviewer's stdout (SPEC 7.2)
#   review_json   the final reviewer's review.json against a source copy (SPEC 7.3)
#   job_message   a job message as a worker receives it (decode and check)
#   request       a run request, JSON and TOML (API, CLI)
#   frontmatter   a skill's review.md
#   agent_output  an agent CLI's stdout, stderr and trajectory (each kind's reader)
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default 600 s, every target)
# Findings (crashes and hangs) stay in fuzz/out/TARGET/default/{crashes,hangs}; the script
# ends with one line per target and exits 1 if any target crashed.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
seconds="${1:-600}"
shift || true
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  targets=(verdict review_json job_message request frontmatter agent_output)
fi

if ! command -v cargo-afl >/dev/null 2>&1; then
  echo "installing cargo-afl" >&2
  cargo install --locked cargo-afl
fi
# AFL++'s LLVM runtime for this rustc; a no-op once built.
cargo afl config --build >/dev/null 2>&1 || true
cargo afl build --release --quiet

export AFL_SKIP_CPUFREQ=1 AFL_NO_UI=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_AFFINITY=1
failed=0
summary=()
for target in "${targets[@]}"; do
  out="out/$target"
  rm -rf "$out"
  mkdir -p "$out"
  echo "fuzzing $target for $seconds s" >&2
  cargo afl fuzz -i "seeds/$target" -o "$out" -V "$seconds" -t 1000 "target/release/$target" \
    > "$out/fuzz.log" 2>&1 || true
  stats="$out/default/fuzzer_stats"
  execs="$(awk -F': ' '/^execs_done/ {print $2}' "$stats" 2>/dev/null || echo 0)"
  paths="$(awk -F': ' '/^corpus_count/ {print $2}' "$stats" 2>/dev/null || echo 0)"
  crashes="$(find "$out/default/crashes" -type f ! -name README.txt 2>/dev/null | wc -l)"
  hangs="$(find "$out/default/hangs" -type f 2>/dev/null | wc -l)"
  summary+=("$target: ${execs} executions, ${paths} inputs in the corpus, ${crashes} crashes, ${hangs} hangs")
  if [ "$crashes" -ne 0 ]; then failed=1; fi
done
printf '%s\n' "${summary[@]}"
exit "$failed"
