"""The four fused operations of a static decode step (`decode_graphs.py`), as Triton kernels for CUDA and
as plain torch for the CPU and for reference.

Each takes fixed-shape tensors and reads every per-step value (positions, page tables, lengths) from
device memory, so a CUDA graph that captured one launch replays it for any step of the same shape.

- `add_rms_norm(hidden, delta, weight, eps, out)`: `hidden += delta` (float32 residual stream, in
  place; `delta` None skips it), then `out = rms_norm(hidden) * weight` cast to `out`'s dtype.
- `rope_write_kv(qkv, positions, cos, sin, kv, write_page, write_offset, q_out)`: rotary embedding of
  q and k (rotate-half layout), q into `q_out` `[B, H, D]`, k and v into the layer's KV cache page.
- `decode_attention(q, kv, page_table, ctx_len, page_visible, row_visible, out)`: one query token per
  item attends over its first `ctx_len` slots through its page table; a slot counts when the page
  visibility AND the item's row mask allow it. An item that sees nothing gets zeros (as `attention.py`).
- `silu_mul(gate_up, out)`: `silu(gate) * up` of the fused `[B, 2F]` projection.

The Triton kernels (`decode_kernels.py`, imported on first use: Triton is optional) accumulate in
float32 whatever the storage dtype; the attention is an online softmax over `DECODE_BLOCK_SLOTS` slots
(whole pages) per iteration, in one of two variants (`DECODE_ATTENTION`), so `page_size` and the page
table's width must be powers of two. With `TRITON_INTERPRET=1` they run on CPU tensors, which is how
the tests check them without a GPU.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# ---- torch reference (CPU, and the tests' yardstick) ---------------------------------------------


class TorchOps:
    name = "torch"

    @staticmethod
    def add_rms_norm(hidden, delta, weight, eps, out) -> None:
        if delta is not None:
            hidden.add_(delta.float())
        out.copy_(F.rms_norm(hidden, (hidden.shape[-1],), weight, eps))

    @staticmethod
    def rope_write_kv(qkv, positions, cos, sin, kv, write_page, write_offset, q_out) -> None:
        batch, num_heads, head_dim = q_out.shape
        num_kv_heads = kv.shape[-2]
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.float().split([q_dim, kv_dim, kv_dim], dim=-1)
        c = cos[positions][:, None, :]
        s = sin[positions][:, None, :]

        def rope(x: torch.Tensor) -> torch.Tensor:
            half = head_dim // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * c + rotated * s

        q_out.copy_(rope(q.view(batch, num_heads, head_dim)))
        k = rope(k.view(batch, num_kv_heads, head_dim)).to(kv.dtype)
        kv[write_page, 0, write_offset] = k
        kv[write_page, 1, write_offset] = v.view(batch, num_kv_heads, head_dim).to(kv.dtype)

    @staticmethod
    def decode_attention(q, kv, page_table, ctx_len, page_visible, row_visible, out) -> None:
        batch, num_heads, head_dim = q.shape
        num_kv_heads, page_size = kv.shape[-2], kv.shape[2]
        width = page_table.shape[1] * page_size
        table = page_table.long()
        ctx = kv[table]  # [B, Pm, 2, S, KVH, D]
        k = ctx[:, :, 0].reshape(batch, width, num_kv_heads, head_dim).transpose(1, 2).float()
        v = ctx[:, :, 1].reshape(batch, width, num_kv_heads, head_dim).transpose(1, 2).float()
        visible = page_visible[table].reshape(batch, width) & row_visible.bool()
        visible &= torch.arange(width, device=q.device)[None, :] < ctx_len.long()[:, None]
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [B, H, T, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("bhd,bhtd->bht", q.float(), k) / math.sqrt(head_dim)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        any_visible = visible.any(-1)[:, None, None]
        probs = torch.softmax(scores.masked_fill(~any_visible, 0.0), dim=-1)
        result = torch.einsum("bht,bhtd->bhd", probs, v)
        out.copy_(torch.where(any_visible, result, torch.zeros_like(result)).reshape(out.shape))

    @staticmethod
    def silu_mul(gate_up, out) -> None:
        gate, up = gate_up.float().chunk(2, dim=-1)
        out.copy_(F.silu(gate) * up)


# ---- Triton ------------------------------------------------------------------------------------


def _kernels():
    from l4m.executor import decode_kernels as k

    return (k.add_rms_norm_kernel, k.rope_write_kv_kernel, k.decode_attention_kernel, k.silu_mul_kernel,
            k.decode_attention_split_kernel, k.decode_attention_combine_kernel)


# Slots the decode attention reads per iteration (whole pages): more loads in flight per program.
DECODE_BLOCK_SLOTS = 64
# "blocked": one program per (item, KV head) walks all its pages, reading each page once for the query
# heads that share it. "split" ("flash-decoding"): one program per (item, KV head, split of the pages),
# then a combine per (item, query head): more programs in flight where items are few. "auto" takes split
# where that gives more than one split, blocked otherwise, bucket by bucket. On an H200 (benchmarks.md)
# split's decode steps were 1.3-1.9x faster than blocked at 1 and 16 items with 100 prompt tokens,
# 2-7x with 1000, and level at 64 items.
DECODE_ATTENTION = "auto"
SPLIT_TARGET_PROGRAMS = 264  # about two per multiprocessor of an H100 / H200
# How the attention multiplies: "dot" (`tl.dot`, the query heads of a group padded to 16 rows; tensor
# cores for q·kᵀ in bf16/fp16) wherever a block has 16 slots or more and head_dim >= 16, "broadcast"
# (multiplies and sums on [heads, slots, head_dim]) otherwise or everywhere.
DECODE_SCORES = "dot"
DOT_MIN = 16  # tl.dot's smallest M, N and K


def _dot_shape(group: int, block_slots: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(the attention kernels' DOT: 0 broadcast, 1 tl.dot on float32, 2 q·kᵀ on the cache's dtype; the
    rows of a query group's block)."""
    if DECODE_SCORES != "dot" or block_slots < DOT_MIN or head_dim < DOT_MIN:
        return 0, _next_pow2(group)
    # Triton's interpreter (the CPU tests) computes bf16 dots wrongly: float32 operands there.
    return 2 if dtype != torch.float32 and not interpreting() else 1, max(DOT_MIN, _next_pow2(group))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_count(batch: int, num_kv_heads: int, num_pages: int) -> int:
    """The split attention's splits per (item, KV head): enough for about SPLIT_TARGET_PROGRAMS
    programs, a power of two, at most one per page."""
    return min(num_pages, _next_pow2(-(-SPLIT_TARGET_PROGRAMS // (batch * num_kv_heads))))


class TritonOps:
    name = "triton"

    @staticmethod
    def add_rms_norm(hidden, delta, weight, eps, out) -> None:
        kernel = _kernels()[0]
        rows, cols = hidden.shape
        kernel[(rows,)](
            hidden, hidden if delta is None else delta, weight, out, eps,
            C=cols, BLOCK=_next_pow2(cols), HAS_DELTA=delta is not None,
        )

    @staticmethod
    def rope_write_kv(qkv, positions, cos, sin, kv, write_page, write_offset, q_out) -> None:
        kernel = _kernels()[1]
        batch, num_heads, head_dim = q_out.shape
        num_kv_heads, page_size = kv.shape[-2], kv.shape[2]
        kernel[(batch, num_heads + num_kv_heads)](
            qkv, positions, cos, sin, kv, write_page, write_offset, q_out,
            H=num_heads, KVH=num_kv_heads, D=head_dim, S=page_size,
        )

    @staticmethod
    def decode_attention(q, kv, page_table, ctx_len, page_visible, row_visible, out) -> None:
        if DECODE_ATTENTION == "split" or (
            DECODE_ATTENTION == "auto" and split_count(q.shape[0], kv.shape[-2], page_table.shape[1]) > 1
        ):
            TritonOps.decode_attention_split(q, kv, page_table, ctx_len, page_visible, row_visible, out)
        else:
            TritonOps.decode_attention_blocked(q, kv, page_table, ctx_len, page_visible, row_visible, out)

    @staticmethod
    def decode_attention_blocked(q, kv, page_table, ctx_len, page_visible, row_visible, out) -> None:
        kernel = _kernels()[2]
        batch, num_heads, head_dim = q.shape
        num_kv_heads, page_size = kv.shape[-2], kv.shape[2]
        group = num_heads // num_kv_heads
        num_pages = page_table.shape[1]  # a power of two (a page bucket), as is page_size
        block_pages = max(1, min(num_pages, DECODE_BLOCK_SLOTS // page_size))
        dot, block_g = _dot_shape(group, block_pages * page_size, head_dim, kv.dtype)
        kernel[(batch, num_kv_heads)](
            q, kv, page_table, ctx_len, page_visible, row_visible, out, 1.0 / math.sqrt(head_dim),
            NUM_PAGES=num_pages, BLOCK_PAGES=block_pages,
            H=num_heads, KVH=num_kv_heads, D=head_dim, S=page_size, G=group, BLOCK_G=block_g, DOT=dot,
        )

    @staticmethod
    def decode_attention_split(q, kv, page_table, ctx_len, page_visible, row_visible, out) -> None:
        split_kernel, combine_kernel = _kernels()[4:6]
        batch, num_heads, head_dim = q.shape
        num_kv_heads, page_size = kv.shape[-2], kv.shape[2]
        num_pages = page_table.shape[1]
        group = num_heads // num_kv_heads
        splits = split_count(batch, num_kv_heads, num_pages)
        block_pages = max(1, min(num_pages // splits, DECODE_BLOCK_SLOTS // page_size))
        dot, block_g = _dot_shape(group, block_pages * page_size, head_dim, kv.dtype)
        part_m = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        split_kernel[(batch, num_kv_heads, splits)](
            q, kv, page_table, ctx_len, page_visible, row_visible, part_m, part_l, part_acc,
            1.0 / math.sqrt(head_dim), NUM_PAGES=num_pages, H=num_heads, KVH=num_kv_heads, D=head_dim,
            S=page_size, G=group, BLOCK_G=block_g, BLOCK_PAGES=block_pages, SPLITS=splits, DOT=dot,
        )
        combine_kernel[(batch, num_heads)](part_m, part_l, part_acc, out, H=num_heads, D=head_dim, SPLITS=splits)

    @staticmethod
    def silu_mul(gate_up, out) -> None:
        kernel = _kernels()[3]
        rows, width = out.shape
        block = min(1024, _next_pow2(width))
        kernel[(rows, -(-width // block))](gate_up, out, F_=width, BLOCK=block)


def supports(page_size: int, head_dim: int) -> str | None:
    """Why the Triton kernels cannot serve this shape, or None when they can."""
    if page_size & (page_size - 1):
        return f"page_size {page_size} is not a power of two"
    if head_dim & (head_dim - 1) or head_dim < 2:
        return f"head_dim {head_dim} is not a power of two"
    return None
