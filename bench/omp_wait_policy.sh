#!/usr/bin/env bash
# A/B of libgomp's waiting for attnserve's engine workers: attnserve's default
# (short spins: OMP_WAIT_POLICY=active GOMP_SPINCOUNT=1000, set by attnserve
# itself), OMP_WAIT_POLICY=passive (sleep at once) and OMP_WAIT_POLICY=active
# (spin without bound), alternately, ROUNDS times each, on two hosts:
#   busy  one `yes` process hogs a core; demo-mha calls of batch 2, 128 tokens
#         one at a time (attn_client); prints each call's server-side compute
#         time (microseconds), sorted, the first call dropped;
#   idle  nothing else runs; attn_bench closed loops of demo-mha batch 1,
#         16 tokens at 1 and 4 clients; prints req/s, p50 and the mean
#         server-side compute time per batch.
#   bench/omp_wait_policy.sh [BUILD_DIR]
# Env: ROUNDS (default 3), CALLS per server (default 8), SECONDS_EACH (idle
# loops, default 3), HOSTS (default "busy idle").
set -euo pipefail
BUILD=${1:-build}
ROUNDS=${ROUNDS:-3}
CALLS=${CALLS:-8}
SECONDS_EACH=${SECONDS_EACH:-3}
HOSTS=${HOSTS:-busy idle}
source "$(dirname "$0")/lib.sh"  # stops the hog and the servers however this script exits

settings=("default" "OMP_WAIT_POLICY=passive" "OMP_WAIT_POLICY=active")
start_server() {  # SETTING: the server's address in $target
  local setting=$1 env=()
  [[ $setting == default ]] || env=("$setting")
  bench_start target "$bench_tmp/server.log" env "${env[@]}" "$BUILD/server/attnserve" \
    --address=127.0.0.1:0 --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0
}

for host in $HOSTS; do
  hog=
  if [[ $host == busy ]]; then
    timeout 900 yes >/dev/null &
    hog=$!
    bench_track "$hog"
  fi
  for ((r = 0; r < ROUNDS; r++)); do
    for setting in "${settings[@]}"; do
      start_server "$setting"
      if [[ $host == busy ]]; then
        times=()
        for ((i = 0; i < CALLS; i++)); do
          times+=("$("$BUILD/client/attn_client" --target "$target" --model demo-mha \
            --batch 2 --seq 128 | sed -n 's/.*compute \([0-9]*\) us.*/\1/p')")
        done
        sorted=$(printf '%s\n' "${times[@]:1}" | sort -n | tr '\n' ' ')
        echo "busy round $r $setting: compute us: $sorted"
      else
        for clients in 1 4; do
          "$BUILD/client/attn_bench" --target="$target" --model=demo-mha --batch=1 --seq=16 \
            --concurrency="$clients" --duration="$SECONDS_EACH" --warmup-requests=200 --json \
            >"$bench_tmp/idle.json"
          python3 - "$r" "$setting" "$clients" "$bench_tmp/idle.json" <<'PY'
import json, sys
r, setting, clients, path = sys.argv[1:]
j = json.load(open(path))
print(f"idle round {r} {setting:<24} {clients} client(s): {j['ok_throughput_rps']:7.0f} req/s  "
      f"p50 {j['latency_us']['p50']:6.0f} us  compute/batch {j['server_timing']['compute_us_mean']:5.0f} us")
PY
        done
      fi
      bench_stop "$bench_last_pid"
    done
  done
  [[ -z $hog ]] || bench_stop "$hog"
done
