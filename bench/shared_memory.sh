#!/usr/bin/env bash
# Tensors in system shared memory against tensors in the message, on both KServe v2 protocols,
# with Triton's own client (tritonclient.grpc / .http and tritonclient.utils.shared_memory):
# one server with --allow-client-shm, sdpa fp32, concurrency 1, the same request each way in
# alternating rounds (bench/shared_memory.py): req/s, client p50 and the server's own time per
# request (ModelStatistics). Needs BUILD_DIR/kserve-venv, which ctest -R test_kserve makes.
#
#   bench/shared_memory.sh [BUILD_DIR]     (default: build)
#   CASES=small,3mib,24mib REQUESTS=200 ROUNDS=3 bench/shared_memory.sh
set -euo pipefail
build=${1:-build}
source "$(dirname "$0")/lib.sh"  # stops the server however this script exits
py=$build/kserve-venv/bin/python
[[ -x $py ]] || { echo "shared_memory.sh: no $py (ctest -R test_kserve makes it)" >&2; exit 1; }

bench_start grpc "$bench_tmp/server.log" "$build/server/attnserve" --backend=cpu \
  --address=127.0.0.1:0 --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 \
  --allow-client-shm
http=$(grep -o -m1 "http on [0-9.]*:[0-9]*" "$bench_tmp/server.log" | awk '{print $3}')
"$py" "$(dirname "$0")/shared_memory.py" --grpc "$grpc" --http "$http" \
  --cases "${CASES:-small,3mib,24mib}" --requests "${REQUESTS:-200}" --rounds "${ROUNDS:-3}"
