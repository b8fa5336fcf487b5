#!/usr/bin/env bash
# One server, four kinds of load, demo-mha B1 L16: closed loops of 32 and of
# 8 clients (each sends again when answered) and open loops of 1,500 and
# 3,000 requests/s (evenly spaced, whatever the answers do). Prints
# throughput, p50, p99 and the mean batch of each. Run it twice, with and
# without a batching flag, to see what the flag does to each kind of
# traffic (docs/PERFORMANCE.md, "Refill wait").
#
#   bench/batching_loads.sh [BUILD_DIR] [SERVER-FLAGS...]
#                                      Env: DURATION (s per load, default 6)
set -euo pipefail

build=${1:-build}
shift || true
attnserve=$build/server/attnserve
bench=$build/client/attn_bench
duration=${DURATION:-6}
source "$(dirname "$0")/lib.sh"  # stops the server however this script exits

bench_start target "$bench_tmp/server.log" "$attnserve" --address=127.0.0.1:0 \
  --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 "$@"
echo "demo-mha B1 L16, ${duration}s per load, server flags: ${*:-(defaults)}"
for load in --concurrency=32 --concurrency=8 --rate=1500 --rate=3000; do
  "$bench" --target="$target" --model=demo-mha --batch=1 --seq=16 "$load" \
    --duration="$duration" --warmup-requests=200 --json >"$bench_tmp/load.json"
  python3 - "$load" "$bench_tmp/load.json" <<'PY'
import json, sys
load, r = sys.argv[1], json.load(open(sys.argv[2]))
t, l = r["server_timing"], r["latency_us"]
print(f"{load:<17} {r['ok_throughput_rps']:7.0f} req/s  p50 {l['p50'] / 1e3:6.2f} ms  "
      f"p99 {l['p99'] / 1e3:6.2f} ms  batch mean {t['batch_requests_mean']:5.1f}  "
      f"errors {r['errors'] or 0}")
PY
done
