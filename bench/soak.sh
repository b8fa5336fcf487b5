#!/usr/bin/env bash
# Soak: a real attnserve under mixed load (unary and stream, valid and
# invalid, small and large, cancellations, 1 ms deadlines, KServe v2 over
# HTTP valid and hostile) for DURATION
# seconds, with a repository model unloaded and loaded again over HTTP all
# along (explicit model control), its RSS and open file descriptors sampled;
# fails on RSS growth
# after warm-up over SOAK_RSS_BOUND_MB that stays after the load (bench/soak.py),
# on descriptors left open, or on any
# status a request's kind does not allow (bench/soak.py has the mix).
#
#   bench/soak.sh DURATION_S [BUILD_DIR]
# The server runs 8 HTTP workers: each worker's stack and buffers are touched
# the first time it serves, so with the default 64 the RSS rises (bounded,
# not a leak) as the hostile HTTP cases (bodies cut short hold a worker 2 s)
# bring more of them into use after the warm-up: +10.1 MB in one CI run,
# against +1.8 MB with 8.
#     Env: SOAK_RSS_BOUND_MB (default 10), SOAK_THREADS (client threads,
#          default 4), SOAK_WARMUP_S (default max(30, DURATION/4)),
#          SOAK_SAMPLES (write the samples as CSV there), SOAK_JSON (summary),
#          ATTNSERVE_ARGS (extra server flags)
set -euo pipefail

duration=${1:?usage: bench/soak.sh DURATION_S [BUILD_DIR]}
build=${2:-build}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/lib.sh"  # stops the server however this script exits

# The model that comes and goes: nn.MultiheadAttention(256, 4), 1 MiB of
# weights, so that a load or unload that kept its memory would show.
/usr/bin/python3 "$here/../tests/integration/serving_util.py" write-mha-model \
  "$bench_tmp/repository/soakm" 256 4
bench_start target "$bench_tmp/server.log" "$build/server/attnserve" --address=127.0.0.1:0 \
  --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 --http-request-timeout=2s \
  --http-threads=8 --model-repository="$bench_tmp/repository" --model-control-mode=explicit \
  --load-model=soakm \
  ${ATTNSERVE_ARGS:-}
pid=$bench_last_pid
http=$(grep -o -m1 "http on [0-9.]*:[0-9]*" "$bench_tmp/server.log" | awk '{print $3}')
echo "soak: attnserve pid $pid on $target (HTTP $http) for ${duration} s"
status=0
SOAK_HTTP=$http SOAK_MODEL=soakm /usr/bin/python3 "$here/soak.py" "$target" "$pid" "$duration" || status=$?
if ! kill -0 "$pid" 2>/dev/null; then
  echo "soak: FAILED: the server died" >&2
  cat "$bench_tmp/server.log" >&2
  exit 1
fi
# Log lines other than startup: a hostile mix must not write any.
grep -v -e "listening on" -e "metrics on" -e "http on" -e "^attnserve: " "$bench_tmp/server.log" | head -20 || true
exit "$status"
