#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang-14, ASan and UBSan in
# their own build folder, and fuzzes each for SECONDS (default 60), starting
# from the checked-in seeds (tests/fuzz/corpus/<target>). New inputs go to
# BUILD_DIR/corpus/<target>, crashes to BUILD_DIR/artifacts/. Exit status:
# 0 none found, 1 a target crashed (its input and log are named), 77 clang-14
# or libFuzzer is missing (ctest counts that as skipped).
#
#   scripts/fuzz.sh [SECONDS] [BUILD_DIR]      default BUILD_DIR: build-fuzz
#     Env: FUZZ_TARGETS (space-separated subset), FUZZ_JOBS (build jobs, 2)
#
# A crash's input becomes a regression test by copying it into
# tests/fuzz/regressions/<target>/ (the ordinary build replays those).
set -euo pipefail

seconds=${1:-60}
build=${2:-build-fuzz}
root=$(cd "$(dirname "$0")/.." && pwd)
targets=${FUZZ_TARGETS:-attend_request_fuzzer safetensors_fuzzer model_config_fuzzer npy_fuzzer kserve_http_fuzzer kserve_grpc_request_fuzzer}

if ! command -v clang++-14 >/dev/null ||
   [[ ! -e $(clang++-14 -print-file-name=libclang_rt.fuzzer-x86_64.a) &&
      ! -e /usr/lib/llvm-14/lib/clang/14.0.6/lib/linux/libclang_rt.fuzzer-x86_64.a ]]; then
  echo "fuzz.sh: clang-14 with libFuzzer is not installed (scripts/install-deps.sh); skipped" >&2
  exit 77
fi

flags="-fsanitize=address,undefined -fsanitize=fuzzer-no-link -fno-sanitize-recover=undefined"
flags+=" -fno-omit-frame-pointer -gline-tables-only"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_COMPILER=clang++-14 "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_CXX_FLAGS_RELEASE="-O1" \
  -DATTNSERVE_CUDA=OFF -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF \
  -DATTNSERVE_FUZZ=ON >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
# shellcheck disable=SC2086
cmake --build "$build" -j"${FUZZ_JOBS:-2}" --target $targets

# ASan: report leaks too; UBSan: stop at the first report with a stack.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$build/artifacts"
failed=()
for t in $targets; do
  corpus=$build/corpus/$t
  mkdir -p "$corpus"
  log=$build/$t.log
  echo "fuzz.sh: $t for ${seconds} s"
  if "$build/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
       -max_len=65536 -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" \
       "$corpus" "$root/tests/fuzz/corpus/$t" >"$log" 2>&1; then
    grep -E "^stat::number_of_executed_runs|^#[0-9]+.*DONE" "$log" | tail -2 | sed 's/^/  /'
  else
    failed+=("$t")
    echo "fuzz.sh: $t FAILED; log $log; input(s):" >&2
    ls "$build/artifacts/$t-"* >&2 2>/dev/null || true
    grep -m5 -E "ERROR|runtime error|fuzzer: |SUMMARY" "$log" >&2 || true
  fi
done
if ((${#failed[@]})); then
  echo "fuzz.sh: crashes in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: no crash in ${seconds} s per target ($targets)"
