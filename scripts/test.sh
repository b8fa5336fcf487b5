#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to the whole test suite: installs
# what is missing, builds everything, runs every test (unit, integration
# against the real server, parity against PyTorch) under ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh -DATTNSERVE_BUILD_TESTS=ON -DATTNSERVE_BUILD_BENCH=ON
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure --timeout 900 "$@"
