#!/usr/bin/env bash
# Dynamic batching on vs off: attn_bench closed loop at concurrency 32 with
# small requests (demo-mha, batch 1, 16 tokens) against attnserve with its
# default batching (plus BATCHING_FLAGS) and with --max-batch-requests=1;
# prints throughput, p99, the p99 bound 2 x (max_queue_delay + one batch's
# compute), the server's own p99s (queue wait, and receipt to answer, also
# against the bound), and the throughput ratio.
#
#   bench/batching.sh [BUILD_DIR]      Env: DURATION (s, default 10),
#                                      ATTNSERVE_ARGS (server flags of both runs),
#                                      BATCHING_FLAGS (flags of the batching run,
#                                      e.g. --max-queue-delay-us=4000)
set -euo pipefail

build=${1:-build}
attnserve=$build/server/attnserve
bench=$build/client/attn_bench
duration=${DURATION:-10}
source "$(dirname "$0")/lib.sh"  # stops the server however this script exits
tmp=$bench_tmp

measure() {  # NAME SERVER-FLAGS...
  local name=$1; shift
  local target delay
  bench_start target "$tmp/$name.log" "$attnserve" --address=127.0.0.1:0 \
    --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 ${ATTNSERVE_ARGS:-} "$@"
  delay=$(printf '%s\n' "$@" | sed -n 's/^--max-queue-delay-us=//p'); delay=${delay:-0}
  "$bench" --target="$target" --model=demo-mha --batch=1 --seq=16 --concurrency=32 \
    --duration="$duration" --warmup-requests=200 --json >"$tmp/$name.json"
  bench_stop "$bench_last_pid"
  python3 - "$name" "$delay" "$tmp/$name.json" <<'PY'
import json, sys
name, delay, r = sys.argv[1], float(sys.argv[2]), json.load(open(sys.argv[3]))
t, l = r["server_timing"], r["latency_us"]
bound = 2 * (delay + t["compute_us_mean"])
open(sys.argv[3] + ".rps", "w").write(str(r["ok_throughput_rps"]))
print(f"{name:<12} {r['ok_throughput_rps']:9.1f} req/s  p50 {l['p50']:9.1f} us  p99 {l['p99']:9.1f} us  "
      f"batch mean {t['batch_requests_mean']:5.2f}  compute/batch {t['compute_us_mean']:8.1f} us  "
      f"p99 bound 2x(delay+compute) {bound:9.1f} us {'OK' if l['p99'] <= bound else 'EXCEEDED'}  "
      f"errors {r['errors'] or 0}")
# The server's share: its queue wait, in batches computing ahead of it, and
# its whole time per request (receipt to answer); the rest of the client's
# p99 is the transport's and the client's time.
c = max(t["compute_us_mean"], 1.0)
print(f"{'':<12} server: queue p99 {t['queue_us_p99']:9.1f} us ({t['queue_us_p99'] / c:4.2f} batches)  "
      f"total p99 {t['total_us_p99']:9.1f} us ({'within' if t['total_us_p99'] <= bound else 'over'} the bound)  "
      f"client p99 - server p99 {l['p99'] - t['total_us_p99']:9.1f} us")
PY
}

echo "demo-mha B1 L16, closed loop, concurrency 32, ${duration}s each"
measure batching     ${BATCHING_FLAGS:-}
measure no-batching  --max-batch-requests=1
python3 -c 'import sys; a, b = (float(open(f).read()) for f in sys.argv[1:]); print(f"batching / no-batching throughput: {a / b:.2f}x")' \
  "$tmp/batching.json.rps" "$tmp/no-batching.json.rps"
