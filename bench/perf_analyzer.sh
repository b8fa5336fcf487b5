#!/usr/bin/env bash
# Triton's perf_analyzer against attnserve's KServe v2 front end, and, in the
# same run at the same shape, attn_bench against Attend: the KServe path's
# overhead as a ratio. perf_analyzer runs in a Debian trixie container (its
# PyPI wheel needs glibc >= 2.38) with --network host, on 127.0.0.1.
#
#   bench/perf_analyzer.sh [BUILD_DIR]     (default: build)
#   SHAPE_Q=1,8,16,64 SHAPE_KV=1,8,128,64 CONCURRENCY=4 SECONDS_EACH=10 RATE=200 ...
# perf_analyzer 2.60 keeps what it sends and receives for every request: its
# memory grows ~0.4 GB/s at ~1,000 requests/s (the 10 GB cap killed it within
# seconds on a 2-vCPU Xeon). Its phases therefore run at a fixed request rate
# (RATE per second, --request-rate-range), which bounds that; RATE=0 runs them
# closed loop at CONCURRENCY instead, as attn_bench's phase always does.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
BUILD=${1:-build}
PA_VERSION=${PA_VERSION:-2.60.0}
IMAGE=attnserve-perf-analyzer:$PA_VERSION
SHAPE_Q=${SHAPE_Q:-1,8,16,64}
SHAPE_KV=${SHAPE_KV:-1,8,128,64}
CONCURRENCY=${CONCURRENCY:-4}
RATE=${RATE:-200}
if ((RATE > 0)); then
  PA_LOAD=(--request-rate-range "$RATE")
else
  PA_LOAD=(--concurrency-range "$CONCURRENCY")
fi
SECONDS_EACH=${SECONDS_EACH:-10}

docker info > /dev/null 2>&1 || { echo "perf_analyzer.sh: no Docker engine answers (start dockerd)" >&2; exit 1; }
bench/perf_analyzer/build_image.sh "$IMAGE" "$PA_VERSION"

bench_start TARGET "$bench_tmp/server.log" "$BUILD/server/attnserve" \
  --address 127.0.0.1:0 --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0
echo "== attnserve on $TARGET; sdpa, query [$SHAPE_Q], key/value [$SHAPE_KV], fp32, concurrency $CONCURRENCY"

# perf_analyzer sends every input the model lists; the optional ones
# (attn_mask, key_lengths) are left out through an input-data file that
# gives only query, key and value (random normal values, fixed seed).
/usr/bin/python3 - "$SHAPE_Q" "$SHAPE_KV" > "$bench_tmp/data.json" <<'PY'
import json, sys
import numpy as np
q, kv = ([int(x) for x in s.split(",")] for s in sys.argv[1:3])
rng = np.random.default_rng(1)
data = {name: {"content": rng.standard_normal(shape).astype(np.float32).ravel().round(4).tolist(),
               "shape": shape} for name, shape in (("query", q), ("key", kv), ("value", kv))}
json.dump({"data": [data]}, sys.stdout)
PY
# Server-side time per request outside queue and compute (decode,
# validation, encode, gRPC), from ModelStatistics deltas around each phase:
# both front ends count in the same per-model statistics.
VENV_PY="$BUILD/kserve-venv/bin/python"   # made by the KServe test (tests/kserve/run.py)
stats() {
  [ -x "$VENV_PY" ] || return 0
  "$VENV_PY" - "$TARGET" "$1" <<'PY'
import json, sys
import tritonclient.grpc as tc
s = tc.InferenceServerClient(sys.argv[1]).get_inference_statistics("sdpa", as_json=True)["model_stats"][0]
i = s["inference_stats"]
now = {"n": int(i["success"].get("count", 0)), "total": int(i["success"].get("ns", 0)),
    "queue": int(i["queue"].get("ns", 0)), "compute": int(i["compute_infer"].get("ns", 0))}
path = sys.argv[2]
try:
    before = json.load(open(path))
except FileNotFoundError:
    json.dump(now, open(path, "w")); sys.exit(0)
d = {k: now[k] - before[k] for k in now}
json.dump(now, open(path, "w"))
n = max(d["n"], 1)
print(f"server per request: total {d['total'] / n / 1e3:.0f} us = queue {d['queue'] / n / 1e3:.0f} + "
      f"compute {d['compute'] / n / 1e3:.0f} + outside both {(d['total'] - d['queue'] - d['compute']) / n / 1e3:.0f} us"
      f" ({d['n']} requests)")
PY
}
stats "$bench_tmp/stats.json"
HTTP_TARGET=$(grep -o -m1 "http on [0-9.]*:[0-9]*" "$bench_tmp/server.log" | awk '{print $3}')
echo "== perf_analyzer $PA_VERSION -> KServe v2 over HTTP/REST (its default protocol)"
docker run --rm --network host --memory 10g -v "$bench_tmp/data.json:/data.json:ro" "$IMAGE" -m sdpa \
  -u "$HTTP_TARGET" --input-data /data.json "${PA_LOAD[@]}" \
  --measurement-interval $((SECONDS_EACH * 1000)) --stability-percentage 50 --max-trials 10 2>&1 | tee "$bench_tmp/pa_http.txt"
stats "$bench_tmp/stats.json"
echo "== perf_analyzer $PA_VERSION -> KServe v2 ModelInfer"
docker run --rm --network host --memory 10g -v "$bench_tmp/data.json:/data.json:ro" "$IMAGE" -m sdpa -i grpc \
  -u "$TARGET" --input-data /data.json "${PA_LOAD[@]}" \
  --measurement-interval $((SECONDS_EACH * 1000)) --stability-percentage 50 --max-trials 10 2>&1 | tee "$bench_tmp/pa.txt"
stats "$bench_tmp/stats.json"

IFS=, read -r B H LQ D <<< "$SHAPE_Q"
IFS=, read -r _ HKV LK _ <<< "$SHAPE_KV"
echo "== attn_bench -> attnserve.v1 Attend (same shape, same server)"
"$BUILD/client/attn_bench" --target "$TARGET" --model sdpa --layout sdpa --batch "$B" --heads "$H" \
  --kv-heads "$HKV" --seq "$LQ" --kv-seq "$LK" --head-dim "$D" --concurrency "$CONCURRENCY" \
  --duration "$SECONDS_EACH" 2>&1 | tee "$bench_tmp/ab.txt"
stats "$bench_tmp/stats.json"
