#!/usr/bin/env bash
# The server's time per request outside the engine and the queue (its
# `timing` in each answer: total - compute - queue; the parse, the copy of the
# tensors off the wire, validation and the answer's handoff), for servers
# given as binaries, alternating, on the same loads: the served path's host
# time that the GPU issue (27) wants under half the transfers' time. Closed
# loop at concurrency 1, --max-batch-requests 1.
#
#   bench/host_rest.sh [BUILD_DIR] [SERVER_BINARY...]
#       (default: build's attnserve; several binaries: before/after)
# Env: ROUNDS (alternations, default 3), DURATION (seconds per run, default
# 5), SHAPES ("seq kv_seq head_dim" triples, ';'-separated; default "1 1024
# 128;1024 1024 128": 8 MiB of K/V with one query row, and the 12 MiB fp16
# request of bench/gpu_session.sh's serve phase), ATTNSERVE_ARGS.
set -euo pipefail

build=${1:-build}
shift || true
servers=("$@")
[[ ${#servers[@]} -gt 0 ]] || servers=("$build/server/attnserve")
bench=$build/client/attn_bench
[[ -x $bench ]] || { echo "host_rest.sh: $bench not built" >&2; exit 1; }

source "$(dirname "$0")/lib.sh"  # stops the servers however this script exits

IFS=';' read -r -a shapes <<< "${SHAPES:-1 1024 128;1024 1024 128}"
for ((round = 1; round <= ${ROUNDS:-3}; round++)); do
  for binary in "${servers[@]}"; do
    bench_start target "$bench_tmp/server.log" "$binary" --backend=cpu \
      --address=127.0.0.1:0 --metrics-address=127.0.0.1:0 --max-batch-requests=1 \
      --max-batch-tokens=0 ${ATTNSERVE_ARGS:-}
    pid=$bench_last_pid
    for shape in "${shapes[@]}"; do
      read -r seq kv head_dim <<< "$shape"
      out=$("$bench" --target="$target" --model=sdpa --dtype=fp16 --heads=16 --seq="$seq" \
        --kv_seq="$kv" --head_dim="$head_dim" --concurrency=1 --duration="${DURATION:-5}" \
        --warmup_requests=20 --json)
      python3 - "$binary" "$shape" "$out" <<'PY'
import json, sys
binary, shape, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
t = out["server_timing"]
rest = t["total_us_mean"] - t["compute_us_mean"] - t["queue_us_mean"]
print(f"{binary} seq/kv_seq/head_dim {shape}: {out['request_bytes'] / 2**20:.1f} MiB, "
      f"{out['ok']} requests, server {t['total_us_mean']:.0f} us = compute "
      f"{t['compute_us_mean']:.0f} + queue {t['queue_us_mean']:.0f} + rest {rest:.0f} us")
PY
    done
    bench_stop "$pid"
  done
done
