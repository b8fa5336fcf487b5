#!/usr/bin/env bash
# Configures and builds attnserve into ${BUILD_DIR:-build} (Ninja, RelWithDebInfo).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
# ccache (installed by scripts/install-deps.sh for the test command) keeps a
# repeated build short, CI's clean clones included; without it, plain builds.
launcher=()
if command -v ccache >/dev/null; then
  # Paths below the checkout hash relative to it: a clone elsewhere hits too.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
  "${launcher[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
