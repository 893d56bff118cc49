#!/usr/bin/env bash
# One command for a borrowed GPU machine (no network; see docs/gpu.md): what it is, a CUDA
# build from the offline bundle, the GPU tests (the engine suites on CudaDevice among them) and
# strata.torch on CUDA tensors with any skip counted as a failure, copy bandwidth against
# torch's, the example on CUDA, and compute-sanitizer if time is left. Every
# stage has its own time limit and all of them fit in 9 minutes; each writes its log under $OUT
# and a line to $OUT/summary.md as it ends, so a run cut short still says how far it got.
#
#   OUT=/some/folder scripts/gpu-proof.sh [BUNDLE]     # BUNDLE: default build/gpu-bundle
#
# Environment: PYTHON (default python3: the one with torch), DEPS (where the bundle is unpacked;
# default /tmp/strata-gpu-deps), BUDGET_SECONDS (default 540).
# Exit: 0 when every stage passed, 1 when one failed, 2 when there is no GPU (after the stages
# that need none: facts, unpack, configure), 3 when every stage that ran passed but the budget
# ran out before the last (the summary names them): run again on the warm machine, whose build
# is kept.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
bundle=${1:-$repo/build/gpu-bundle}
out=${OUT:?set OUT to the folder for logs and the summary}
python=${PYTHON:-python3}
deps=${DEPS:-/tmp/strata-gpu-deps}
budget=${BUDGET_SECONDS:-540}
build=$repo/build/gpu
start=$SECONDS
failed=0
out_of_time=0
mkdir -p "$out"
summary=$out/summary.md
echo "# gpu-proof $(date -u +%FT%TZ)" >"$summary"
echo "| stage | result | seconds |" >>"$summary"
echo "| --- | --- | --- |" >>"$summary"

# stage NAME LIMIT COMMAND...: runs COMMAND with its output in $out/NAME.log, at most LIMIT
# seconds and never past the overall budget; records the result in the summary.
stage() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - (SECONDS - start)))
  ((limit > left)) && limit=$left
  if ((limit < 5)); then
    echo "| $name | not run: out of time | 0 |" >>"$summary"
    out_of_time=1
    return 1
  fi
  local t0=$SECONDS rc=0
  echo "gpu-proof: $name (at most ${limit}s)"
  # Through bash, so that COMMAND may be one of the functions below (exported).
  timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" >"$out/$name.log" 2>&1 || rc=$?
  local result="ok"
  if ((rc == 124 || rc == 137)); then
    result="FAILED: over ${limit}s"
  elif ((rc != 0)); then
    result="FAILED: exit $rc (see $name.log)"
  fi
  echo "| $name | $result | $((SECONDS - t0)) |" >>"$summary"
  ((rc == 0)) || failed=1
  return $rc
}

facts() {
  echo "== machine"; uname -a; nproc; free -g | head -2; df -h "$repo" /tmp | tail -n +1
  echo "== GPU"; nvidia-smi || echo "nvidia-smi: not available"
  echo "== compilers"; nvcc --version || echo "nvcc: not found"; c++ --version | head -1
  cmake --version | head -1; ninja --version || true
  echo "== python"; "$python" - <<'PY'
import platform, sys
print(sys.executable, platform.python_version())
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available(),
          "devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as e:
    print("torch:", e)
try:
    import nvidia.nccl
    print("nccl wheel", list(nvidia.nccl.__path__))
except Exception as e:
    print("nccl wheel:", e)
PY
}

nccl_root() {
  "$python" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true
}

configure() {
  local root
  root=$(nccl_root)
  PKG_CONFIG_LIBDIR=$deps/usr/lib/x86_64-linux-gnu/pkgconfig:$deps/usr/share/pkgconfig \
    cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$deps/usr" -DSTRATA_WITH_CUDA=ON -DSTRATA_WITH_MPI=OFF \
    -DPython_EXECUTABLE="$(command -v "$python")" ${root:+-DSTRATA_NCCL_ROOT="$root"}
}

# A folder where O_DIRECT works (tmpfs and overlay file systems refuse it), for the NVMe tier.
direct_io_folder() {
  local candidate
  for candidate in "$repo/build" /var/tmp /tmp /scratch /mnt/*; do
    [[ -d $candidate && -w $candidate ]] || continue
    if "$python" - "$candidate" <<'PY' 2>/dev/null; then
import mmap, os, sys, tempfile
folder = tempfile.mkdtemp(prefix="strata-odirect-", dir=sys.argv[1])
path = os.path.join(folder, "probe")
try:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
    try:
        os.write(fd, mmap.mmap(-1, 4096))
    finally:
        os.close(fd)
finally:
    if os.path.exists(path):
        os.remove(path)
    os.rmdir(folder)
PY
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

# torch's own pinned copies, for the ratio against `strata bench all`'s copies.
torch_copies() {
  "$python" - <<'PY'
import time, torch
for size in (1 << 20, 64 << 20):
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    for name, run in (("host_to_device", lambda: dev.copy_(host, non_blocking=True)),
                      ("device_to_host", lambda: host.copy_(dev, non_blocking=True))):
        run(); torch.cuda.synchronize()
        n, t0 = 20, time.perf_counter()
        for _ in range(n):
            run()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / n
        print(f"torch {name} {size >> 20} MiB: {size / seconds / 1e9:.2f} GB/s")
PY
}

# What the later stages run, not the CPU-only tests and benchmarks (minutes less to build): of
# these targets, those this configuration has (no Python extension without nanobind, no NCCL
# test without NCCL: the configure log says which).
build_for_proof() {
  local wanted=(strata _strata core_gpu_tests offload_tests offload_quantize_gpu_tests
                offload_gpu_tests)
  local known targets=() target
  local ninja
  ninja=$(sed -n 's/^CMAKE_MAKE_PROGRAM:[A-Z]*=//p' "$build/CMakeCache.txt")
  known=$("${ninja:-ninja}" -C "$build" -t targets all | cut -d: -f1)
  for target in "${wanted[@]}"; do
    if grep -qx "$target" <<<"$known"; then
      targets+=("$target")
    else
      echo "not in this configuration: $target"
    fi
  done
  cmake --build "$build" -j"$(nproc)" --target "${targets[@]}"
}

# The engine suites' Cuda/ instances and the device tests (python.test_cuda runs next, on its
# own), their scratch folders (gtest's TempDir) where O_DIRECT works for the NVMe placements.
gpu_tests() {
  local folder
  folder=$(direct_io_folder) || folder=""
  env STRATA_EXPECT_GPU=1 ${folder:+TEST_TMPDIR="$folder/"} \
    ctest --test-dir "$build" -L gpu -LE python -j 4 --output-on-failure
}

# tests/python/test_cuda.py: OffloadAdamW on CUDA tensors against torch AdamW, and the stream
# order. pytest comes from the bundle (unpacked into $deps/python).
torch_cuda_tests() {
  local folder
  folder=$(direct_io_folder) || folder=""
  env STRATA_EXPECT_GPU=1 STRATA_TEST_NVME_DIR="$folder" PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH="$build/python:$deps/python" "$python" -m pytest -q -rs -p no:cacheprovider \
    "$repo/tests/python/test_cuda.py"
}

train_gpt_nvme() {
  local folder
  folder=$(direct_io_folder) || { echo "no folder where O_DIRECT works"; return 1; }
  local nvme
  nvme=$(mktemp -d "$folder/strata-gpt-XXXXXX")
  echo "NVMe tier in $nvme"
  PYTHONPATH="$build/python" "$python" "$repo/examples/python/train_gpt.py" --steps 60 \
    --offload nvme --nvme-path "$nvme"
  local rc=$?
  rm -rf "$nvme"  # Made by this function (mktemp) and used by the example alone.
  return $rc
}

has_gpu() {
  nvidia-smi -L >/dev/null 2>&1 &&
    "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

export repo python deps build out
export -f facts nccl_root configure build_for_proof direct_io_folder gpu_tests torch_copies \
  torch_cuda_tests train_gpt_nvme
stage facts 30 facts
stage unpack 60 bash "$bundle/unpack.sh" "$deps"
stage configure 90 configure
if ! has_gpu; then
  echo "| gpu | no GPU: nvidia-smi or torch.cuda finds none; the GPU stages did not run | 0 |" \
    >>"$summary"
  echo "gpu-proof: no GPU (nvidia-smi -L, torch.cuda.is_available()); see $summary" >&2
  exit 2
fi
stage build 300 build_for_proof
stage gpu-tests 120 gpu_tests
stage torch-cuda-tests 120 torch_cuda_tests
stage copies-torch 30 torch_copies
stage bench 120 "$build/tools/strata" bench all --quick --out "$out/bench" \
  --nvme-path "$(direct_io_folder || echo /tmp)"
stage train-gpt-host 90 env PYTHONPATH="$build/python" "$python" \
  "$repo/examples/python/train_gpt.py" --steps 60 --offload cpu
stage train-gpt-nvme 90 train_gpt_nvme
stage memcheck 60 compute-sanitizer --tool memcheck "$build/tests/core_gpu_tests"
echo "gpu-proof: done in $((SECONDS - start))s; $summary" >&2
if ((failed)); then exit 1; fi
if ((out_of_time)); then exit 3; fi
exit 0
