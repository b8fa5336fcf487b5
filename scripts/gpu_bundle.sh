#!/usr/bin/env bash
# Packs what a GPU machine without Debian's libraries needs to run the CUDA
# tests, benchmarks and the server: the binaries of a CUDA build (stripped),
# the shared libraries `ldd` names (all but glibc, libstdc++ and CUDA's own,
# which the GPU machine has), and the Python client's generated stubs.
#
#   scripts/gpu_bundle.sh [BUILD_DIR] [OUT_DIR]   # default build-cuda, .gpu
#
# BUILD_DIR is a build configured with -DATTNSERVE_CUDA=ON (architectures
# including 90a for Hopper) and -DATTNSERVE_BUILD_BENCH=ON. The bundle is
# OUT_DIR/bundle.tar.xz; bench/gpu_session.sh unpacks and uses it there.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-cuda}
out=${2:-$root/.gpu}
targets=(server/attnserve client/attn_client client/attn_bench tests/cuda_engine_test
         tests/cudnn_sdpa_test tests/fused_attention_test engine/cuda/attnserve_cuda_bench
         engine/cuda/libattnserve_cuda.so)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/stubs" "$out"
for t in "${targets[@]}"; do
  [[ -f "$build/$t" ]] || { echo "missing $build/$t (build it first)" >&2; exit 1; }
  cp "$build/$t" "$stage/bin/"
  strip --strip-unneeded "$stage/bin/$(basename "$t")"
done
# Libraries: everything ldd resolves, except what the GPU machine must provide
# itself (its glibc and C++ runtime are newer; CUDA comes with its driver).
for t in "${targets[@]}"; do ldd "$build/$t"; done |
  awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so|/(libcuda|libcudart|libcublas|libcublasLt)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
# The Python client's stubs, generated here (Debian's grpc_tools): the GPU
# machine's python has grpcio and protobuf but no grpc_tools.
ATTNSERVE_PY_STUBS_DIR="$stage/stubs" PYTHONPATH="$root/client/python" /usr/bin/python3 -c \
  'from attnserve_client import codegen; print(codegen.ensure_stubs())' >/dev/null
tar -C "$stage" -cJf "$out/bundle.tar.xz" .
ls -la "$out/bundle.tar.xz"
