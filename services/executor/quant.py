"""GGUF block-quantized weights kept quantized on the CPU, multiplied by a fused dequantize-GEMM kernel.

Decode on a CPU is bound by the bytes of weights read per step: SmolLM2's linear layers and head are
~533 MB as float32 but ~90 MB as the GGUF blocks they ship in (Q4_1: 32 weights = fp16 d, fp16 m,
16 bytes of nibbles, w = d * q + m; Q8_0: 32 weights = fp16 d, 32 int8, w = d * q). The kernel
(`torch.ops.l4m_cpu.linear`, in `cpu_kernels.cpp`, built by `cpu_kernels.py`) dequantizes one block at
a time into AVX2 registers or a small buffer, to the float32 values that the dense path holds (up to
one rounding), and accumulates in float32, so results agree with the dense float32 path to rounding
(~1e-6).
PyTorch's own `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` are 4-8x SLOWER than a dense
float32 matmul on AVX2-only CPUs (no AVX-512 kernels), hence this kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from l4m.executor.cpu_kernels import kernels_available, load_kernels
from l4m.executor.host_memory import anonymous_bytes

__all__ = [
    "QuantizedTensor", "Linear", "cat_rows", "from_gguf_blocks", "into_huge_pages", "kernels_available", "load_kernels",
]

BLOCK_SIZE = 32
QUANT_KINDS = ("q4_1", "q8_0")


@dataclass(frozen=True)
class QuantizedTensor:
    """A `[rows, cols]` weight in GGUF blocks of 32 along `cols`, rows in HF order.

    `qs`: Q4_1 `[rows, cols / 2]` uint8 (per block 16 bytes: element j in the low nibble of byte j,
    element j + 16 in its high nibble), Q8_0 `[rows, cols]` int8. `d`, `m`: `[rows, cols / 32]` float16,
    as the GGUF stores them (`m` is None for Q8_0): a decode step streams them with the blocks.
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
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "q4_1":
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
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


class Linear:
    """`y = x @ W.T (+ bias)` for `x` `[M, in]`, with W dense, quantized, or both.

    With both, calls of up to `max_quantized_rows` rows use the quantized kernel (memory-bound decode,
    where reading 4.5 bits per weight instead of 32 wins) and bigger ones the dense BLAS GEMM
    (compute-bound prefill). With blocks alone, every call multiplies with them.
    """

    def __init__(
        self,
        dense: torch.Tensor | None,
        quantized: QuantizedTensor | None,
        max_quantized_rows: int,
        bias: torch.Tensor | None = None,
        bf16_x: bool = False,
    ) -> None:
        if dense is None and quantized is None:
            raise ValueError("a Linear needs dense or quantized weights")
        self.dense = dense
        self.quantized = quantized
        self.bias = bias  # [out], of the dense weight's dtype
        self.max_quantized_rows = max_quantized_rows if dense is not None else 1 << 62
        self.bf16_x = bf16_x  # the blocks' products take x rounded to bf16 (EngineConfig.quantized_activations)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized
        if q is None or x.shape[0] > self.max_quantized_rows:
            return F.linear(x, self.dense, self.bias)
        y = torch.ops.l4m_cpu.linear(x, q.qs, q.d, q.m, self.bf16_x)
        return y if self.bias is None else y + self.bias


HUGE_PAGE = 2 << 20


def into_huge_pages(weights: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """The same weights, copied into one anonymous mapping advised for transparent huge pages.

    A decode step streams every layer's blocks from memory, a few hundred kB per linear; on 4 kB pages
    that is a TLB miss every 4 kB, on 2 MB pages one per 2 MB (measured 4 % faster at batch 1 on a
    2-core AMD EPYC). Each weight alone is under the 2 MB that torch's allocator would put on huge pages
    (THP_MEM_ALLOC_ENABLE), hence one mapping for all. Where the kernel offers no huge pages (THP
    `never`, or no `madvise`), the mapping is ordinary memory and only the copy is paid.
    """
    parts = [t for w in weights for t in (w.qs, w.d, w.m) if t is not None]
    offsets, total = [], 0
    for t in parts:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 64) * 64  # each part 64-byte aligned
    if total == 0:
        return list(weights)
    base = anonymous_bytes(total + HUGE_PAGE, huge_pages=True)
    start = -base.data_ptr() % HUGE_PAGE  # the first part on a huge-page boundary
    copies = iter(
        base[start + offset : start + offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
        for t, offset in zip(parts, offsets, strict=True)
    )
    return [replace(w, qs=next(copies), d=next(copies), m=None if w.m is None else next(copies)) for w in weights]

