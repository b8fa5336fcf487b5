#!/usr/bin/env bash
# Installs the Debian 12 packages attnserve builds, runs and tests with.
# Idempotent: installs only what is missing. Uses sudo when not root.
#   scripts/install-deps.sh               build + test packages
#   scripts/install-deps.sh --build-only  what building attnserve and attn_client needs
#                                         (the Docker build stage; no tests, no benchmarks)
set -euo pipefail

BUILD_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler grpc-proto
  libdnnl-dev ocl-icd-opencl-dev prometheus-cpp-dev nlohmann-json3-dev libcivetweb-dev rapidjson-dev
  libssl-dev zlib1g-dev
)
TEST_PACKAGES=(
  # The unit tests and the engine benchmarks (Boost.Context: the CUDA emulation's fibers)
  libgtest-dev libgmock-dev libbenchmark-dev libboost-context-dev
  # Python client, PyTorch/NumPy oracles, a real Prometheus, an optimised BLAS for the peers
  python3 python3-venv python3-grpcio python3-grpc-tools python3-protobuf python3-numpy openssl
  python3-torch python3-pytest python3-yaml prometheus libopenblas0
  # The gRPC load balancers of the scale-out test, and compose (deploy/docker-compose.yml)
  nginx haproxy docker-compose
  # The container test: a Docker engine and the tool that makes its debian:bookworm base
  docker.io debootstrap
  # libFuzzer + ASan/UBSan for scripts/fuzz.sh (ctest's fuzz.short)
  clang-14 libfuzzer-14-dev libclang-rt-14-dev
  # scripts/sanitize.sh (run by .ci/run): its instrumented abseil comes from Debian's source
  # package (dpkg-dev unpacks it); ccache keeps repeated sanitizer builds short
  dpkg-dev ccache
)

PACKAGES=("${BUILD_PACKAGES[@]}")
case "${1:-}" in
  --build-only) ;;
  "") PACKAGES+=("${TEST_PACKAGES[@]}") ;;
  *) echo "usage: $0 [--build-only]" >&2; exit 2 ;;
esac

SUDO=()
if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo); fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
