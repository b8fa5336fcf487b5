#!/usr/bin/env bash
# KServe v2 over HTTP/REST vs over gRPC on one attnserve, with Triton's own
# clients (bench/http_vs_grpc.py): a 1 MiB binary request and a tiny one,
# sequential, alternating rounds. Needs the KServe test's venv
# (BUILD/kserve-venv: ctest -R test_kserve makes it).
#
#   bench/http_vs_grpc.sh [BUILD_DIR]     (default: build)
# Env: ATTNSERVE_ARGS (extra server flags), REQUESTS (per round, default 200),
# ROUNDS (default 3).
set -euo pipefail

build=${1:-build}
python=$build/kserve-venv/bin/python
[[ -x $python ]] || { echo "http_vs_grpc.sh: $python missing: run ctest -R test_kserve first" >&2; exit 1; }
source "$(dirname "$0")/lib.sh"  # stops the server however this script exits

bench_start server "$bench_tmp/attnserve.log" "$build/server/attnserve" --address=127.0.0.1:0 \
  --metrics-address=127.0.0.1:0 --http-address=127.0.0.1:0 ${ATTNSERVE_ARGS:-}
http=$(grep -o -m1 "http on [0-9.]*:[0-9]*" "$bench_tmp/attnserve.log" | awk '{print $3}')
echo "== attnserve gRPC $server, HTTP $http"
"$python" "$(dirname "$0")/http_vs_grpc.py" --grpc "$server" --http "$http" \
  --requests "${REQUESTS:-200}" --rounds "${ROUNDS:-3}"
