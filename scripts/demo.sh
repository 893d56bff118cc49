#!/usr/bin/env bash
# Quick start, part one: install dependencies if missing, build the release preset, run the main
# job: `strata train` on its built-in defaults (the small byte-level language model, optimizer
# states on NVMe in a temporary folder under $TMPDIR, parameters offloaded to host memory, a
# device budget a fraction of the model). Extra arguments go to `strata train`.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)"
exec build/release/tools/strata train "$@"
