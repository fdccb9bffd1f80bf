#!/usr/bin/env bash
# Build the l4m services image (CPU). Needs a running Docker engine; on a machine without one, or where no
# image can be pulled, scripts/ci/docker-engine.sh and scripts/ci/base-image.sh provide both.
#   scripts/docker-build.sh [TAG]     (default tag: l4m:latest)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tag=${1:-l4m:latest}
docker image inspect python:3.11-slim >/dev/null 2>&1 || docker pull python:3.11-slim >/dev/null 2>&1 \
  || scripts/ci/base-image.sh python:3.11-slim
mkdir -p docker/wheels
# The CPU torch wheel: taken from pip's local find-links when the machine has it, else downloaded from PyPI
# as a CPU build is not on PyPI for Linux, so the image would get the CUDA build: say so.
if ! ls docker/wheels/torch-2.13.0* >/dev/null 2>&1; then
  .venv/bin/pip download -q --no-deps -d docker/wheels "torch==2.13.0" \
    || { echo "could not fetch torch==2.13.0 into docker/wheels" >&2; exit 1; }
fi
docker build --network host -f docker/Dockerfile -t "$tag" .
