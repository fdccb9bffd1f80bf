#!/usr/bin/env bash
# Regenerates every generated stub from protos/ (one command, run from anywhere).
#   scripts/gen-protos.sh          write the Python stubs into clients/python/l4m/v1/
#   scripts/gen-protos.sh --check  regenerate into a scratch folder; fail if the committed stubs differ
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-"$root/.venv/bin/python"}
[ -x "$python" ] || python=python3

generate_python() {  # $1: output root (the folder that holds the l4m package)
  mkdir -p "$1/l4m/v1"
  "$python" -m grpc_tools.protoc -I "$root/protos" \
    --python_out="$1" --grpc_python_out="$1" --pyi_out="$1" \
    "$root"/protos/l4m/v1/*.proto
}

if [ "${1:-}" = "--check" ]; then
  scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
  generate_python "$scratch"
  if ! diff -r -x __init__.py -x __pycache__ "$scratch/l4m/v1" "$root/clients/python/l4m/v1" >/dev/null; then
    diff -r -x __init__.py -x __pycache__ "$scratch/l4m/v1" "$root/clients/python/l4m/v1" | head -40 || true
    echo "generated stubs are stale: run scripts/gen-protos.sh and commit the result" >&2
    exit 1
  fi
  echo "generated stubs are current"
else
  rm -f "$root"/clients/python/l4m/v1/*_pb2*.py "$root"/clients/python/l4m/v1/*_pb2*.pyi
  generate_python "$root/clients/python"
  echo "wrote $(ls "$root"/clients/python/l4m/v1/*_pb2*.py | wc -l) stub modules to clients/python/l4m/v1/"
fi
