#!/usr/bin/env bash
# Quick start, part one: install dependencies if missing, build the release preset, run the main
# job. Until `strata train` lands the main job is `strata info` on this machine and directory.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)"
exec build/release/tools/strata info --path "${STRATA_DEMO_PATH:-${TMPDIR:-/tmp}}" "$@"
