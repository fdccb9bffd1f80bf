#!/usr/bin/env bash
# Build the l4m images from docker/Dockerfile: the services image (scheduler, executor, spawner) and the
# controller image the spawner's docker sandbox runs programs in (same layers, run as nobody).
#   scripts/docker-build.sh [TAG]      default tag l4m:latest; the controller image is TAG's repository
#                                      with the tag `controller` (l4m:controller)
#   L4M_TORCH_SPEC=torch==2.13.0 scripts/docker-build.sh     CUDA torch from PyPI instead of the CPU wheel
#   L4M_FORCE_BUILD=1 ...                                    build even when the images are current
# Both images carry a label with a hash of every build input; when it matches, nothing is built.
# Needs a running Docker engine; on a machine without one, or where no image can be pulled,
# scripts/ci/docker-engine.sh and scripts/ci/base-image.sh provide both.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
tag=${1:-l4m:latest}
controller_tag=${tag%:*}:controller
torch_spec=${L4M_TORCH_SPEC:-torch==2.13.0+cpu}
base=python:3.11-slim
docker image inspect "$base" >/dev/null 2>&1 || docker pull "$base" >/dev/null 2>&1 \
  || scripts/ci/base-image.sh "$base"
mkdir -p docker/wheels
# The CPU torch wheel: taken from pip's local find-links when the machine has it, else downloaded from PyPI.
if [[ $torch_spec == *+cpu ]] && ! ls docker/wheels/torch-2.13.0+cpu* >/dev/null 2>&1; then
  .venv/bin/pip download -q --no-deps -d docker/wheels "$torch_spec" \
    || { echo "could not fetch $torch_spec into docker/wheels" >&2; exit 1; }
fi

# Every input of the build: the Dockerfile, what it copies, the wheels' names, the torch spec, the base image.
inputs_sha=$(
  {
    find docker/Dockerfile pyproject.toml constraints.txt README.md clients/python services -type f \
      ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
    ls docker/wheels
    echo "$torch_spec"
    docker image inspect -f '{{.Id}}' "$base"
  } | sha256sum | cut -c1-64
)
label() { docker image inspect -f '{{index .Config.Labels "org.l4m.inputs-sha256"}}' "$1" 2>/dev/null || true; }
if [[ -z ${L4M_FORCE_BUILD:-} && $(label "$tag") == "$inputs_sha" && $(label "$controller_tag") == "$inputs_sha" ]]; then
  echo "$tag and $controller_tag are current (inputs $inputs_sha); nothing to build"
  exit 0
fi
build() {
  docker build --network host -f docker/Dockerfile --build-arg "TORCH_SPEC=$torch_spec" \
    --build-arg "L4M_INPUTS_SHA256=$inputs_sha" "$@" .
}
# The controller stage comes first in the Dockerfile, so the second build is all cache.
build --target controller -t "$controller_tag"
build --target services -t "$tag"
# The images this replaced are left untagged: remove those (never one a container still uses).
docker image prune -f --filter "label=org.l4m.inputs-sha256" >/dev/null || true
echo "built $tag and $controller_tag (inputs $inputs_sha)"
