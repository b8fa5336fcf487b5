#!/usr/bin/env bash
# Sanitizer builds of attnserve, each in its own build folder:
#
#   scripts/sanitize.sh asan [BUILD_DIR]   AddressSanitizer + UndefinedBehaviorSanitizer:
#       builds the test suite (GCC, -fsanitize=address,undefined) and runs all
#       of it under ctest (the Python tests drive the instrumented server),
#       except the soak and the fuzzers (own builds, own bounds) and the image
#       tests (test_container, test_compose: they put the build's binaries in
#       the runtime image, which has no sanitizer runtime; the ordinary suite
#       runs them).
#       Default BUILD_DIR: build-asan.
#   scripts/sanitize.sh tsan [BUILD_DIR]   ThreadSanitizer: builds and runs the
#       batching, scheduler, sessions, model control and server tests
#       (dynamic_batcher_test, batching_scheduler_test, session_manager_test,
#       kv_block_pool_test, model_manager_test, attn_server_test, the
#       request memory's pool, host_buffer_test, the shared-memory
#       regions, system_shared_memory_test, and the parallel copy of request
#       tensors, payload_copier_test), and the CUDA kernels on
#       their CPU emulation where the CUDA headers are (every
#       *_emulated_test: the fused kernels, the general kernel, the
#       sessions' kernels, the unfused path, QK-norm and RoPE, the
#       element-wise kernels).
#       Default BUILD_DIR: build-tsan.
#   scripts/sanitize.sh asan-cuda [BUILD_DIR]   The CUDA engine whole on its CPU
#       emulation under ASan + UBSan: the CUDA backend configured too (nvcc
#       needed; sm_90 only), then the emulated module
#       (libattnserve_cuda_emulated.so: engine/cuda's host code as written,
#       every kernel on the emulator) built instrumented and cuda_engine_test's
#       cases run on it, as the suite's cuda_engine_emulated.* run them (every
#       case but the three that need cuDNN). About 15 minutes on 2 cores, so
#       not in .ci/run; run it after changing engine/cuda.
#       Default BUILD_DIR: build-asan-cuda.
#   scripts/sanitize.sh tsan-cuda [BUILD_DIR]   The CUDA engine's host code
#       under ThreadSanitizer on the same emulation: the emulated module and
#       cuda_engine_test built with -fsanitize=thread (nvcc needed, as for
#       asan-cuda), then the cases where host threads meet in engine/cuda
#       (TSAN_CUDA_CASES: by default ConcurrentCallsGiveTheSameResults, each
#       caller on its own workspace, and
#       ConcurrentSessionsEachEqualOneCausalRequest, sessions on the one
#       device pool), each kernel's CUDA threads TSan fibers as in the tsan
#       mode. The other cases make their calls from one thread, where TSan
#       has nothing to compare. About 5 minutes on 2 cores (ccache warm), so not in
#       .ci/run; run it after changing engine/cuda's host code.
#       Default BUILD_DIR: build-tsan-cuda.
#
# Debian's abseil is not instrumented, so TSan cannot see its Mutex (thousands
# of false races). The tsan mode builds abseil from Debian's own source
# package (the same version and inline namespace, shared libraries with the
# same SONAMEs) with -fsanitize=thread, once, into BUILD_DIR/abseil-tsan, and
# runs the tests with LD_LIBRARY_PATH pointing there: every abseil call, ours
# and gRPC's, goes through the instrumented copy. That build is kept outside
# the build folder too, in ${ATTNSERVE_CACHE:-~/.cache/attnserve}, keyed by
# abseil's version, so that later runs (CI's clean clones) reuse it. The source comes through a
# private apt state under BUILD_DIR (deb-src lines only; the system's apt
# configuration is not touched). gRPC itself stays uninstrumented; races
# whose every frame is inside it are suppressed (scripts/tsan.supp).
#
# Exit status: 0 clean, 1 a test failed or a sanitizer reported. Not part
# of ctest (too slow for the suite: tens of minutes on 2 cores); .ci/run runs
# both after the suite. Object files go through ccache where it is installed
# (scripts/install-deps.sh installs it), so repeated runs rebuild little.
#   Env: JOBS (build jobs, default 2), CTEST_ARGS (extra ctest args, asan),
#   TSAN_CUDA_CASES (tsan-cuda's cases, CudaEngineTest's names, spaces between)
set -euo pipefail

mode=${1:?usage: scripts/sanitize.sh asan|tsan|asan-cuda|tsan-cuda [BUILD_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${JOBS:-2}
launcher=()
if command -v ccache >/dev/null; then
  # Paths below the checkout hash relative to it: a clone elsewhere hits too.
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$root}
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi

configure() {  # BUILD_DIR FLAGS [CMAKE_ARGS...]
  local dir=$1 flags=$2
  shift 2
  cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
    -DCMAKE_CXX_FLAGS="$flags -fno-omit-frame-pointer" -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DATTNSERVE_CUDA=OFF -DATTNSERVE_BUILD_TESTS=ON \
    -DATTNSERVE_BUILD_BENCH=OFF "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
}

# ASan's and UBSan's options for every asan mode.
asan_env() {
  # Leaks too; a UBSan report fails its test. The fd-limit test raises
  # its own limits: keep ASan from reserving a huge shadow per fd.
  export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
  # Leaks inside uninstrumented third-party libraries (scripts/lsan.supp).
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/scripts/lsan.supp:print_suppressions=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
}

# Builds Debian's abseil with -fsanitize=thread into $1/abseil-tsan/lib
# (skipped when already there).
instrumented_abseil() {
  local dir=$1/abseil-tsan apt=$1/abseil-tsan/apt version cache
  if [[ -e $dir/lib/libabsl_synchronization.so.20220623 ]]; then return; fi
  version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
  cache=${ATTNSERVE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/attnserve}/abseil-tsan-$version
  if [[ -e $cache/lib/libabsl_synchronization.so.20220623 ]]; then
    echo "sanitize.sh: instrumented abseil $version from $cache"
    mkdir -p "$dir" && cp -a "$cache/lib" "$dir/"
    return
  fi
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$dir/src"
  printf 'deb-src http://deb.debian.org/debian bookworm main\n%s\n' \
    'deb-src http://deb.debian.org/debian-security bookworm-security main' >"$apt/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o Debug::NoLocking=1)
  echo "sanitize.sh: fetching abseil $version (Debian source package)"
  apt-get "${opts[@]}" update -qq
  # dpkg-source applies Debian's patches (SONAMEs, the debian3 namespace).
  (cd "$dir/src" && apt-get "${opts[@]}" source --download-only -qq "abseil=$version" &&
     rm -rf absl && dpkg-source -x -q ./*.dsc absl >/dev/null)
  echo "sanitize.sh: building abseil with -fsanitize=thread (once; cached in $dir)"
  cmake -S "$dir/src/absl" -B "$dir/build" -G Ninja "${launcher[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" \
    -DCMAKE_INSTALL_PREFIX="$dir" -DCMAKE_INSTALL_LIBDIR=lib >"$dir/configure.log" 2>&1 ||
    { cat "$dir/configure.log"; exit 1; }
  cmake --build "$dir/build" -j"$jobs" >"$dir/build.log" 2>&1 || { tail -50 "$dir/build.log"; exit 1; }
  cmake --install "$dir/build" >/dev/null
  mkdir -p "$cache" && cp -a "$dir/lib" "$cache/" || true  # a cache only: never fatal
}

# TSan's environment for the tests of BUILD_DIR (its instrumented abseil).
tsan_env() {
  export LD_LIBRARY_PATH=$1/abseil-tsan/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=0:second_deadlock_stack=1:history_size=4:suppressions=$root/scripts/tsan.supp}
  # libgomp is not instrumented either, so TSan cannot see the barrier that
  # ends an OpenMP region: the engine's buffers, written by its OpenMP
  # workers and freed by the calling thread after the region, look unordered
  # (seen in a warm-up on the main thread). The checked concurrency is the
  # server's (batchers, sessions, model swaps), so each engine call runs on
  # its calling thread here: --threads 0 resolves to OpenMP's count, 1.
  export OMP_NUM_THREADS=1
}

# Runs BUILD_DIR/tests/TEST's cases that FILTER names under TSan, its log in
# BUILD_DIR/NAME.tsan.log; a failure, a TSan report (or with no-skips, a
# skipped case) sets status=1.
tsan_run() {  # BUILD_DIR TEST FILTER NAME [no-skips]
  local log=$1/$4.tsan.log reports
  echo "sanitize.sh: $2 under TSan$([[ $3 != '*' ]] && echo " (gtest_filter=$3)")"
  if ! "$1/tests/$2" --gtest_filter="$3" >"$log" 2>&1; then status=1; fi
  reports=$(grep -c "WARNING: ThreadSanitizer" "$log" || true)
  echo "  $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$log" | tr '\n' ' ') TSan reports: $reports ($log)"
  if ((reports > 0)); then status=1; grep -A12 -m3 "WARNING: ThreadSanitizer" "$log" || true; fi
  if [[ ${5:-} == no-skips ]] && grep -q '^\[  SKIPPED \]' "$log"; then status=1; fi
}

# Configures BUILD_DIR with FLAGS and the CUDA backend (sm_90 only) and builds
# the emulated module and cuda_engine_test with them (a module links the
# sanitizer runtimes too).
emulated_module() {  # BUILD_DIR FLAGS
  configure "$1" "$2" -DATTNSERVE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DCMAKE_MODULE_LINKER_FLAGS="$2" -DCMAKE_SHARED_LINKER_FLAGS="$2"
  cmake --build "$1" -j"$jobs" --target attnserve_cuda_emulated cuda_engine_test
}

case "$mode" in
  asan)
    build=${2:-build-asan}
    configure "$build" "-fsanitize=address,undefined -fno-sanitize-recover=undefined"
    cmake --build "$build" -j"$jobs"
    asan_env
    # shellcheck disable=SC2086
    ctest --test-dir "$build" --output-on-failure --timeout 1800 \
      -E '^(soak|fuzz\.short|integration\.test_(container|compose))' \
      ${CTEST_ARGS:-}
    ;;
  asan-cuda)
    build=${2:-build-asan-cuda}
    emulated_module "$build" "-fsanitize=address,undefined -fno-sanitize-recover=undefined"
    asan_env
    ctest --test-dir "$build" --output-on-failure --timeout 3600 -j"$jobs" \
      -R '^cuda_engine_emulated\.'
    ;;
  tsan)
    build=${2:-build-tsan}
    mkdir -p "$build"
    build=$(cd "$build" && pwd)
    instrumented_abseil "$build"
    configure "$build" "-fsanitize=thread"
    tests=(dynamic_batcher_test batching_scheduler_test session_manager_test kv_block_pool_test
           model_manager_test attn_server_test host_buffer_test system_shared_memory_test
           payload_copier_test)
    # The CUDA kernels on the CPU emulation (tests/CMakeLists.txt: built where
    # the CUDA headers are), each CUDA thread a TSan fiber ordered only by
    # the barriers: a missing __syncthreads between a shared memory write
    # and another thread's read is a race here.
    if ninja -C "$build" -t targets all 2>/dev/null | grep -q '^flash_attention_emulated_test:'; then
      tests+=(warp_emulator_test flash_attention_emulated_test flash_attention_fp32_emulated_test
              paged_attention_emulated_test unfused_attention_emulated_test
              attention_general_emulated_test qk_transform_emulated_test
              elementwise_emulated_test)
    fi
    cmake --build "$build" -j"$jobs" --target "${tests[@]}"
    tsan_env "$build"
    status=0
    # AttendStream's reactor is built on one gRPC thread and its reactions
    # run on others; the handoff happens inside uninstrumented libgrpc, so
    # every stream test reports races in gRPC's header code inlined here
    # (CallOpSet, CallbackWithSuccessTag), before and after any fix alike.
    # Those tests run under the asan mode instead, whose use-after-free
    # checks need no instrumented gRPC.
    # model_manager_test's tests with gRPC clients report the same handoff (a
    # unary reactor finished on a batcher thread, its completion run on a gRPC
    # thread): always with concurrent clients, and with a single client when
    # the host is busy (reproduced with one busy process beside it). So only
    # its tests without a gRPC client run here: DispatcherRacesReloadsAndUnloads
    # drives the same swap against the request path without gRPC, which TSan
    # sees whole. The others run in the suite and under asan.
    declare -A filter=([attn_server_test]='-*Stream*'
                       [model_manager_test]='*DispatcherRaces*:*RefusesAnUnknownLoadModel*')
    for t in "${tests[@]}"; do tsan_run "$build" "$t" "${filter[$t]:-*}" "$t"; done
    exit "$status"
    ;;
  tsan-cuda)
    build=${2:-build-tsan-cuda}
    mkdir -p "$build"
    build=$(cd "$build" && pwd)
    instrumented_abseil "$build"
    emulated_module "$build" "-fsanitize=thread"
    tsan_env "$build"
    export ATTNSERVE_CUDA_MODULE=$build/tests/libattnserve_cuda_emulated.so
    status=0
    # Each case alone (a log each); one that skips did not run on the module.
    for c in ${TSAN_CUDA_CASES:-ConcurrentCallsGiveTheSameResults ConcurrentSessionsEachEqualOneCausalRequest}; do
      tsan_run "$build" cuda_engine_test "CudaEngineTest.$c" "cuda_engine_test.$c" no-skips
    done
    exit "$status"
    ;;
  *) echo "usage: $0 asan|tsan|asan-cuda|tsan-cuda [BUILD_DIR]" >&2; exit 2 ;;
esac
