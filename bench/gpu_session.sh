#!/usr/bin/env bash
# One GPU lease's worth of checks and measurements of the CUDA backend, run on
# the device machine from the repository root with the bundle that
# scripts/gpu_bundle.sh made here (the device machine has CUDA, PyTorch,
# pytest, grpcio and protobuf, but none of Debian's libraries).
#
#   bench/gpu_session.sh [PHASE...]   # default: info test sanitize sessions server bench serve sessionserve
#
# Phases: info (GPU, driver, toolkit, torch), test (cuda_engine_test: every
# CUDA unit test, 200 random cases against the reference engine; and
# fused_attention_test: both fused kernels against float64), sanitize
# (compute-sanitizer memcheck over the fused-kernel tests), server
# (tests/integration/test_cuda_server.py against attnserve --backend cuda),
# bench (bench/cuda_bench.py: kernel vs torch SDPA backends, projections vs
# cuBLAS), quickbench (fp16/bf16 at L 2048 only, every fp32 and
# layer-feature row), serve (attn_bench through the server, 1.5 and 12 MiB
# requests, concurrency 1 and 32, batching on and off, next to cudaMemcpy
# bandwidth), firstcall (the first request of a
# cuDNN length bucket with the bucket built at load by config.pbtxt warmup,
# and without; not in the default list), sessions (the GPU session tests of
# cuda_engine_test under compute-sanitizer memcheck, then
# attnserve_cuda_bench --paged: 32 sessions' decode step against a device
# copy of their K/V, the split-KV decode against gather + fused kernel, and
# for prefills and long appends gather + cuDNN against gather + fused kernel),
# sessionserve (bench/session_decode.sh on --backend cuda: decode through
# sessions against stateless).
#
# A lease is 15 minutes of device time in all, the machine's start (a minute
# or two) and the idle time between calls included, and one call may run
# 600 s. The phases' times on an H200 (runs 4-7 of docs/gpu-runs/2026-11-26-h200):
# info 8 s, test 95 s (before fused_attention_test and the newer engine tests
# joined it: about 200 s now, estimated), sanitize 50 s (before the fused
# kernels' memcheck joined it, which may take its 150 s timeout), sessions
# 37 s (more session tests under memcheck now), server 25 s, quickbench 37 s
# (with the fp32 and layer-feature rows it lacked then: about 60 s),
# serve about 75 s, sessionserve 14 s, bench (the full table) several
# minutes. So a lease takes them in order of what they decide, as two calls
# (about 760 s of commands once the start and the transfers are paid):
#   1. info test sessions quickbench        (about 300 s; timeout_s 420)
#   2. serve server sessionserve sanitize   (about 350 s; timeout_s: what
#                                            status says is left, less 60)
# and the full table only if time remains. Each phase's end and its elapsed
# seconds are printed ("--- PHASE done at N s"), and the logs are packed
# after every phase, so a call cut off at its limit still brings back the
# phases it finished.
# BUNDLE names another bundle (default .gpu/bundle.tar.xz), TAG names its
# logs. Logs go to $OUT/logs-TAG.tar.gz (the device tool brings back few
# files), else ./gpu-out.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=${BUNDLE:-$root/.gpu/bundle.tar.xz}
tag=${TAG:-$(basename "$bundle" .tar.xz)}
final=${OUT:-$root/gpu-out}
out=/tmp/attnserve-gpu-logs/$tag
mkdir -p "$out" "$final"
as=/tmp/attnserve-gpu-$tag
phases=("$@")
[[ ${#phases[@]} -gt 0 ]] || phases=(info test sanitize sessions server bench serve sessionserve)
# Every command on the GPU runs under `timeout`, so a kernel that hangs costs
# its phase, not the lease. The logs are packed after every phase, not only at exit: the device tool
# kills a command at its time limit without running traps, and what lies in
# $OUT then still comes back, so a lease cut short keeps its finished phases.
save_logs() { tar -C "$out" -czf "$final/logs-$tag.tar.gz.part" . && mv -f "$final/logs-$tag.tar.gz.part" "$final/logs-$tag.tar.gz"; }
trap save_logs EXIT

rm -rf "$as" && mkdir -p "$as" && tar -C "$as" -xJf "$bundle" || exit 1
# CUDA's own libraries from the machine: the toolkit's, else PyTorch's wheels;
# cuDNN (dlopened by the module) from PyTorch's wheel.
cudalibs=$(find /usr/local/cuda*/ /opt /usr/lib \( -name 'libcublasLt.so.13' -o -name 'libcudnn.so.9' \) \
           2>/dev/null | xargs -r -n1 dirname | sort -u | paste -sd:)
export LD_LIBRARY_PATH="$as/lib:${cudalibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export ATTNSERVE_CUDA_MODULE="$as/bin/libattnserve_cuda.so"
export ATTNSERVE_BIN="$as/bin/attnserve" ATTN_CLIENT_BIN="$as/bin/attn_client"
export ATTNSERVE_SOURCE_DIR="$root" ATTNSERVE_PY_STUBS_DIR="$as/stubs" PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }
started=$SECONDS

for phase in "${phases[@]}"; do
  case $phase in
    info)
      step info
      nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      nvcc --version | tail -2
      python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())'
      echo "CUDA libraries from: $cudalibs"
      ldd "$as/bin/libattnserve_cuda.so" | grep -E "cuda|cublas"
      ;;
    test)
      step "cuda_engine_test"
      timeout -k 5 60 "$as/bin/cudnn_sdpa_test" 2>&1 | tee "$out/cudnn_sdpa_test.log" | tail -3
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      # The fused kernels launched directly, against float64 computed in the test.
      ATTNSERVE_REQUIRE_GPU=1 timeout -k 5 150 "$as/bin/fused_attention_test" 2>&1 |
        tee "$out/fused_attention_test.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED)|OK \]|Failure|got " | head -40
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ATTNSERVE_REQUIRE_CUDNN=1 timeout -k 5 300 "$as/bin/cuda_engine_test" 2>&1 |
        tee "$out/cuda_engine_test.log" | grep -E "^\[  (FAILED|PASSED|SKIPPED)|OK \]|Failure|Expected|Which is|rel|error|declined" | head -150
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ;;
    sanitize)
      step "compute-sanitizer memcheck"
      timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 "$as/bin/cuda_engine_test" \
        --gtest_filter='CudaEngineTest.FusedKernelShapes*:CudaEngineTest.FullyMasked*:CudaEngineTest.RunProjection*:CudaEngineTest.RaggedBatches*:CudaEngineTest.WindowSoftcap*:CudaEngineTest.LlmLayer*' \
        > "$out/memcheck.log" 2>&1
      rc=$?; echo "memcheck exit $rc"; grep -E "ERROR SUMMARY|Invalid|FAILED" "$out/memcheck.log" | head -20
      [[ $rc -eq 0 ]] || status=1
      timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$as/bin/fused_attention_test" --gtest_filter='-*LongRows*' > "$out/memcheck_fused.log" 2>&1
      rc=$?; echo "memcheck (fused kernels) exit $rc"
      grep -E "ERROR SUMMARY|Invalid|FAILED" "$out/memcheck_fused.log" | head -20
      [[ $rc -eq 0 ]] || status=1
      # The cuDNN path: our padding copies, the expanded mask, cuDNN's kernels.
      ATTNSERVE_REQUIRE_CUDNN=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$as/bin/cuda_engine_test" --gtest_filter='CudaEngineTest.CudnnServes*' \
        > "$out/memcheck_cudnn.log" 2>&1
      rc=$?; echo "memcheck (cuDNN) exit $rc"
      grep -E "ERROR SUMMARY|Invalid|FAILED" "$out/memcheck_cudnn.log" | head -20
      [[ $rc -eq 0 ]] || status=1
      ;;
    server)
      step "server on the GPU: tests/integration/test_cuda_server.py"
      # The stubs come from Debian's protoc 3.21; a newer protobuf runtime
      # reads such generated code only through its pure-Python implementation.
      PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python ATTNSERVE_REQUIRE_GPU=1 timeout -k 5 180 python3 -m pytest -q -p no:cacheprovider \
        "$root/tests/integration/test_cuda_server.py" 2>&1 | tee "$out/server_test.log" | tail -40
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      ;;
    bench|quickbench)
      quick=(); [[ $phase == quickbench ]] && quick=(--quick)
      step "bench/cuda_bench.py ${quick[*]}"
      timeout -k 5 "$([[ $phase == quickbench ]] && echo 240 || echo 900)" \
        python3 "$root/bench/cuda_bench.py" --bench "$as/bin/attnserve_cuda_bench" "${quick[@]}" \
        --json "$out/cuda_bench.json" 2>&1 | tee "$out/cuda_bench.md"
      ;;
    serve)
      step "served: attn_bench through attnserve --backend cuda"
      python3 "$root/bench/gpu_copy_bandwidth.py" 2>&1 | tee "$out/copy_bandwidth.txt"
      for batching in 16 1; do
        log="$out/serve_server_b$batching.log"
        # ATTNSERVE_CUDA_PROFILE=1: one line per engine call with its
        # transfers' and kernels' device time (staging.h), summed per run
        # by bench/serve_split.py against the server's own time per request.
        ATTNSERVE_CUDA_PROFILE=1 "$as/bin/attnserve" --backend cuda --address 127.0.0.1:0 \
          --metrics-address 127.0.0.1:0 --http-address 127.0.0.1:0 \
          --max-batch-requests "$batching" --max-batch-tokens 0 > "$log" 2>&1 &
        pid=$!
        for _ in $(seq 100); do grep -q "listening on" "$log" && break; sleep 0.1; done
        target=$(grep -oE "listening on [0-9.:]+" "$log" | awk '{print $3}')
        # 1.5 MiB (16 heads x 256 x 64 fp16, x3) and 12 MiB (16 x 1024 x 128 fp16, x3).
        for shape in "256 64" "1024 128"; do
          set -- $shape
          for conc in 1 32; do
            echo "batching=$batching seq=$1 head_dim=$2 concurrency=$conc"
            before=$(wc -l < "$log")
            "$as/bin/attn_bench" --target "$target" --model sdpa --dtype fp16 --heads 16 \
              --seq "$1" --head_dim "$2" --concurrency "$conc" --duration 6 \
              --warmup_requests 20 --json | tee "$out/serve_run.json" | tee -a "$out/serve.jsonl"
            tail -n +"$((before + 1))" "$log" | python3 "$root/bench/serve_split.py" \
              --bench-json "$out/serve_run.json" \
              --label "batching=$batching seq=$1 head_dim=$2 concurrency=$conc" \
              | tee -a "$out/serve_split.txt"
          done
        done
        kill "$pid"; wait "$pid"
      done
      ;;
    firstcall)
      # The first request of a new cuDNN length bucket, with the bucket
      # built at load (config.pbtxt warmup) and without: the server's
      # compute time of the first and of the second request, 3 rounds.
      step "firstcall: first request of a bucket, warmed at load or not"
      repo=$(mktemp -d)
      mkdir -p "$repo/warmed" "$repo/cold"
      printf 'kind: "sdpa"\nprecision: "bf16"\nwarmup { batch: 1 q_len: 2048 dtype: "bf16" %s }\n' \
        'num_heads: 16 head_dim: 128' \
        > "$repo/warmed/config.pbtxt"
      printf 'kind: "sdpa"\nprecision: "bf16"\n' > "$repo/cold/config.pbtxt"
      for round in 1 2 3; do
        for model in cold warmed; do
          log="$out/firstcall_${model}_${round}.log"
          "$as/bin/attnserve" --backend cuda --address 127.0.0.1:0 --metrics-address 127.0.0.1:0 \
            --http-address 127.0.0.1:0 --model-repository "$repo" > "$log" 2>&1 &
          pid=$!
          for _ in $(seq 300); do grep -q "listening on" "$log" && break; sleep 0.1; done
          target=$(grep -oE "listening on [0-9.:]+" "$log" | awk '{print $3}')
          for call in first second; do
            us=$("$as/bin/attn_client" --target "$target" --model "$model" --dtype bf16 --heads 16 \
                   --seq 2048 --head_dim 128 | grep -o "compute [0-9]* us" | awk '{print $2}')
            echo "round $round model $model $call compute_us $us" | tee -a "$out/firstcall.txt"
          done
          kill "$pid"; wait "$pid"
        done
      done
      rm -rf "$repo"
      ;;
    sessions)
      step "sessions: memcheck over the paged-KV tests, then cuda_bench --paged"
      timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$as/bin/cuda_engine_test" \
        --gtest_filter='CudaEngineTest.*Session*:CudaEngineTest.RefusesPagedTasks*' \
        > "$out/memcheck_sessions.log" 2>&1
      rc=$?; echo "memcheck (sessions) exit $rc"
      grep -E "ERROR SUMMARY|Invalid|FAILED|Failure" "$out/memcheck_sessions.log" | head -20
      [[ $rc -eq 0 ]] || status=1
      timeout -k 5 180 "$as/bin/attnserve_cuda_bench" --paged --iters 20 2>&1 | tee "$out/cuda_bench_paged.jsonl"
      ;;
    sessionserve)
      # Decode through the server's sessions against the same decode sent
      # statelessly (bench/session_decode.sh: 32 sessions x 4k context,
      # fp16, 8 heads of 128), attnserve --backend cuda.
      step "sessionserve: bench/session_decode.sh on the cuda backend"
      fake=$as/build && mkdir -p "$fake/client" "$fake/server"
      ln -sf "$as/bin/attn_bench" "$fake/client/attn_bench"
      ln -sf "$as/bin/attnserve" "$fake/server/attnserve"
      PYTHON=$(command -v python3) ATTNSERVE_ARGS="--backend cuda" ROUNDS=${ROUNDS:-2} timeout 240 \
        bash "$root/bench/session_decode.sh" "$fake" 2>&1 | tee "$out/session_decode.txt" | grep -E "round|error"
      ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
  echo "--- $phase done at $((SECONDS - started)) s"
  save_logs
done
exit $status
