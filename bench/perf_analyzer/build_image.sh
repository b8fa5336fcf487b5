#!/usr/bin/env bash
# Builds the perf_analyzer image (this folder's Dockerfile) on the engine the
# docker CLI talks to (DOCKER_HOST): debian:trixie from debootstrap when it is
# absent (no registry needed), the perf_analyzer binary taken out of its PyPI
# wheel on the host (pip does not work inside containers here), then docker
# build. Does nothing when IMAGE exists. Used by bench/perf_analyzer.sh and
# tests/integration/test_perf_analyzer.py.
#
#   bench/perf_analyzer/build_image.sh IMAGE PA_VERSION
set -euo pipefail
image=${1:?usage: build_image.sh IMAGE PA_VERSION}
version=${2:?usage: build_image.sh IMAGE PA_VERSION}
here=$(cd "$(dirname "$0")" && pwd)
export DOCKER_BUILDKIT=0  # Debian's docker.io has no buildx
docker image inspect "$image" > /dev/null 2>&1 && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! docker image inspect debian:trixie > /dev/null 2>&1; then
  echo "build_image.sh: making debian:trixie with debootstrap (once)" >&2
  if ! debootstrap --variant=minbase trixie "$tmp/trixie" http://deb.debian.org/debian \
      > "$tmp/debootstrap.log" 2>&1; then
    tail -20 "$tmp/debootstrap.log" >&2
    exit 1
  fi
  rm -rf "$tmp"/trixie/var/cache/apt/archives/*.deb "$tmp"/trixie/var/lib/apt/lists/*
  tar -C "$tmp/trixie" -c . | docker import - debian:trixie > /dev/null
  rm -rf "$tmp/trixie"
fi
echo "build_image.sh: building $image (perf_analyzer $version from its PyPI wheel)" >&2
# Its wheel (manylinux_2_38) needs glibc >= 2.38: downloaded for that
# platform, never installed here.
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip download -q --no-deps -d "$tmp/ctx" \
  --platform manylinux_2_38_x86_64 --only-binary=:all: "perf-analyzer==$version"
python3 - "$tmp/ctx" <<'PY'
import glob, os, sys, zipfile
ctx = sys.argv[1]
wheel = glob.glob(os.path.join(ctx, "perf_analyzer-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, open(os.path.join(ctx, "perf_analyzer"), "wb") as f:
    f.write(z.read("perf_analyzer/bin/perf_analyzer"))
os.chmod(os.path.join(ctx, "perf_analyzer"), 0o755)
os.remove(wheel)
PY
cp "$here/Dockerfile" "$tmp/ctx/"
docker build -q -t "$image" "$tmp/ctx" > /dev/null
