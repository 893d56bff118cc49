#!/usr/bin/env bash
# Collects what a bare CUDA image lacks to build Strata into one folder that travels with the
# working tree (the lent GPU machine has no network: no apt, no pip): the Debian packages of the
# build's libraries, fetched here with `apt-get download`, pytest's pure-Python wheels (for the
# torch CUDA tests), and unpack.sh, which unpacks them there into a prefix (dpkg-deb -x; the
# wheels unzipped into PREFIX/python) with their pkg-config files pointed into it. The CUDA
# toolkit, CMake, ninja and Python come with that image; NCCL comes as torch's pip wheel
# (nvidia-nccl-cu13), found through STRATA_NCCL_ROOT (docs/gpu.md).
#
#   scripts/gpu-bundle.sh [OUT]            # default: build/gpu-bundle (git ignores it; the
#                                          # device tool carries it: carry ["build/gpu-bundle"])
#   # there:  bash OUT/unpack.sh PREFIX; cmake ... -DCMAKE_PREFIX_PATH=PREFIX/usr (gpu-proof.sh)
#
# OUT must be empty, missing, or a bundle this script made (it holds .strata-gpu-bundle): the
# script replaces only its own files there. It fails when the bundle would not fit the 64 MiB
# that may travel with the tree.
set -euo pipefail

out=${1:-$(cd "$(dirname "$0")/.." && pwd)/build/gpu-bundle}
limit_bytes=$((64 << 20))
marker=.strata-gpu-bundle

# The build's libraries (install-deps.sh's, without the tools and the test-only extras), and
# the run-time libraries their development packages depend on.
packages=(
  liburing-dev liburing2
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5 libhwloc15
  libboost1.74-dev
  libeigen3-dev nlohmann-json3-dev
  libxxhash-dev libxxhash0
  libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian
)

if [[ -e $out ]]; then
  if [[ ! -d $out ]]; then
    echo "gpu-bundle: $out exists and is not a folder; give another OUT" >&2
    exit 1
  fi
  if [[ -n $(ls -A "$out") && ! -f $out/$marker ]]; then
    echo "gpu-bundle: $out holds files this script did not make; give an empty or new OUT" >&2
    exit 1
  fi
fi
mkdir -p "$out/debs"
touch "$out/$marker"
mkdir -p "$out/wheels"
# Only this script's own files go: the .debs and wheels it fetched before and its two text files.
rm -f "$out"/debs/*.deb "$out"/wheels/*.whl "$out/packages.txt" "$out/unpack.sh"

command -v apt-get >/dev/null || { echo "gpu-bundle: needs apt-get (Debian 12)" >&2; exit 1; }
if ! (cd "$out/debs" && apt-get download "${packages[@]}" >/dev/null 2>"$out/debs/apt.log"); then
  apt-get update -qq >/dev/null 2>&1 || true
  (cd "$out/debs" && apt-get download "${packages[@]}" >/dev/null 2>"$out/debs/apt.log") || {
    cat "$out/debs/apt.log" >&2
    echo "gpu-bundle: apt-get download failed (network? run apt-get update)" >&2
    exit 1
  }
fi
rm -f "$out/debs/apt.log"
for deb in "$out"/debs/*.deb; do
  dpkg-deb -W --showformat='${Package}=${Version}\n' "$deb"
done >"$out/packages.txt"

# pytest and what it imports, as pure-Python wheels (py3-none-any) for the GPU image's Python
# 3.12, with the pip of the project's venv (scripts/python-env.sh).
wheels=(pytest pluggy iniconfig packaging pygments)
venv=$(cd "$(dirname "$0")" && ./python-env.sh)
"$venv/bin/python" -m pip download --quiet --only-binary=:all: --no-deps \
  --python-version 3.12 --implementation py --abi none --platform any \
  --dest "$out/wheels" "${wheels[@]}" || {
  echo "gpu-bundle: pip download ${wheels[*]} failed (network?)" >&2
  exit 1
}
(cd "$out/wheels" && ls -1 -- *.whl) >>"$out/packages.txt"

cat >"$out/unpack.sh" <<'UNPACK'
#!/usr/bin/env bash
# Unpacks this bundle's Debian packages into PREFIX (made by scripts/gpu-bundle.sh): the
# libraries under PREFIX/usr, their pkg-config files rewritten to point there. CMake's package
# files find their own place. Then: cmake -DCMAKE_PREFIX_PATH=PREFIX/usr, with
# PKG_CONFIG_LIBDIR=PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig:PREFIX/usr/share/pkgconfig.
set -euo pipefail
prefix=${1:?usage: unpack.sh PREFIX}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$prefix"
prefix=$(cd "$prefix" && pwd)
for deb in "$here"/debs/*.deb; do
  dpkg-deb -x "$deb" "$prefix"
done
find "$prefix/usr" -name '*.pc' -print0 |
  xargs -0 sed -i -E "s#(^[a-z_]+=|-I|-L)/usr#\1$prefix/usr#g"
# Pure-Python wheels are zip files of the installed layout: unzipped, they import from
# PYTHONPATH=PREFIX/python with no pip needed.
mkdir -p "$prefix/python"
for wheel in "$here"/wheels/*.whl; do
  python3 -m zipfile -e "$wheel" "$prefix/python"
done
echo "unpack: $(wc -l <"$here/packages.txt") packages into $prefix"
UNPACK
chmod +x "$out/unpack.sh"

bytes=$(du -sb "$out" | cut -f1)
if ((bytes > limit_bytes)); then
  echo "gpu-bundle: $out is $((bytes >> 20)) MiB, over the $((limit_bytes >> 20)) MiB that travel" >&2
  exit 1
fi
echo "gpu-bundle: $(wc -l <"$out/packages.txt") packages, $((bytes / 1024)) KiB in $out"
