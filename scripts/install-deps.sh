#!/usr/bin/env bash
# Installs everything Strata's build and tests need on Debian 12. Idempotent: installs only
# what is missing, so a second run does not touch the network. Run as root (or with sudo).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libtbb-dev libeigen3-dev libboost-dev nlohmann-json3-dev
  liburing-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  fio python3 clang-format clang-tidy
  python3-torch python3-numpy   # cpu_adam's comparison against torch.optim (label torch)
  libsimde-dev                  # tests the AVX-512 kernels on CPUs without AVX-512
  python3-prometheus-client     # parses /metrics in the metrics endpoint's test
  python3-matplotlib            # scripts/plot_bench.py: charts of strata bench all
  clang libclang-rt-14-dev      # libFuzzer: the parser fuzzers (scripts/fuzz.sh)
  wrk                           # load on the metrics endpoint while training (its test)
  libopenmpi-dev openmpi-bin    # collectives of several ranks on host memory (MPI communicator)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
