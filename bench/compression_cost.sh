#!/usr/bin/env bash
# What compression costs: zlib itself on float32 (bench/compression_cost.py zlib); a served
# call, attn_bench (sdpa fp32, 16 heads x 256 x 64: 3 MiB requests, 1 MiB answers,
# concurrency 1) against a plain server, against one started with
# --grpc-response-compression-level=low, and with --compression=gzip requests, three
# alternating rounds: req/s, client p50 and the server's own time (which gRPC's compression,
# done outside the handler, is not part of); then the REST port with tritonclient.http
# (bench/compression_cost.py http; needs BUILD_DIR/kserve-venv, which ctest -R test_kserve
# makes; skipped without it).
#
#   bench/compression_cost.sh [BUILD_DIR]     (default: build)
set -euo pipefail
build=${1:-build}
source "$(dirname "$0")/lib.sh"  # stops both servers however this script exits

common=(--backend=cpu --address=127.0.0.1:0 --metrics-address=127.0.0.1:0
        --http-address=127.0.0.1:0 --max-batch-requests=1 --max-batch-tokens=0)
/usr/bin/python3 "$(dirname "$0")/compression_cost.py" zlib
bench_start plain "$bench_tmp/plain.log" "$build/server/attnserve" "${common[@]}"
bench_start compressing "$bench_tmp/compressing.log" "$build/server/attnserve" "${common[@]}" \
  --grpc-response-compression-level=low

run() {  # LABEL TARGET [attn_bench flags...]
  local label=$1 target=$2; shift 2
  "$build/client/attn_bench" --target="$target" --model=sdpa --dtype=fp32 --heads=16 --seq=256 \
    --head_dim=64 --concurrency=1 --duration=5 --warmup_requests=20 --json "$@" |
    python3 -c '
import json, sys
d = json.load(sys.stdin)
print("%-32s req/s %5.0f  client p50 %6.0f us  server %5.0f us" % (
    sys.argv[1], d["ok_throughput_rps"], d["latency_us"]["p50"],
    d["server_timing"]["total_us_mean"]))
' "$label"
}
for _ in 1 2 3; do
  run "plain" "$plain"
  run "answers compressed (low)" "$compressing"
  run "requests gzip" "$plain" --compression=gzip
done
if [[ -x $build/kserve-venv/bin/python ]]; then
  http=$(grep -o -m1 "http on [0-9.]*:[0-9]*" "$bench_tmp/plain.log" | awk '{print $3}')
  "$build/kserve-venv/bin/python" "$(dirname "$0")/compression_cost.py" http "$http"
else
  echo "compression_cost.sh: no $build/kserve-venv (ctest -R test_kserve makes it): REST skipped"
fi
