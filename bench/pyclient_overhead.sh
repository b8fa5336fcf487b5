#!/usr/bin/env bash
# The Python client's own cost per call against gRPC Python's floor
# (bench/pyclient_overhead.py), on bench/echo_server: no compute, so what is
# left is the client and the transfer.
#
#   bench/pyclient_overhead.sh [BUILD_DIR]     (default: build; needs echo_server)
# Env: CLIENT_DIR (the attnserve_client package's parent folder, default the
# checkout's client/python: point it at another checkout to compare),
# REQUESTS (per case and round, default 200), ROUNDS (default 3), CASES (only the
# cases whose name starts with this, e.g. tiny),
# PYTHON (default /usr/bin/python3: Debian's numpy and grpcio), CLIENT_TUNABLES
# (GLIBC_TUNABLES for the Python process only, e.g.
# glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-build}
echo_server=$build/bench/echo_server
[[ -x $echo_server ]] || { echo "pyclient_overhead.sh: $echo_server not built" >&2; exit 1; }
source "$(dirname "$0")/lib.sh"  # stops the server however this script exits

bench_start floor "$bench_tmp/echo.log" "$echo_server" --address=127.0.0.1:0
env PYTHONPATH="${CLIENT_DIR:-$root/client/python}" \
  ${CLIENT_TUNABLES:+GLIBC_TUNABLES="$CLIENT_TUNABLES"} "${PYTHON:-/usr/bin/python3}" \
  "$root/bench/pyclient_overhead.py" --target "$floor" --requests "${REQUESTS:-200}" \
  --rounds "${ROUNDS:-3}" --cases "${CASES:-}"
