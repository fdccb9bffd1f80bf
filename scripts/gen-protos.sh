#!/usr/bin/env bash
# Regenerates every generated stub from protos/ (one command, run from anywhere):
#   python      clients/python/l4m/v1/      grpc_tools.protoc (from .venv)
#   typescript  clients/typescript/src/gen/ protoc + ts-proto (clients/typescript/node_modules)
#   go          clients/go/src/l4m/v1/      protoc + protoc-gen-go + protoc-gen-go-grpc (Debian packages)
#
#   scripts/gen-protos.sh          write every language's stubs
#   scripts/gen-protos.sh --check  regenerate into a scratch folder; fail if any committed stub differs
#
# A language whose generator is missing fails both modes (scripts/setup.sh installs them all), unless
# it is skipped on purpose: L4M_GEN_SKIP=typescript,go scripts/gen-protos.sh --check
#
# TypeScript and Go get the user-facing protos only (common, l4m, spawner); the executor and registry
# services are internal hops between l4m's own Python services.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-"$root/.venv/bin/python"}
[ -x "$python" ] || python=python3
client_protos=("$root"/protos/l4m/v1/{common,l4m,spawner}.proto)
ts_plugin="$root/clients/typescript/node_modules/.bin/protoc-gen-ts_proto"
ts_options=outputServices=grpc-js,env=node,esModuleInterop=true,importSuffix=.js,oneof=unions-value
go_package=l4m/v1  # GOPATH import path (clients/go/src/l4m/v1); the protos carry no go_package option

# Each language: the folder its stubs live in, a generator, and what its generator needs.
stub_dir() {
  case $1 in
    python) echo clients/python/l4m/v1 ;;
    typescript) echo clients/typescript/src/gen/l4m/v1 ;;
    go) echo clients/go/src/l4m/v1 ;;
  esac
}

missing_tools() {  # prints what language $1 lacks, nothing when it can generate
  case $1 in
    python) "$python" -c 'import grpc_tools' 2>/dev/null || echo "grpc_tools in $python" ;;
    typescript)
      command -v protoc >/dev/null || echo "protoc (Debian protobuf-compiler)"
      [ -x "$ts_plugin" ] || echo "ts-proto (npm ci in clients/typescript)" ;;
    go)
      command -v protoc >/dev/null || echo "protoc (Debian protobuf-compiler)"
      command -v protoc-gen-go >/dev/null || echo "protoc-gen-go (Debian protoc-gen-go)"
      command -v protoc-gen-go-grpc >/dev/null || echo "protoc-gen-go-grpc (Debian protoc-gen-go-grpc)" ;;
  esac
}

generate() {  # $1: language, $2: output root (the stubs land in $2/$(stub_dir $1))
  local out=$2/$(dirname "$(dirname "$(stub_dir "$1")")")
  mkdir -p "$2/$(stub_dir "$1")"
  case $1 in
    python)
      "$python" -m grpc_tools.protoc -I "$root/protos" \
        --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" "$root"/protos/l4m/v1/*.proto ;;
    typescript)
      protoc -I "$root/protos" --plugin=protoc-gen-ts_proto="$ts_plugin" \
        --ts_proto_out="$out" --ts_proto_opt="$ts_options" "${client_protos[@]}" ;;
    go)
      local mappings=""
      for proto in "${client_protos[@]}"; do mappings+=",Ml4m/v1/$(basename "$proto")=$go_package;l4mv1"; done
      protoc -I "$root/protos" \
        --go_out="$out" --go_opt="paths=source_relative$mappings" \
        --go-grpc_out="$out" --go-grpc_opt="paths=source_relative$mappings" "${client_protos[@]}" ;;
  esac
}

languages=()
for language in python typescript go; do
  if [[ ",${L4M_GEN_SKIP:-}," == *",$language,"* ]]; then
    echo "[gen-protos] $language: skipped (L4M_GEN_SKIP)"
    continue
  fi
  missing=$(missing_tools "$language")
  if [ -n "$missing" ]; then
    echo "[gen-protos] $language: cannot generate, missing: $(echo "$missing" | paste -sd, | sed 's/,/, /g')" >&2
    echo "[gen-protos] run scripts/setup.sh, or skip it on purpose with L4M_GEN_SKIP=$language" >&2
    exit 1
  fi
  languages+=("$language")
done

if [ "${1:-}" = "--check" ]; then
  scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
  stale=0
  for language in "${languages[@]}"; do
    generate "$language" "$scratch"
    dir=$(stub_dir "$language")
    if ! diff -r -x __init__.py -x __pycache__ "$scratch/$dir" "$root/$dir" >"$scratch/$language.diff"; then
      head -40 "$scratch/$language.diff"
      echo "[gen-protos] $language: the stubs in $dir are stale" >&2
      stale=1
    fi
  done
  if [ "$stale" = 1 ]; then
    echo "generated stubs are stale: run scripts/gen-protos.sh and commit the result" >&2
    exit 1
  fi
  echo "generated stubs are current (${languages[*]})"
else
  for language in "${languages[@]}"; do
    dir=$(stub_dir "$language")
    find "$root/$dir" -maxdepth 1 -type f ! -name __init__.py -delete 2>/dev/null || true
    generate "$language" "$root"
    echo "wrote $(find "$root/$dir" -maxdepth 1 -type f ! -name __init__.py | wc -l) $language stub files to $dir/"
  done
fi
