#!/usr/bin/env bash
# Sequential O_DIRECT throughput of `strata bench nvme` against fio's io_uring engine, with the
# same block size, queue depth, size and file, alternating runs (and which tool goes first);
# prints each median and the ratio strata / fio (PERFORMANCE.md: target >= 1.0).
#
# Usage: bench/compare_fio.sh DIR [SIZE] [RUNS]     (SIZE default 4GiB, RUNS default 3)
# STRATA=path/to/strata overrides the binary (default build/release/tools/strata).
set -euo pipefail
dir=${1:?usage: bench/compare_fio.sh DIR [SIZE] [RUNS]}
size=${2:-4GiB}
runs=${3:-3}
strata=${STRATA:-$(dirname "$0")/../build/release/tools/strata}
command -v fio >/dev/null || { echo "compare_fio: fio is not installed (scripts/install-deps.sh)" >&2; exit 1; }
[[ -x $strata ]] || { echo "compare_fio: $strata not built (cmake --build --preset release)" >&2; exit 1; }

file=$dir/strata-fio-compare.bin
trap 'rm -f "$file"' EXIT
bytes() { python3 -c 'import sys
s=sys.argv[1]; u={"KiB":1<<10,"MiB":1<<20,"GiB":1<<30}
print(next((int(float(s[:-3])*v) for k,v in u.items() if s.endswith(k)), s))' "$1"; }
median() { python3 -c 'import statistics,sys; print(statistics.median(map(float,sys.argv[1:])))' "$@"; }

run_ours() {
  ours+=("$("$strata" bench nvme --file "$file" --rw "$rw" --block-size "$block" \
    --queue-depth "$qd" --size "$size" --json 2>/dev/null |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["bytes_per_second"])')")
}
run_fio() {
  theirs+=("$(fio --name=compare --filename="$file" --ioengine=io_uring --direct=1 \
    --rw="$rw" --bs="$block_bytes" --iodepth="$qd" --size="$size_bytes" \
    --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]
print(j[sys.argv[1]]["bw_bytes"])' "$rw")")
}

size_bytes=$(bytes "$size")
# Lay the file out once, unmeasured, before either tool is timed: both then overwrite and read
# the same written blocks, and no measured run follows the layout's write-back.
"$strata" bench nvme --file "$file" --rw write --size "$size" --json >/dev/null 2>&1 ||
  { echo "compare_fio: $strata could not lay out $file" >&2; exit 1; }
printf "%-6s %8s %4s %14s %14s %7s\n" rw block qd strata_GB/s fio_GB/s ratio
for setting in "1MiB 32" "8MiB 8"; do
  read -r block qd <<<"$setting"
  block_bytes=$(bytes "$block")
  for rw in write read; do
    ours=() theirs=()
    for ((i = 0; i < runs; i++)); do
      # Each tool goes first every other run: whoever follows the other's writes meets the
      # same device write-back, and neither is always the one that does.
      if ((i % 2 == 0)); then run_ours; run_fio; else run_fio; run_ours; fi
    done
    a=$(median "${ours[@]}")
    b=$(median "${theirs[@]}")
    python3 -c 'import sys
rw,bl,qd,a,b=sys.argv[1:]; a=float(a); b=float(b)
print(f"{rw:<6} {bl:>8} {qd:>4} {a/1e9:14.3f} {b/1e9:14.3f} {a/b:7.3f}")' "$rw" "$block" "$qd" "$a" "$b"
  done
done
