#!/usr/bin/env bash
# Decode through server-side sessions against the same decode done
# statelessly (every step re-sends the whole context), on one server, in
# alternating rounds: the peer is measured in the same run.
#
#   bench/session_decode.sh [BUILD_DIR]
#   CONTEXT=4096 SESSIONS=32 STEPS=16 HEADS=8 HEAD_DIM=128 ROUNDS=2 bench/session_decode.sh build
#
# Prints one line per run (steps/s, request bytes per step) and the ratio
# session / stateless of each round. Extra server flags: ATTNSERVE_ARGS.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
source "$root/bench/lib.sh"
context=${CONTEXT:-4096} sessions=${SESSIONS:-32} steps=${STEPS:-16}
heads=${HEADS:-8} head_dim=${HEAD_DIM:-128} rounds=${ROUNDS:-2}
bench_start target "$bench_tmp/server.log" "${SERVER_BIN:-$build/server/attnserve}" --address 127.0.0.1:0 \
  --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0 ${ATTNSERVE_ARGS:-}
common=(--target "$target" --model sdpa --concurrency "$sessions" --heads "$heads"
        --head_dim "$head_dim" --dtype fp16 --timeout_ms 600000 --json)
field() { ${PYTHON:-/usr/bin/python3} -c "import json,sys; d=json.load(open(sys.argv[1])); print(d$2)" "$1"; }
for ((r = 1; r <= rounds; r++)); do
  "$build/client/attn_bench" "${common[@]}" --session --context "$context" \
    --decode_steps "$steps" > "$bench_tmp/session.json"
  "$build/client/attn_bench" "${common[@]}" --requests $((sessions * steps)) --seq 1 \
    --kv_seq "$context" --causal > "$bench_tmp/stateless.json"
  ${PYTHON:-/usr/bin/python3} - "$bench_tmp/session.json" "$bench_tmp/stateless.json" "$r" <<'PY'
import json, sys
s, t = (json.load(open(p)) for p in sys.argv[1:3])
def rate(d):
    return d.get("decode_steps_per_s") or d["ok_throughput_rps"]
print(f"round {sys.argv[3]}: session {rate(s):.1f} steps/s, stateless {rate(t):.1f} steps/s, "
      f"ratio {rate(s) / rate(t):.2f}")
print("  session:", json.dumps(s))
print("  stateless:", json.dumps(t))
PY
done
