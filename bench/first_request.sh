#!/usr/bin/env bash
# The first request a fresh attnserve answers, with and without model
# warm-up (--model-warmup), next to the same request sent again (warm): the
# server's compute time of each (attn_client's "compute N us", the engine
# call), for demo-mha (B2 L16, self-attention), sdpa (B1 H8 L16 D64), and
# "loaded": a repository model of demo-mha's shape (nn.MultiheadAttention(512,
# 8)) loaded while the server runs (explicit model control, an HTTP load
# call), then called B2 L16. Servers alternate, ROUNDS of each (default 5).
#
#   bench/first_request.sh [BUILD_DIR]      (default: build)
set -euo pipefail
build=${1:-build}
source "$(dirname "$0")/lib.sh"  # stops the servers however this script exits
rounds=${ROUNDS:-5}

compute_us() {  # TARGET ARGS...: the compute time of one request
  local target=$1; shift
  "$build/client/attn_client" --target "$target" "$@" | grep -o "compute [0-9]* us" | awk '{print $2}'
}

/usr/bin/python3 "$(dirname "$0")/../tests/integration/serving_util.py" write-mha-model \
  "$bench_tmp/repository/loaded" 512 8
printf "%-10s %-8s %-6s %14s %14s\n" model warmup round "first (us)" "second (us)"
for ((r = 1; r <= rounds; r++)); do
  for warm in false true; do
    for model in demo-mha sdpa loaded; do
      bench_start target "$bench_tmp/server.log" "$build/server/attnserve" --address=127.0.0.1:0 \
        --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 --model-warmup="$warm" \
        --model-repository="$bench_tmp/repository" --model-control-mode=explicit
      pid=$bench_last_pid
      if [[ $model == demo-mha ]]; then
        args=(--model demo-mha --batch 2 --seq 16)
      elif [[ $model == loaded ]]; then
        http=$(grep -o -m1 "http on [0-9.]*:[0-9]*" "$bench_tmp/server.log" | awk '{print $3}')
        curl -sf -X POST "http://$http/v2/repository/models/loaded/load" >/dev/null
        args=(--model loaded --batch 2 --seq 16)
      else
        args=(--model sdpa --batch 1 --heads 8 --seq 16 --head-dim 64)
      fi
      first=$(compute_us "$target" "${args[@]}")
      second=$(compute_us "$target" "${args[@]}")
      printf "%-10s %-8s %-6s %14s %14s\n" "$model" "$warm" "$r" "$first" "$second"
      bench_stop "$pid"
    done
  done
done
