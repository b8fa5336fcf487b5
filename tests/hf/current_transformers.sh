#!/usr/bin/env bash
# tests/hf/current_transformers.py in a venv of its own with PyTorch 2 and
# transformers 5 from PyPI (about 6 GB of wheels, cached under BUILD_DIR):
# every family of issue 24 with transformers' real classes, against the
# built server. Not part of the suite (the download); docs/MODELS.md has the
# last result.
#
#   tests/hf/current_transformers.sh [BUILD_DIR]      (default: build)
# Env: TORCH_VERSION (default 2.11.0), TRANSFORMERS_VERSION (default 5.24.0).
set -euo pipefail
build=${1:-build}
venv=$build/torch2-venv
wheels=$build/torch2-wheels
reqs=("torch==${TORCH_VERSION:-2.11.0}" "transformers==${TRANSFORMERS_VERSION:-5.24.0}" numpy safetensors)
if [[ ! -x $venv/bin/python ]]; then
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" download -q -d "$wheels" "${reqs[@]}"
  "$venv/bin/pip" install -q --no-index --find-links "$wheels" "${reqs[@]}"
fi
exec "$venv/bin/python" "$(dirname "$0")/current_transformers.py" --server "$build/server/attnserve"
