#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, with clang) and runs each for a bounded time from
# its committed seed corpus: scripts/fuzz.sh [SECONDS_EACH] (default 60). New inputs go to a
# scratch copy of the corpus; a crash leaves its input in build/fuzz/crashes/ and fails the run.
# Turn a crash into a regression test, then add its input to tests/fuzz/corpus/.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}

cmake -S tests/fuzz -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/fuzz -j "$(nproc)"

mkdir -p build/fuzz/crashes
status=0
for target in config manifest metrics_http; do
  scratch=$(mktemp -d)
  cp tests/fuzz/corpus/"$target"/* "$scratch"/
  echo "=== fuzz: ${target}_fuzzer for ${seconds} s"
  # The config reader is bounded (core/input_file.h): 256MiB is far below the 1GiB sparse file
  # its fuzzer has it refuse, and far above what any config needs.
  limits=(-rss_limit_mb=2048)
  [[ $target == config ]] && limits+=(-malloc_limit_mb=256)
  if ! build/fuzz/"${target}"_fuzzer -max_total_time="$seconds" -timeout=10 "${limits[@]}" \
      -print_final_stats=1 -artifact_prefix=build/fuzz/crashes/"${target}"- "$scratch" \
      >build/fuzz/"$target".log 2>&1; then
    echo "fuzz: ${target}_fuzzer failed; its input is in build/fuzz/crashes/:" >&2
    tail -40 build/fuzz/"$target".log >&2
    status=1
  else
    grep -E "^stat::number_of_executed_units|^Done" build/fuzz/"$target".log | tail -1
  fi
  rm -rf "$scratch"
done
exit $status
