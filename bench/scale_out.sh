#!/usr/bin/env bash
# Throughput of N attnserve replicas behind nginx (deploy/loadbalancer/nginx.conf,
# its ports rewritten) against 1 replica behind the same nginx and 1 replica
# direct, in one run: attn_bench closed loop, same request, same load.
#
#   bench/scale_out.sh [BUILD_DIR]     (default: build; needs attnserve and
#                                       attn_bench built, and nginx)
# Env: REPLICAS (default 3), SECONDS_EACH (default 10), CONCURRENCY (default
# 16), CHANNELS (default 4), ATTNSERVE_ARGS (extra server flags, e.g.
# --threads=1), BENCH_ARGS (request shape, default --model=demo-mha --seq=16).
set -euo pipefail

build=${1:-build}
attnserve=$build/server/attnserve
bench=$build/client/attn_bench
for b in "$attnserve" "$bench"; do
  [[ -x $b ]] || { echo "scale_out.sh: $b not built" >&2; exit 1; }
done
command -v nginx >/dev/null || { echo "scale_out.sh: nginx not installed" >&2; exit 1; }
conf_src=$(dirname "$0")/../deploy/loadbalancer/nginx.conf
replicas=${REPLICAS:-3}
seconds=${SECONDS_EACH:-10}

source "$(dirname "$0")/lib.sh"  # stops every process however this script exits

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

targets=()
for ((i = 0; i < replicas; i++)); do
  bench_start addr "$bench_tmp/attnserve$i.log" "$attnserve" --address=127.0.0.1:0 \
    --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 ${ATTNSERVE_ARGS:-}
  targets+=("$addr")
done

# start_nginx N: nginx over the first N replicas; sets lb to its address.
start_nginx() {
  local n=$1 port prefix servers="" i
  port=$(free_port)
  prefix=$bench_tmp/nginx$n
  mkdir -p "$prefix/tmp"
  for ((i = 0; i < n; i++)); do servers+="    server ${targets[$i]} max_fails=1 fail_timeout=5s;\n"; done
  sed -e "s/listen 127\.0\.0\.1:[0-9]* http2;/listen 127.0.0.1:$port http2;/" \
      -e "/^ *server 127\.0\.0\.1:[0-9]* .*;$/d" \
      -e "s/^  upstream attnserve {$/  upstream attnserve {\n$servers/" \
      "$conf_src" >"$prefix/nginx.conf"
  local user=""
  [[ $(id -u) -eq 0 ]] && user=" user root;"
  nginx -p "$prefix" -c "$prefix/nginx.conf" -g "daemon off;$user" >"$prefix/log" 2>&1 &
  bench_track $!
  for ((i = 0; i < 100; i++)); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
    sleep 0.05
  done
  lb=127.0.0.1:$port
}

run() {  # run NAME TARGET [attn_bench flags]: one line
  local name=$1 target=$2 out
  shift 2
  out=$("$bench" --target="$target" ${BENCH_ARGS:---model=demo-mha --seq=16} "$@" \
    --concurrency="${CONCURRENCY:-16}" --channels="${CHANNELS:-4}" --duration="$seconds" \
    --warmup-requests=200 --json)
  python3 - "$name" "$out" <<'PY'
import json, sys
name, r = sys.argv[1], json.loads(sys.argv[2])
l = r["latency_us"]
print(f"{name:<24} {r['ok_throughput_rps']:8.0f} ok/s  p50 {l['p50'] / 1e3:7.2f} ms  "
      f"p99 {l['p99'] / 1e3:7.2f} ms  errors {r['errors']}")
PY
}

echo "attn_bench closed loop, concurrency ${CONCURRENCY:-16}, ${CHANNELS:-4} channels, ${seconds} s each; $(nproc) cores"
run "1 replica, direct" "${targets[0]}"
start_nginx 1
run "1 replica, nginx" "$lb"
start_nginx "$replicas"
run "$replicas replicas, nginx" "$lb"
run "$replicas replicas, round_robin" "ipv4:$(IFS=,; echo "${targets[*]}")" --lb-policy=round_robin
