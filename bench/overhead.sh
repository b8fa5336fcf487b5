#!/usr/bin/env bash
# The server's own overhead, as a ratio to the gRPC floor, in one run:
# attn_bench against attnserve and against bench/echo_server (same RPC, same
# payload bytes, no compute), closed loop at concurrency 1, for a tiny sdpa
# request and for 1 MiB and 16 MiB query payloads (output the same size).
#
#   bench/overhead.sh [BUILD_DIR]     (default: build; needs attnserve,
#                                      attn_bench and echo_server built)
# Env: ATTNSERVE_ARGS (extra server flags), TINY_REQUESTS, MIB_REQUESTS,
# MIB16_REQUESTS (measured requests of each case, default 5000, 300 and 40,
# each after N/10 + 5 warm-up requests; TINY_REQUESTS=20 MIB_REQUESTS=5
# MIB16_REQUESTS=2 is a quick check that the script runs).
set -euo pipefail

build=${1:-build}
attnserve=$build/server/attnserve
bench=$build/client/attn_bench
echo_server=$build/bench/echo_server
for b in "$attnserve" "$bench" "$echo_server"; do
  [[ -x $b ]] || { echo "overhead.sh: $b not built" >&2; exit 1; }
done

source "$(dirname "$0")/lib.sh"  # stops both servers however this script exits

bench_start server "$bench_tmp/attnserve.log" "$attnserve" --address=127.0.0.1:0 \
  --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 ${ATTNSERVE_ARGS:-}
bench_start floor "$bench_tmp/echo.log" "$echo_server" --address=127.0.0.1:0

# run NAME REQUESTS attn_bench-shape-flags... : one line per target.
run() {
  local name=$1 n=$2; shift 2
  local common=(--model=sdpa --layout=sdpa --concurrency=1 --requests="$n"
                --warmup-requests=$(( n / 10 + 5 )) --json "$@")
  local a e
  a=$("$bench" --target="$server" "${common[@]}")
  e=$("$bench" --target="$floor" "${common[@]}")
  python3 - "$name" "$a" "$e" <<'PY'
import json, sys
name, a, e = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
la, le = a["latency_us"], e["latency_us"]
bad = {k: v for k, v in a["errors"].items()} or {k: v for k, v in e["errors"].items()}
print(f"{name:<14} {a['request_bytes']:>10} B  p50 {la['p50']:9.1f} vs {le['p50']:9.1f} us "
      f"(+{la['p50'] - le['p50']:7.1f} us, {la['p50'] / le['p50']:.2f}x)  "
      f"p99 {la['p99']:9.1f} vs {le['p99']:9.1f} us  "
      f"server compute mean {a['server_timing']['compute_us_mean']:.1f} us"
      + (f"  ERRORS {bad}" if bad else ""))
PY
}

echo "attnserve $server vs echo floor $floor (closed loop, concurrency 1)"
echo "case              request   attnserve vs echo"
run "sdpa tiny"  "${TINY_REQUESTS:-5000}"  --batch=1 --heads=1 --seq=8 --head-dim=64
run "1 MiB"      "${MIB_REQUESTS:-300}"    --batch=1 --heads=1 --seq=4096 --kv-seq=8 --head-dim=64
run "16 MiB"     "${MIB16_REQUESTS:-40}"   --batch=1 --heads=1 --seq=65536 --kv-seq=8 --head-dim=64
