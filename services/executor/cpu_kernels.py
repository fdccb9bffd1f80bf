"""AVX2 kernels (AVX-512 where the CPU has it) for float32 decode on the CPU, on the GGUF's Q4_1 / Q8_0
blocks (see `quant.py`).

Five kernels, registered as `torch.ops.l4m_cpu.*` (beside `isa` / `set_isa`, below):

- `linear(x [M, K], qs, d, m?) -> [M, N]`: `x @ W.T` with W in GGUF blocks. Up to 4 rows of x (AVX2;
  AVX-512: 8), each block is converted in registers and used at once (for 1-2 rows, and every few-row
  AVX-512 tile, scaled per block: d * sum(x q) + m * sum(x)); for more rows, 24 weight rows at a time are dequantized once into an L1/L2 buffer and
  reused by every row of x: at 5-15 rows (but 8) by a 4x3 dot-product microkernel, at 8 and >= 16 rows
  by 2x6 / 1x12 tiles of 8-row panels of x transposed (outputs in registers, weights broadcast, no
  horizontal sums). All agree with the dense float32 weights' matmul to float32 rounding (the order of
  the sums differs).
- `decode_layers(...)`: every transformer layer for a batch where each item feeds ONE token, in one
  call: RMSNorm, fused QKV, RoPE, K/V written into the pages, attention reading K/V straight from the
  page tensor (no gather, no padding; per-item slot visibility = BRLE mask AND page visibility),
  o-proj + residual, RMSNorm, gate_up, SiLU * up, down + residual. It removes the ~25 small torch ops
  per layer (Python and dispatch overhead) and the padded attention of the general path.
- `decode_attention(q [B, H * D], kv, page_table, ctx_len, visible, num_heads) -> [B, H * D]`: that
  attention alone, for the single-token items of a mixed batch (`attention.py`), one layer at a time.
- `mixed_layers(...)`: `decode_layers` for a batch of single-token items beside one padded group of
  equal-length items (a prefill chunk): every linear once over all rows, the decode steps' attention as
  in `decode_layers`, the group's as `attention.py`'s padded path (SDPA over its gathered K/V, with its
  additive mask) but reading K/V straight from the pages, in one call.
- `group_attention(q [Bc * Tq, H * D], kv, group_kv_index, group_mask, num_heads) -> [Bc * Tq, H * D]`:
  that group attention alone (tests, `bench/group_attention.py`). A task is (item, KV head, up to 64
  query rows: tokens x the heads sharing the KV head, so each K/V row loaded serves all of them, a span
  of slots); per 128 slots, K^T packed, scores as a register-tiled GEMM, the mask, an online softmax,
  P x V; the spans of a row block merged flash-decoding style by the last to finish. Slots are split as
  well as rows so that 2 threads balance a single chunk (3 KV heads). A row whose mask hides every slot
  gets 0. In `mixed_layers` its tasks share one parallel region with the decode rows' attention.

`linear`, `decode_layers` and `mixed_layers` take `bf16_x` (default False): x rounded to bf16 before the
products with the blocks, the operator's opt-in (`EngineConfig.quantized_activations = "bfloat16"`, the
executor's `--quantized-activations`), AVX-512 BF16 only (refused under avx2). Then every row count is
bf16(x) times the blocks' exact values, summed in float32 per block of 32 and scaled by d (plus m times the
block's sum of bf16(x)), as llama.cpp rounds x for its own 4-bit dot products: up to 8 rows as the
AVX-512 few-row tiles below over bf16(x), more rows as 16-row panels of bf16 pairs (one `vdpbf16ps` adds 2
products to each of 16 rows: 32 multiply-adds an instruction where the float32 panels do 16), or AMX's tiles.

The KV cache the attention reads (`decode_layers`, `decode_attention`, `mixed_layers`, `group_attention`) is
float32, or float16 (the operator's opt-in, `EngineConfig.kv_cache_dtype = "float16"`, the executor's
`--kv-cache-dtype`): then each K/V row is read with F16C conversions into the same float32 arithmetic, so the
result is the float32 kernel's over the widened values, and the layer stacks store new K/V rounded to nearest,
clamped to +-65504 (NaN kept), as the torch path writes them.

`linear` (and so the layer stacks) picks its instruction set at run time. On a CPU with AVX-512 (F, BW, VL,
DQ: `avx512`; with BF16 too, `avx512_bf16` runs the same float32 code and adds `bf16_x`), up to 8 rows of x
run as few-row tiles of float32 FMAs 16 lanes wide (d * sum(x q) + m * sum(x) per block, a Q4_1 block's low
nibbles widened by one 16-entry `vpermps` table lookup; 1.7-2.1x the bf16 dot products of three terms of x
they replaced, and faster than the AVX2 tiles), and from 16 rows the 8-row panels become 16-row panels in
AVX-512 registers (float32 FMAs, the same sums in the same order as the 8-row ones, 1.3-1.9x); other row
counts, and every case on other CPUs, run the AVX2 + FMA code. On a CPU with AMX-BF16 (and the OS's leave to
use its tiles) `amx` runs the AVX-512 code up to 8 rows of x and, from 9 rows (padded to 16), 16 x 16 tiles
of bf16 products: one block of 16 weight rows' exact values against 16 rows of x as bf16 pairs (three terms
of x, x = x1 + x2 + x3 exactly, or one with `bf16_x`) per `tdpbf16ps`, each block's float32 sums scaled by d
(and m) as the other paths scale theirs. `L4M_CPU_ISA` (auto, avx2, avx512, avx512_bf16 or amx; read when
the kernels load, logged) forces a choice, say avx2 to compare the paths on one host; an instruction set the
CPU lacks, or any other value, is an error (not a fall back).
`torch.ops.l4m_cpu.isa()` / `set_isa(name)` read and change it in a process.

Parallel work is cut into many small chunks that the threads pull from a shared counter, so that a
thread descheduled by another process does not leave its static share of the step undone.

The C++ is `cpu_kernels.cpp`, beside this file (shipped as package data), a whole translation unit (it
includes torch/extension.h itself). It is compiled on first use with
`torch.utils.cpp_extension.load_inline` (g++ and ninja needed, ~40 s once, then cached under
~/.cache/torch_extensions): torch writes the file's text to the build folder's main.cpp only when it
differs, so an edited .cpp rebuilds and an unchanged one reuses the build. Callers fall back to the
torch path when it cannot build.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_PATH = Path(__file__).with_name("cpu_kernels.cpp")
ISA_ENV = "L4M_CPU_ISA"
ISAS = ("auto", "avx2", "avx512", "avx512_bf16", "amx")
# The instruction sets that run the AVX-512 float32 paths (each runs those of the sets before it).
AVX512_ISAS = ("avx512", "avx512_bf16", "amx")
# Those that run the AVX-512 BF16 paths (x rounded to bf16; amx runs them too, and its tiles from 9 rows).
AVX512_BF16_ISAS = ("avx512_bf16", "amx")


class IsaError(ValueError):
    """`L4M_CPU_ISA` names no instruction set, or one this CPU does not run: a setting to fix."""


def requested_isa() -> str:
    """`L4M_CPU_ISA`, checked: "auto" when unset."""
    isa = os.environ.get(ISA_ENV, "") or "auto"
    if isa not in ISAS:
        raise IsaError(f"{ISA_ENV} must be one of {', '.join(ISAS)}, got {isa!r}")
    return isa


def cpu_supports_kernels() -> bool:
    """The kernels need AVX2, FMA and F16C (the scales are float16; x86-64 Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx2", "fma", "f16c"))


@functools.cache
def load_kernels() -> None:
    """Compile (once per source version; cached on disk), register `torch.ops.l4m_cpu` and select its
    instruction set (`L4M_CPU_ISA`)."""
    from torch.utils.cpp_extension import load_inline

    isa = requested_isa()
    if not cpu_supports_kernels():
        raise RuntimeError("the CPU kernels need an x86-64 CPU with AVX2, FMA and F16C")
    # torch runs `ninja` from PATH; the pip-installed one sits next to this interpreter.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    load_inline(
        "l4m_cpu",
        cpp_sources=[SOURCE_PATH.read_text()],
        no_implicit_headers=True,  # the .cpp includes torch/extension.h itself
        is_python_module=False,
        # -fopenmp: at::parallel_for is inline OpenMP; without it the kernels would run on one thread.
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    select_isa(isa)


def select_isa(isa: str) -> None:
    """Select `isa` (one of ISAS) in the loaded kernels; IsaError where this CPU does not run it."""
    import torch

    try:
        chosen = torch.ops.l4m_cpu.set_isa(isa)
    except RuntimeError as exc:  # avx512_bf16 asked of a CPU without it: the op names the extensions
        raise IsaError(f"{ISA_ENV}={isa}: {exc}") from None
    log.info("CPU kernels use %s (%s=%s)", chosen, ISA_ENV, isa)


def kernels_available() -> bool:
    try:
        load_kernels()
    except IsaError:  # a setting to fix, not one to fall back from
        raise
    except Exception as exc:  # a missing compiler or CPU feature: callers fall back to the torch path
        log.warning("CPU kernels unavailable, using the torch path with dense float32 weights: %s", exc)
        return False
    return True
