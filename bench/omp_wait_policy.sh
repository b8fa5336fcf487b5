#!/usr/bin/env bash
# A/B of libgomp's wait policy for attnserve on a busy host: one `yes` process
# hogs a core while demo-mha calls (batch 2, 128 tokens) run against a server
# started with OMP_WAIT_POLICY=active and then =passive, alternately, ROUNDS
# times. Prints the server-side compute time of each call (microseconds).
#   bench/omp_wait_policy.sh [BUILD_DIR]
# Env: ROUNDS (default 3), CALLS per server (default 8), PORT (default 50557).
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${ROUNDS:-3}
CALLS=${CALLS:-8}
PORT=${PORT:-50557}
source "$(dirname "$0")/lib.sh"  # stops the hog and the server however this script exits
timeout 600 yes > /dev/null &
bench_track $!
for ((r = 0; r < ROUNDS; r++)); do
  for policy in active passive; do
    OMP_WAIT_POLICY=$policy "$BUILD/server/attnserve" --address "127.0.0.1:$PORT" \
      --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0 2>/dev/null &
    server=$!
    bench_track "$server"
    sleep 1.5
    times=()
    for ((i = 0; i < CALLS; i++)); do
      times+=("$("$BUILD/client/attn_client" --target "127.0.0.1:$PORT" --model demo-mha \
        --batch 2 --seq 128 | sed -n 's/.*compute \([0-9]*\) us.*/\1/p')")
    done
    bench_stop "$server"
    sorted=$(printf '%s\n' "${times[@]:1}" | sort -n | tr '\n' ' ')
    echo "round $r $policy: compute us (first call dropped, sorted): $sorted"
  done
done
