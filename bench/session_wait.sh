#!/usr/bin/env bash
# Session decode with and without the session wait (--session-wait-us): attn_bench
# --session, SESSIONS sessions of demo-mha prefilled with CONTEXT tokens, then
# STEPS one-token decode steps each, in closed loop; prints steps/s, latency and
# the mean batch of each run, and the ratio.
#
#   bench/session_wait.sh [BUILD_DIR]   Env: SESSIONS (default 8), CONTEXT (1024),
#                                       STEPS (400), ATTNSERVE_ARGS (flags of both runs)
set -euo pipefail

build=${1:-build}
attnserve=$build/server/attnserve
bench=$build/client/attn_bench
source "$(dirname "$0")/lib.sh"  # stops the server however this script exits
tmp=$bench_tmp

measure() {  # NAME SERVER-FLAGS...
  local name=$1; shift
  local target
  bench_start target "$tmp/$name.log" "$attnserve" --address=127.0.0.1:0 \
    --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 ${ATTNSERVE_ARGS:-} "$@"
  "$bench" --target="$target" --model=demo-mha --session --concurrency="${SESSIONS:-8}" \
    --context="${CONTEXT:-1024}" --decode-steps="${STEPS:-400}" --json >"$tmp/$name.json"
  bench_stop "$bench_last_pid"
  python3 - "$name" "$tmp/$name.json" <<'PY'
import json, sys
name, r = sys.argv[1], json.load(open(sys.argv[2]))
l, t = r["latency_us"], r["server_timing"]
open(sys.argv[2] + ".sps", "w").write(str(r["decode_steps_per_s"]))
print(f"{name:<8} {r['decode_steps_per_s']:8.1f} steps/s  p50 {l['p50']:9.1f} us  p99 {l['p99']:9.1f} us  "
      f"batch mean {t['batch_requests_mean']:5.2f}  compute/batch {t['compute_us_mean']:8.1f} us")
PY
}

echo "demo-mha sessions: ${SESSIONS:-8} x context ${CONTEXT:-1024}, ${STEPS:-400} decode steps each"
measure wait
measure no-wait --session-wait-us=0
python3 -c 'import sys; a, b = (float(open(f).read()) for f in sys.argv[1:]); print(f"wait / no-wait decode steps/s: {a / b:.2f}x")' \
  "$tmp/wait.json.sps" "$tmp/no-wait.json.sps"
