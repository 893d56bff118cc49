#!/usr/bin/env bash
# Creates (once) the Python virtual environment that builds and tests Strata's Python package:
# torch 2.x from PyPI, nanobind, scikit-build-core, pytest, numpy, and the frameworks
# strata.torch is tested inside (transformers, accelerate, pytorch-lightning). It lives outside
# the source tree, in $STRATA_VENV (default ~/.cache/strata/venv): torch is about 5 GB and takes minutes to
# install, so it is installed once and reused by every later build and test run.
# Prints the venv's path on stdout (progress goes to stderr): venv=$(scripts/python-env.sh).
set -euo pipefail
exec 3>&1 1>&2  # Everything below to stderr; the path to the saved stdout (3).

venv=${STRATA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/strata/venv}
stamp=$venv/.strata-ready-2  # Bump the suffix when the package list below changes.
packages=(torch numpy pytest "nanobind>=2.4" "scikit-build-core>=0.10"
          "transformers>=5,<6" "accelerate>=1.16,<2" "pytorch-lightning>=2.6,<3")

if [[ -f $stamp ]]; then
  echo "$venv" >&3
  exit 0
fi

# A venv made for an earlier package list already has torch: add what is new, in place.
earlier=("$venv"/.strata-ready-*)
if [[ -x $venv/bin/pip && -f ${earlier[0]} ]]; then
  echo "python-env.sh: updating $venv for the current package list"
  "$venv/bin/pip" install --quiet "${packages[@]}"
  rm -f "${earlier[@]}"
  touch "$stamp"
  echo "$venv" >&3
  exit 0
fi

python=${STRATA_PYTHON:-python3}
sudo=()
[[ $(id -u) -ne 0 ]] && sudo=(sudo)
# Debian's own python3 needs its venv and header packages; a pyenv or distribution build has both.
if ! "$python" -c 'import ensurepip, sysconfig, os, sys; sys.exit(not os.path.exists(
    os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  echo "python-env.sh: installing python3-venv and python3-dev"
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-dev
fi

echo "python-env.sh: creating $venv (torch from PyPI: about 5 GB, a few minutes, once)"
start=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "${packages[@]}"
"$venv/bin/python" -c 'import torch, nanobind; print("python-env.sh: torch", torch.__version__,
  "nanobind", nanobind.__version__)'
touch "$stamp"
echo "python-env.sh: ready in $((SECONDS - start)) s"
echo "$venv" >&3
