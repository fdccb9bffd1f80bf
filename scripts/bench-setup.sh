#!/usr/bin/env bash
# The benchmarks' optional peers, which CI does not install (scripts/setup.sh installs `.[test,bench]`):
#   - llama-cpp-python, compiled from source for this CPU (no wheel is published for it; several minutes
#     on 2 cores): bench/e2e.py's and bench/executor.py's llama-cpp-f32 / llama-cpp-f16 engines
#   - matplotlib (bench/e2e.py --plot) and psutil (the benchmarks' RSS / CPU sampling)
# Idempotent: does nothing when they import. Without them the benchmarks skip those peers with a note.
# Usage: scripts/bench-setup.sh     (CMAKE_ARGS / CMAKE_BUILD_PARALLEL_LEVEL override the build settings)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || scripts/setup.sh
if .venv/bin/python -c 'import llama_cpp, matplotlib, psutil' 2>/dev/null; then
  echo "[bench-setup] ready: llama-cpp-python $(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
  exit 0
fi
echo "[bench-setup] building llama-cpp-python for this CPU (several minutes) and installing matplotlib, psutil"
# On a CPU with AMX, llama-cpp-python 0.3.36 built with GGML_NATIVE crashed at its first batch (a general
# protection fault in libggml-cpu, 2026-11-27, an Intel Xeon with amx_tile under KVM); built for AVX-512
# (VNNI, BF16, VBMI) without the native flags it runs. So there: those flags, not native.
build=-DGGML_NATIVE=ON
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  build="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON"
  build+=" -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
fi
export CMAKE_ARGS="${CMAKE_ARGS:-$build -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/pip install -q -c constraints.txt -e '.[peers]'
echo "[bench-setup] ready: llama-cpp-python $(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
