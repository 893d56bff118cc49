#!/usr/bin/env bash
# The speculation suites looped under load: `scripts/stress-speculation.sh [REPEATS]` builds
# offload_tests in the tsan preset (STRESS_PRESET=release for a quicker, uninstrumented run)
# and runs every test whose name says Speculation REPEATS times (500 by default), with two
# busy processes beside it taking the cores the engine's threads want. It fails if any run
# fails or skips: a test that skips under load has not shown what it is for.
set -euo pipefail
cd "$(dirname "$0")/.."

repeats=${1:-500}
preset=${STRESS_PRESET:-tsan}
if ! [[ $repeats =~ ^[1-9][0-9]*$ ]]; then
  echo "stress-speculation.sh: REPEATS must be a positive integer, got '$repeats'" >&2
  exit 2
fi

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" -j "$(nproc)" --target offload_tests
binary=build/$preset/tests/offload/offload_tests
log=$(mktemp "${TMPDIR:-/tmp}/stress-speculation.XXXXXX")

busy=()
stop_busy() { for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_busy EXIT
for _ in 1 2; do
  (while :; do :; done) &
  busy+=($!)
done

echo "stress-speculation.sh: ${repeats} runs of *Speculation* (${preset}) beside 2 busy processes; log ${log}"
status=0
# Cuda/ instances need a GPU (ctest leaves them out by label; here the filter does).
TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1} "$binary" --gtest_filter='*Speculation*:-Cuda/*' \
  --gtest_repeat="$repeats" --gtest_break_on_failure >"$log" 2>&1 || status=$?
# One line per test run ends with its time; the summaries' lists repeat the names without it.
passed=$(grep -cE '^\[       OK \] .*\([0-9]+ ms\)$' "$log" || true)
failed=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$log" || true)
skipped=$(grep -cE '^\[  SKIPPED \] .*\([0-9]+ ms\)$' "$log" || true)
echo "stress-speculation.sh: ${passed} passed, ${failed} failed, ${skipped} skipped (exit ${status})"
if ((status != 0 || failed > 0 || skipped > 0)); then
  grep -E '^\[  (FAILED|SKIPPED) \]|WARNING: ThreadSanitizer' "$log" | sort | uniq -c | head -20 >&2
  exit 1
fi
