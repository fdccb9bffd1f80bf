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

The Triton kernels accumulate in float32 whatever the storage dtype; the attention is an online
softmax over `DECODE_BLOCK_SLOTS` slots (whole pages) per iteration, so `page_size` and the page table's
width must be powers of two. With
`TRITON_INTERPRET=1` they run on CPU tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import functools
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
    return _build_kernels(interpreting())


@functools.cache
def _build_kernels(interpret: bool):  # Triton picks the interpreter at decoration: one set per mode
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(
        hidden_ptr, delta_ptr, weight_ptr, out_ptr, eps, C: tl.constexpr, BLOCK: tl.constexpr,
        HAS_DELTA: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        keep = cols < C
        x = tl.load(hidden_ptr + row * C + cols, mask=keep, other=0.0)
        if HAS_DELTA:
            x += tl.load(delta_ptr + row * C + cols, mask=keep, other=0.0).to(tl.float32)
            tl.store(hidden_ptr + row * C + cols, x, mask=keep)
        mean_square = tl.sum(x * x, axis=0) / C
        w = tl.load(weight_ptr + cols, mask=keep, other=0.0)
        y = x * (1.0 / tl.sqrt(mean_square + eps)) * w
        tl.store(out_ptr + row * C + cols, y.to(out_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def rope_write_kv_kernel(
        qkv_ptr, pos_ptr, cos_ptr, sin_ptr, kv_ptr, page_ptr, offset_ptr, q_out_ptr,
        H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    ):
        # program (b, h): h < H rotates query head h; h >= H rotates key head h - H and copies its value.
        b = tl.program_id(0)
        h = tl.program_id(1)
        HALF: tl.constexpr = D // 2
        lo = tl.arange(0, HALF)
        row = (H + 2 * KVH) * D
        pos = tl.load(pos_ptr + b)
        c = tl.load(cos_ptr + pos * D + lo)
        s = tl.load(sin_ptr + pos * D + lo)
        base = qkv_ptr + b * row + h * D
        x1 = tl.load(base + lo).to(tl.float32)
        x2 = tl.load(base + HALF + lo).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        if h < H:
            dst = q_out_ptr + (b * H + h) * D
            tl.store(dst + lo, y1.to(q_out_ptr.dtype.element_ty))
            tl.store(dst + HALF + lo, y2.to(q_out_ptr.dtype.element_ty))
        else:
            kvh = h - H
            page = tl.load(page_ptr + b).to(tl.int64)
            offset = tl.load(offset_ptr + b)
            # kv layer: [pages, 2, S, KVH, D]
            k_dst = kv_ptr + ((page * 2 * S + offset) * KVH + kvh) * D
            v_dst = k_dst + S * KVH * D
            tl.store(k_dst + lo, y1.to(kv_ptr.dtype.element_ty))
            tl.store(k_dst + HALF + lo, y2.to(kv_ptr.dtype.element_ty))
            full = tl.arange(0, D)
            v = tl.load(qkv_ptr + b * row + (H + KVH + kvh) * D + full)
            tl.store(v_dst + full, v.to(kv_ptr.dtype.element_ty))

    @triton.jit
    def decode_attention_kernel(
        q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, out_ptr, scale,
        NUM_PAGES: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PAGES: tl.constexpr,
    ):
        # program (b, kvh): the G query heads sharing key head kvh, over the item's pages, BLOCK_PAGES
        # pages (BLOCK_PAGES * S slots) per iteration.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        heads = tl.arange(0, BLOCK_G)
        head_ok = heads < G
        dims = tl.arange(0, D)
        cols = tl.arange(0, BLOCK_PAGES * S)  # slot of the block
        col_page = cols // S
        col_slot = cols % S
        q = tl.load(
            q_ptr + (b * H + kvh * G + heads)[:, None] * D + dims[None, :], mask=head_ok[:, None], other=0.0
        ).to(tl.float32) * scale
        ctx_len = tl.load(ctx_ptr + b)
        m = tl.full([BLOCK_G], -1.0e30, tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for i in range(0, NUM_PAGES // BLOCK_PAGES):
            slot = i * BLOCK_PAGES * S + cols
            page = tl.load(table_ptr + b * NUM_PAGES + i * BLOCK_PAGES + col_page).to(tl.int64)
            seen = slot < ctx_len
            seen &= tl.load(page_vis_ptr + page * S + col_slot, mask=seen, other=0) != 0
            seen &= tl.load(row_vis_ptr + b * NUM_PAGES * S + slot, mask=seen, other=0) != 0
            k_rows = kv_ptr + ((page * 2 * S + col_slot) * KVH + kvh)[:, None] * D + dims[None, :]
            k = tl.load(k_rows, mask=seen[:, None], other=0.0).to(tl.float32)
            v = tl.load(k_rows + S * KVH * D, mask=seen[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_PAGES * S]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        result = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
        tl.store(
            out_ptr + (b * H + kvh * G + heads)[:, None] * D + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )

    @triton.jit
    def decode_attention_split_kernel(
        q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale,
        NUM_PAGES: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
        G: tl.constexpr, BLOCK_PAGES: tl.constexpr, SPLITS: tl.constexpr,
    ):
        # program (b, h, split): query head h over the split's NUM_PAGES // SPLITS pages; writes its
        # running max, sum and weighted values for `decode_attention_combine_kernel`.
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        kvh = h // G
        PER_SPLIT: tl.constexpr = NUM_PAGES // SPLITS
        dims = tl.arange(0, D)
        cols = tl.arange(0, BLOCK_PAGES * S)
        col_page = cols // S
        col_slot = cols % S
        q = tl.load(q_ptr + (b * H + h) * D + dims).to(tl.float32) * scale
        ctx_len = tl.load(ctx_ptr + b)
        m = tl.full([1], -1.0e30, tl.float32)
        total = tl.zeros([1], tl.float32)
        acc = tl.zeros([1, D], tl.float32)
        for i in range(0, PER_SPLIT // BLOCK_PAGES):
            first = split * PER_SPLIT + i * BLOCK_PAGES
            slot = first * S + cols
            page = tl.load(table_ptr + b * NUM_PAGES + first + col_page).to(tl.int64)
            seen = slot < ctx_len
            seen &= tl.load(page_vis_ptr + page * S + col_slot, mask=seen, other=0) != 0
            seen &= tl.load(row_vis_ptr + b * NUM_PAGES * S + slot, mask=seen, other=0) != 0
            k_rows = kv_ptr + ((page * 2 * S + col_slot) * KVH + kvh)[:, None] * D + dims[None, :]
            k = tl.load(k_rows, mask=seen[:, None], other=0.0).to(tl.float32)
            v = tl.load(k_rows + S * KVH * D, mask=seen[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[None, :] * k, axis=1)[None, :]  # [1, BLOCK_PAGES * S]
            scores = tl.where(seen[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        part = (b * H + h) * SPLITS + split
        one = tl.arange(0, 1)
        tl.store(part_m_ptr + part + one, m)
        tl.store(part_l_ptr + part + one, total)
        tl.store(part_acc_ptr + part * D + dims[None, :] + one[:, None], acc)

    @triton.jit
    def decode_attention_combine_kernel(
        part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, D)
        base = (b * H + h) * SPLITS
        ms = tl.load(part_m_ptr + base + splits)
        weights = tl.exp(ms - tl.max(ms, axis=0))  # a split that saw nothing: m = -1e30, weight 0
        total = tl.sum(tl.load(part_l_ptr + base + splits) * weights, axis=0)
        accs = tl.load(part_acc_ptr + (base + splits)[:, None] * D + dims[None, :])
        acc = tl.sum(accs * weights[:, None], axis=0)
        result = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
        tl.store(out_ptr + (b * H + h) * D + dims, result.to(out_ptr.dtype.element_ty))

    @triton.jit
    def silu_mul_kernel(gate_up_ptr, out_ptr, F_: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < F_
        gate = tl.load(gate_up_ptr + row * 2 * F_ + cols, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * F_ + F_ + cols, mask=keep, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * F_ + cols, y.to(out_ptr.dtype.element_ty), mask=keep)

    return (add_rms_norm_kernel, rope_write_kv_kernel, decode_attention_kernel, silu_mul_kernel,
            decode_attention_split_kernel, decode_attention_combine_kernel)


# Slots the decode attention reads per iteration (whole pages): more loads in flight per program.
DECODE_BLOCK_SLOTS = 64
# "blocked": one program per (item, KV head) walks all its pages (measured on an H200: benchmarks.md).
# "split": one program per (item, query head, split of the pages), then a combine ("flash-decoding"):
# more programs in flight at small batches; checked against the reference, NOT YET MEASURED on a GPU
# (bench/executor.py --decode-attention split).
DECODE_ATTENTION = "blocked"
SPLIT_TARGET_PROGRAMS = 264  # about two per multiprocessor of an H100 / H200


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
        if DECODE_ATTENTION == "split":
            TritonOps.decode_attention_split(q, kv, page_table, ctx_len, page_visible, row_visible, out)
            return
        kernel = _kernels()[2]
        batch, num_heads, head_dim = q.shape
        num_kv_heads, page_size = kv.shape[-2], kv.shape[2]
        group = num_heads // num_kv_heads
        num_pages = page_table.shape[1]  # a power of two (a page bucket), as is page_size
        kernel[(batch, num_kv_heads)](
            q, kv, page_table, ctx_len, page_visible, row_visible, out, 1.0 / math.sqrt(head_dim),
            NUM_PAGES=num_pages, BLOCK_PAGES=max(1, min(num_pages, DECODE_BLOCK_SLOTS // page_size)),
            H=num_heads, KVH=num_kv_heads, D=head_dim, S=page_size, G=group, BLOCK_G=_next_pow2(group),
        )

    @staticmethod
    def decode_attention_split(q, kv, page_table, ctx_len, page_visible, row_visible, out) -> None:
        split_kernel, combine_kernel = _kernels()[4:6]
        batch, num_heads, head_dim = q.shape
        num_kv_heads, page_size = kv.shape[-2], kv.shape[2]
        num_pages = page_table.shape[1]
        splits = min(num_pages, _next_pow2(-(-SPLIT_TARGET_PROGRAMS // (batch * num_heads))))
        block_pages = max(1, min(num_pages // splits, DECODE_BLOCK_SLOTS // page_size))
        part_m = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        split_kernel[(batch, num_heads, splits)](
            q, kv, page_table, ctx_len, page_visible, row_visible, part_m, part_l, part_acc,
            1.0 / math.sqrt(head_dim), NUM_PAGES=num_pages, H=num_heads, KVH=num_kv_heads, D=head_dim,
            S=page_size, G=num_heads // num_kv_heads, BLOCK_PAGES=block_pages, SPLITS=splits,
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
