#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for a set time each, from the committed
# corpus (fuzz/corpus/TARGET, which grows with what the run finds):
#
#   scripts/fuzz.sh                 # 600 s each (the bench's figure)
#   scripts/fuzz.sh 20              # 20 s each, after changing a parser
#   scripts/fuzz.sh 300 catalogue   # one target
#
# Needs a nightly toolchain; installs cargo-fuzz when missing. Targets are built without
# a sanitizer (`-s none`): the code under test is safe Rust (`unsafe_code = "deny"`), so
# what the fuzzer hunts is panics — overflow, slicing, unwrap — and debug assertions are
# on (`-a`: overflow checks too). A crash leaves its input in fuzz/artifacts/TARGET/ and fails the script; make it a
# regression test next to the code it broke, and keep the input in the corpus: the test
# suite replays every corpus through the same bodies (fuzz/bodies/, tests/fuzz_corpus.rs). Per-target figures (executions, coverage)
# go to fuzz/logs/TARGET.log and are summed up at the end.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
export PATH="$HOME/.cargo/bin:$PATH"
secs=${1:-600}
shift || true
if ! rustup toolchain list | grep -q '^nightly'; then
  echo "fuzz: no nightly toolchain (rustup toolchain install nightly)" >&2
  exit 1
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --version 0.13.1 --locked
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build -s none -O -a
mkdir -p logs
failed=()
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  echo "== fuzz $t for ${secs}s"
  # -rss_limit_mb: a parser that allocates by what its input claims is a finding.
  if ! cargo +nightly fuzz run -s none -O -a "$t" "corpus/$t" -- \
      -max_total_time="$secs" -rss_limit_mb=2048 -print_final_stats=1 >"logs/$t.log" 2>&1; then
    failed+=("$t")
    tail -40 "logs/$t.log"
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "logs/$t.log" | grep -o '[0-9]*$' || echo "?")
  cov=$(grep -o 'cov: [0-9]*' "logs/$t.log" | tail -1 | grep -o '[0-9]*' || echo "?")
  echo "   $t: $runs executions, coverage $cov edges, corpus $(ls "corpus/$t" | wc -l) inputs"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: crashes in ${failed[*]}: inputs in fuzz/artifacts/" >&2
  exit 1
fi
