"""GGUF block-quantized weights kept quantized on the CPU, multiplied by a fused dequantize-GEMM kernel.

Decode on a CPU is bound by the bytes of weights read per step: SmolLM2's linear layers and head are
~533 MB as float32 but ~90 MB as the GGUF blocks they ship in (Q4_1: 32 weights = fp16 d, fp16 m,
16 bytes of nibbles, w = d * q + m; Q8_0: 32 weights = fp16 d, 32 int8, w = d * q). The kernel below
dequantizes one block at a time into AVX2 registers, exactly to the float32 values that the dense path
holds, and accumulates in float32, so results agree with the dense float32 path to rounding (~1e-6).
PyTorch's own `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` are 4-8x SLOWER than a dense
float32 matmul on AVX2-only CPUs (no AVX-512 kernels), hence this kernel.

The kernel is compiled on first use with `torch.utils.cpp_extension.load_inline` (g++ and ninja
needed, ~40 s once, then cached under ~/.cache/torch_extensions) and registered as
`torch.ops.l4m_quant.{q4_1_linear, q8_0_linear}`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BLOCK_SIZE = 32
QUANT_KINDS = ("q4_1", "q8_0")


@dataclass(frozen=True)
class QuantizedTensor:
    """A `[rows, cols]` weight in GGUF blocks of 32 along `cols`, rows in HF order.

    `qs`: Q4_1 `[rows, cols / 2]` uint8 (per block 16 bytes: element j in the low nibble of byte j,
    element j + 16 in its high nibble), Q8_0 `[rows, cols]` int8. `d`, `m`: `[rows, cols / 32]` float32
    (`m` is None for Q8_0).
    """

    kind: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK_SIZE

    def rows(self, index: np.ndarray) -> QuantizedTensor:
        """The same weight with its rows reordered (`index[i]` = source row of row i)."""
        idx = torch.from_numpy(np.ascontiguousarray(index))
        return QuantizedTensor(
            self.kind,
            self.qs[idx].contiguous(),
            self.d[idx].contiguous(),
            None if self.m is None else self.m[idx].contiguous(),
        )


def from_gguf_blocks(kind: str, raw: np.ndarray, num_rows: int) -> QuantizedTensor:
    """Split a GGUF tensor's raw bytes (`[rows, row_bytes]` uint8) into qs / d / m."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(num_rows, -1, 20 if kind == "q4_1" else 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:].reshape(num_rows, -1)
        return QuantizedTensor(kind, torch.from_numpy(qs.copy()), torch.from_numpy(d), torch.from_numpy(m))
    qs = blocks[..., 2:].copy().view(np.int8).reshape(num_rows, -1)
    return QuantizedTensor(kind, torch.from_numpy(qs), torch.from_numpy(d), None)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Stack weights of one kind along rows (fused qkv, gate_up)."""
    kind = parts[0].kind
    if any(p.kind != kind for p in parts):
        raise ValueError("cannot fuse weights of different quantization kinds")
    m = None if kind == "q8_0" else torch.cat([p.m for p in parts])  # type: ignore[misc]
    return QuantizedTensor(kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)


_KERNEL_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 q4_to_float(__m128i nibbles, __m256 d, __m256 m) {  // 8 low bytes -> d * q + m
  return _mm256_add_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles))), m);
}

// One Q4_1 block as 4 x 8 floats, exactly d * q + m as gguf's dequantize computes it.
inline void dequant_q4_1(const uint8_t* q, float d, float m, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  w[0] = q4_to_float(lo, vd, vm);
  w[1] = q4_to_float(_mm_srli_si128(lo, 8), vd, vm);
  w[2] = q4_to_float(hi, vd, vm);
  w[3] = q4_to_float(_mm_srli_si128(hi, 8), vd, vm);
}

// One Q8_0 block as 4 x 8 floats: d * q.
inline void dequant_q8_0(const int8_t* q, float d, __m256 w[4]) {
  const __m256 vd = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i));
    w[i] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
}

constexpr int64_t kRows = 2;  // weight rows dequantized together: each x load feeds both

// out[M, N] = x[M, K] @ W.T, W dequantized block by block by `dequant(row, block, w)`.
template <typename Dequant>
at::Tensor blocked_linear(const at::Tensor& x_in, int64_t n_out, Dequant dequant) {
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  at::Tensor out = at::empty({M, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n_out + kRows - 1) / kRows, 8, [&](int64_t r0, int64_t r1) {
    std::vector<__m256> acc(M * kRows);
    __m256 w[kRows][4];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n0 = r * kRows, rows = std::min(kRows, n_out - n0);
      std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t j = 0; j < kRows; ++j) dequant(j < rows ? n0 + j : n0, g, w[j]);
        for (int64_t i = 0; i < M; ++i) {
          const float* xs = xp + i * K + g * 32;
          const __m256 x0 = _mm256_loadu_ps(xs), x1 = _mm256_loadu_ps(xs + 8);
          const __m256 x2 = _mm256_loadu_ps(xs + 16), x3 = _mm256_loadu_ps(xs + 24);
          for (int64_t j = 0; j < kRows; ++j) {
            __m256 a = acc[i * kRows + j];
            a = _mm256_fmadd_ps(w[j][0], x0, a);
            a = _mm256_fmadd_ps(w[j][1], x1, a);
            a = _mm256_fmadd_ps(w[j][2], x2, a);
            a = _mm256_fmadd_ps(w[j][3], x3, a);
            acc[i * kRows + j] = a;
          }
        }
      }
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < rows; ++j) op[i * n_out + n0 + j] = hsum(acc[i * kRows + j]);
    }
  });
  return out;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t K = x.size(1), G = K / 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && K % 32 == 0 && qs.size(1) * 2 == K);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && m.is_contiguous() && d.size(1) == G);
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  return blocked_linear(x, qs.size(0), [&](int64_t n, int64_t g, __m256* w) {
    dequant_q4_1(qp + n * (K / 2) + g * 16, dp[n * G + g], mp[n * G + g], w);
  });
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  const int64_t K = x.size(1), G = K / 32;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && K % 32 == 0 && qs.size(1) == K);
  TORCH_CHECK(qs.is_contiguous() && d.is_contiguous() && d.size(1) == G);
  const int8_t* qp = qs.data_ptr<int8_t>();
  const float* dp = d.data_ptr<float>();
  return blocked_linear(x, qs.size(0), [&](int64_t n, int64_t g, __m256* w) {
    dequant_q8_0(qp + n * K + g * 32, dp[n * G + g], w);
  });
}

}  // namespace

TORCH_LIBRARY(l4m_quant, lib) {
  lib.def("q4_1_linear(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor", &q4_1_linear);
  lib.def("q8_0_linear(Tensor x, Tensor qs, Tensor d) -> Tensor", &q8_0_linear);
}
"""


def cpu_supports_kernels() -> bool:
    """The kernel needs AVX2 + FMA (x86-64 Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@functools.cache
def load_kernels() -> None:
    """Compile (once per source version; cached on disk) and register `torch.ops.l4m_quant`."""
    from torch.utils.cpp_extension import load_inline

    if not cpu_supports_kernels():
        raise RuntimeError("the quantized-weight kernel needs an x86-64 CPU with AVX2 and FMA")
    # torch runs `ninja` from PATH; the pip-installed one sits next to this interpreter.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    load_inline(
        "l4m_quant",
        cpp_sources=[_KERNEL_SOURCE],
        is_python_module=False,
        extra_cflags=["-O3", "-mavx2", "-mfma"],
    )


def kernels_available() -> bool:
    try:
        load_kernels()
    except Exception as exc:  # a missing compiler or CPU feature: callers fall back to dense weights
        log.warning("quantized-weight kernel unavailable, using dense float32 weights: %s", exc)
        return False
    return True


class Linear:
    """`y = x @ W.T` for `x` `[M, in]`, with W dense, quantized, or both.

    With both, calls of up to `max_quantized_rows` rows use the quantized kernel (memory-bound decode,
    where reading 4.5 bits per weight instead of 32 wins) and bigger ones the dense BLAS GEMM
    (compute-bound prefill).
    """

    def __init__(
        self, dense: torch.Tensor | None, quantized: QuantizedTensor | None, max_quantized_rows: int
    ) -> None:
        if dense is None and quantized is None:
            raise ValueError("a Linear needs dense or quantized weights")
        self.dense = dense
        self.quantized = quantized
        self.max_quantized_rows = max_quantized_rows if dense is not None else 1 << 62

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is None or x.shape[0] > self.max_quantized_rows:
            return F.linear(x, self.dense)
        if q.kind == "q4_1":
            return torch.ops.l4m_quant.q4_1_linear(x, q.qs, q.d, q.m)
        return torch.ops.l4m_quant.q8_0_linear(x, q.qs, q.d)
