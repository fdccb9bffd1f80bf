"""The Triton kernels of `decode_ops.TritonOps` (imported only when those ops run: Triton is optional).

Triton decides at decoration whether a kernel is compiled or interpreted (`TRITON_INTERPRET=1`, how the
CPU tests run them), so that variable must be set before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_block(q, kv_ptr, table_ptr, page_vis_ptr, row_vis_ptr, b, kvh, ctx_len, first_page, m, total, acc,
                  scale, NUM_PAGES: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                  BLOCK_PAGES: tl.constexpr, DOT: tl.constexpr):
    """Online-softmax update of query rows `q` [R, D] of item b with the BLOCK_PAGES pages from
    `first_page` of its table: a slot counts when before ctx_len, visible in its page and in the item's
    row. Returns the new (running max [R], sum [R], weighted values [R, D]).

    DOT 0: `q` is float32, already scaled, and the products are broadcast multiplies and sums. DOT 1 and 2
    (R, D and the block's slots all >= 16): `q` is unscaled and both products are `tl.dot`s, p·v in IEEE
    float32, q·kᵀ with float32 sums: on float32 operands (1) or on the cache's dtype (2: exact products,
    so the same numbers, on tensor cores for bf16/fp16; Triton's interpreter cannot run it)."""
    dims = tl.arange(0, D)
    cols = tl.arange(0, BLOCK_PAGES * S)  # slot of the block
    col_slot = cols % S
    slot = first_page * S + cols
    page = tl.load(table_ptr + b * NUM_PAGES + first_page + cols // S).to(tl.int64)
    seen = slot < ctx_len
    seen &= tl.load(page_vis_ptr + page * S + col_slot, mask=seen, other=0) != 0
    seen &= tl.load(row_vis_ptr + b * NUM_PAGES * S + slot, mask=seen, other=0) != 0
    k_rows = kv_ptr + ((page * 2 * S + col_slot) * KVH + kvh)[:, None] * D + dims[None, :]  # [pages, 2, S, KVH, D]
    k = tl.load(k_rows, mask=seen[:, None], other=0.0)
    v = tl.load(k_rows + S * KVH * D, mask=seen[:, None], other=0.0).to(tl.float32)
    if DOT == 2:
        scores = tl.dot(q, tl.trans(k)) * scale  # [R, BLOCK_PAGES * S], float32 sums
    elif DOT == 1:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
    else:
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [R, BLOCK_PAGES * S]
    scores = tl.where(seen[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m - m_new)
    total = total * alpha + tl.sum(p, axis=1)
    if DOT > 0:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, total, acc


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
def _attend_group(q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, scale, b, kvh, first_page,
                  NUM_BLOCKS: tl.constexpr, NUM_PAGES: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr,
                  D: tl.constexpr, S: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_PAGES: tl.constexpr, DOT: tl.constexpr):
    """The G query heads of item b that share key head kvh (rows past G are padding), over NUM_BLOCKS
    blocks of BLOCK_PAGES pages from `first_page`, each page read once for all of them. Returns the
    online softmax's (running max [BLOCK_G], sum [BLOCK_G], weighted values [BLOCK_G, D])."""
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + (b * H + kvh * G + heads)[:, None] * D + dims[None, :], mask=(heads < G)[:, None], other=0.0)
    if DOT == 2:
        q = q.to(kv_ptr.dtype.element_ty)  # the cache's dtype (q is stored in it): exact
    elif DOT == 1:
        q = q.to(tl.float32)
    else:
        q = q.to(tl.float32) * scale
    ctx_len = tl.load(ctx_ptr + b)
    m = tl.full([BLOCK_G], -1.0e30, tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for i in range(0, NUM_BLOCKS):
        m, total, acc = _attend_block(q, kv_ptr, table_ptr, page_vis_ptr, row_vis_ptr, b, kvh, ctx_len,
                                      first_page + i * BLOCK_PAGES, m, total, acc, scale, NUM_PAGES, KVH, D, S,
                                      BLOCK_PAGES, DOT)
    return m, total, acc


@triton.jit
def decode_attention_kernel(
    q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, out_ptr, scale,
    NUM_PAGES: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PAGES: tl.constexpr, DOT: tl.constexpr,
):
    # program (b, kvh): the G query heads sharing key head kvh, over all the item's pages.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    m, total, acc = _attend_group(q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, scale, b, kvh, 0,
                                  NUM_PAGES // BLOCK_PAGES, NUM_PAGES, H, KVH, D, S, G, BLOCK_G, BLOCK_PAGES, DOT)
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, D)
    result = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + (b * H + kvh * G + heads)[:, None] * D + dims[None, :], result.to(out_ptr.dtype.element_ty),
             mask=(heads < G)[:, None])


@triton.jit
def decode_attention_split_kernel(
    q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, scale,
    NUM_PAGES: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_PAGES: tl.constexpr, SPLITS: tl.constexpr, DOT: tl.constexpr,
):
    # program (b, kvh, split): as decode_attention_kernel over the split's NUM_PAGES // SPLITS pages;
    # writes each head's running max, sum and weighted values for `decode_attention_combine_kernel`.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    PER_SPLIT: tl.constexpr = NUM_PAGES // SPLITS
    m, total, acc = _attend_group(q_ptr, kv_ptr, table_ptr, ctx_ptr, page_vis_ptr, row_vis_ptr, scale, b, kvh,
                                  split * PER_SPLIT, PER_SPLIT // BLOCK_PAGES, NUM_PAGES, H, KVH, D, S, G, BLOCK_G,
                                  BLOCK_PAGES, DOT)
    heads = tl.arange(0, BLOCK_G)
    head_ok = heads < G
    dims = tl.arange(0, D)
    part = (b * H + kvh * G + heads) * SPLITS + split  # [BLOCK_G]
    tl.store(part_m_ptr + part, m, mask=head_ok)
    tl.store(part_l_ptr + part, total, mask=head_ok)
    tl.store(part_acc_ptr + part[:, None] * D + dims[None, :], acc, mask=head_ok[:, None])


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
