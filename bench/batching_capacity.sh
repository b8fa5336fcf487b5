#!/usr/bin/env bash
# How much batching can pay on this machine, next to what it pays: the
# demo-mha B1 L16 closed loop of bench/batching.sh (concurrency 32, the
# client on the same CPUs as the server), with the capacity bound of the
# machine for it measured in the same run.
#
# A batched request costs CPU time in three places: the client, gRPC (both
# ends) and the engine. Their floors are measured apart:
#   transport  attn_bench against bench/echo_server (same RPC, 32 KiB in and
#              out, no compute), closed loop at concurrency 32: the machine's
#              busy CPU time per request (both processes, and the kernel's
#              loopback TCP work that neither is charged for);
#   engine     engine_bench's DemoMhaBatch at 32 requests per call on all
#              CPUs (wall time x threads: what the engine occupies), and its
#              stacked-sgemm ceiling (the four projections alone).
# With both at their floors and overlapping perfectly on the CPUs, the
# machine serves at most CPUS x 1e6 / (transport + engine) requests/s. That
# bound over the unbatched server's throughput is the most batching can
# gain here; the measured ratio is printed next to it.
#
#   bench/batching_capacity.sh [BUILD_DIR]    Env: DURATION (s, default 8)
set -euo pipefail

build=${1:-build}
attnserve=$build/server/attnserve
bench=$build/client/attn_bench
echo_server=$build/bench/echo_server
engine_bench=$build/bench/engine_bench
duration=${DURATION:-8}
for b in "$attnserve" "$bench" "$echo_server" "$engine_bench"; do
  [[ -x $b ]] || { echo "batching_capacity.sh: $b not built" >&2; exit 1; }
done
(( duration >= 4 )) || { echo "batching_capacity.sh: DURATION must be >= 4" >&2; exit 1; }
source "$(dirname "$0")/lib.sh"  # stops the servers however this script exits
tmp=$bench_tmp
cpus=$(nproc)
tick=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # user + system, all threads
# The machine's busy time: every CPU's ticks but idle and iowait.
busy_ticks() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9}' /proc/stat; }

# closed_loop NAME SERVER-PID TARGET ATTN_BENCH-FLAGS...: a closed loop at
# concurrency 32; writes NAME.json, and NAME.cpu with the CPU ticks of the
# server, of the client and of the whole machine at the start and the end of
# the middle of the run, the window's ends, and the tick rate.
closed_loop() {
  local name=$1 server_pid=$2 target=$3; shift 3
  "$bench" --target="$target" --concurrency=32 --duration="$duration" --warmup-requests=200 \
    --json "$@" >"$tmp/$name.json" &
  local client=$! s0 c0 m0 s1 c1 m1 t0 t1
  bench_track "$client"
  sleep 2
  s0=$(cpu_ticks "$server_pid"); c0=$(cpu_ticks "$client"); m0=$(busy_ticks); t0=$(date +%s.%N)
  sleep $(( duration - 3 ))
  s1=$(cpu_ticks "$server_pid"); c1=$(cpu_ticks "$client"); m1=$(busy_ticks); t1=$(date +%s.%N)
  wait "$client"
  echo "$s0 $s1 $c0 $c1 $m0 $m1 $t0 $t1 $tick" >"$tmp/$name.cpu"
}

serve() {  # NAME SERVER-FLAGS...: attnserve, demo-mha B1 L16
  local name=$1 target; shift
  bench_start target "$tmp/$name.log" "$attnserve" --address=127.0.0.1:0 \
    --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 "$@"
  closed_loop "$name" "$bench_last_pid" "$target" --model=demo-mha --batch=1 --seq=16
  bench_stop "$bench_last_pid"
}

echo "demo-mha B1 L16, closed loop, concurrency 32, ${duration}s each, $cpus CPUs"
serve batched
serve unbatched --max-batch-requests=1
bench_start floor "$tmp/echo.log" "$echo_server" --address=127.0.0.1:0
# 32 KiB of query in and of output back, as demo-mha B1 L16 (sdpa layout:
# the echo server has no models).
closed_loop echo "$bench_last_pid" "$floor" --model=sdpa --layout=sdpa --batch=1 --heads=1 \
  --seq=128 --kv-seq=1 --head-dim=64
bench_stop "$bench_last_pid"
# libgomp waits as in attnserve (server/main.cc: short spins).
OMP_WAIT_POLICY=active GOMP_SPINCOUNT=1000 "$engine_bench" \
  --benchmark_filter="^DemoMhaBatch(GemmCeiling)?/requests:32/threads:$cpus/" \
  --benchmark_min_time=1 --benchmark_format=json >"$tmp/engine.json" 2>/dev/null

python3 - "$tmp" "$cpus" <<'PY'
import json, sys
tmp, cpus = sys.argv[1], int(sys.argv[2])

def run(name):
    r = json.load(open(f"{tmp}/{name}.json"))
    s0, s1, c0, c1, m0, m1, t0, t1, tick = map(float, open(f"{tmp}/{name}.cpu").read().split())
    rps = r["ok_throughput_rps"]
    per = lambda a, b: (b - a) / tick / (t1 - t0) / rps * 1e6  # core-us per request
    return r, rps, per(s0, s1), per(c0, c1), per(m0, m1), (m1 - m0) / tick / (t1 - t0)

bat, bat_rps, bat_srv, bat_cli, _, bat_busy = run("batched")
_, unb_rps, _, _, _, _ = run("unbatched")
echo, echo_rps, echo_srv, echo_cli, transport, _ = run("echo")
for name, r in (("batched", bat), ("echo", echo)):
    if r["errors"]:
        sys.exit(f"batching_capacity.sh: errors in the {name} run: {r['errors']}")
bench = {b["name"]: b for b in json.load(open(f"{tmp}/engine.json"))["benchmarks"]}
def engine_us(prefix):  # wall time per request x threads
    (b,) = [v for k, v in bench.items() if k.startswith(prefix + "/")]
    return b["per_request"] * 1e6 * cpus
engine, ceiling = engine_us("DemoMhaBatch"), engine_us("DemoMhaBatchGemmCeiling")
t = bat["server_timing"]

print(f"transport floor (echo, {echo_rps:.0f} req/s): {transport:.0f} core-us per request of the"
      f" machine (server {echo_srv:.0f}, client {echo_cli:.0f}, the rest the kernel's)")
print(f"engine alone, 32 requests per call: {engine:.0f} core-us per request"
      f" (its stacked-sgemm ceiling {ceiling:.0f})")
print(f"batched:   {bat_rps:7.0f} req/s; server {bat_srv:.0f} + client {bat_cli:.0f} core-us per"
      f" request; CPUs busy {bat_busy:.2f} of {cpus}; batch mean {t['batch_requests_mean']:.1f},"
      f" engine {t['compute_us_mean'] * cpus / max(t['batch_requests_mean'], 1):.0f}"
      f" core-us per request in the server")
print(f"unbatched: {unb_rps:7.0f} req/s")
bound = cpus * 1e6 / (transport + engine)
bound_ceiling = cpus * 1e6 / (transport + ceiling)
print(f"capacity bound: {bound:.0f} req/s ({bound / unb_rps:.2f}x unbatched); with the engine at"
      f" its sgemm ceiling {bound_ceiling:.0f} req/s ({bound_ceiling / unb_rps:.2f}x)")
print(f"measured: {bat_rps / unb_rps:.2f}x, {bat_rps / bound:.2f} of the capacity bound")
PY
