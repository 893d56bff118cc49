#!/usr/bin/env bash
# Quick start, part two: install dependencies if missing, build and run every test that this
# machine can run (GPU tests only where a GPU is present; the Python package's tests in the
# venv that scripts/python-env.sh makes once, outside the source tree), then the same tests under
# AddressSanitizer + UBSan, the engine's and NVMe layer's under ThreadSanitizer, and the parser
# fuzzers for a minute each. Exits non-zero if anything fails.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
venv=$(scripts/python-env.sh)
jobs=$(nproc)

label_args=()
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "test.sh: no GPU here; tests labelled 'gpu' are left out"
  label_args=(-LE gpu)
fi

run_preset() {
  local preset=$1
  shift
  echo "=== ${preset}: configure and build"
  local start=$SECONDS
  cmake --preset "$preset" -DSTRATA_WARNINGS_AS_ERRORS=ON "$@" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
  echo "=== ${preset}: built in $((SECONDS - start)) s; testing"
  ctest --preset "$preset" -j "$jobs" "${label_args[@]}"
}

# The release build also makes the Python extension (with the venv's interpreter and
# nanobind) and runs its pytest suites.
run_preset release -DSTRATA_WITH_PYTHON=ON "-DPython_EXECUTABLE=${venv}/bin/python"
run_preset asan

# ThreadSanitizer on what has threads of its own: the offload engine and the NVMe layer. Only
# their two test binaries are built, so the stage costs a few minutes.
echo "=== tsan: configure and build offload_tests and nvme_tests"
start=$SECONDS
cmake --preset tsan -DSTRATA_WARNINGS_AS_ERRORS=ON >/dev/null
cmake --build --preset tsan -j "$jobs" --target offload_tests nvme_tests
echo "=== tsan: built in $((SECONDS - start)) s; testing"
ctest --preset tsan -j "$jobs" -L "offload|nvme" "${label_args[@]}"

# The parsers that read outside input (configs, checkpoint manifests, metrics requests), fuzzed
# for a bounded time from their seed corpora.
echo "=== fuzz: a minute per parser"
scripts/fuzz.sh 60
echo "test.sh: all tests passed (release, asan, tsan for offload and nvme, fuzzers)"
