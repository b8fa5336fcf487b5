#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to a serving attnserve: installs
# what is missing, builds, and runs the server with its built-in default
# model (demo-mha) on 127.0.0.1:50051. Extra arguments go to attnserve.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF
exec "${BUILD_DIR:-build}/server/attnserve" "$@"
