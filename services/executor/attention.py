"""The attention plan of one batched forward: where new K/V go, which pages each item reads, and the
visibility every layer applies. A model with a sliding window (`ModelConfig.sliding_window`) has it
ANDed into every plan: a token at slot q sees only slots > q - window, as HF counts cache positions.

A batch attends in groups of items (ragged): padding a 1-token decode step to a 2,048-token prefill
chunk's rows and context would multiply the chunk's attention by the number of items. `build_plan`
cuts the batch where one more attention call costs less than the padding it saves (`CALL_COST_PAIRS`);
a batch of alike items stays one group, in order, as one call.

- A `PaddedGroup` pads its items into `[B, Tq, Tkv]` (B items, Tq = most new tokens of an item, Tkv =
  most pages of an item x page_size) for one SDPA call. Its mask is built once per batch (additive, so
  that no layer converts it again) and is the AND of: the item's BRLE rows (or plain causal when it sent
  none), "row belongs to a real token", and the page visibility of every slot read.
- A `DecodePlan` serves single-token items: no padding and no gather, only each item's page table,
  length and slot visibility (BRLE row AND page visibility), for the CPU kernels that read K/V straight
  from the pages (`decode_layers` for a batch of decode steps alone, `decode_attention` for the decode
  steps of a mixed batch), or the same on torch ops elsewhere.
- A mixed batch of decode steps beside one padded group of equal-length items (a prefill chunk) can run
  through the CPU kernels whole (`split_mixed`, `mixed_layers`): the decode steps keep the fused stack.

There is no mask-less path: every group applies its items' masks, single-token steps included.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from l4m.wire.brle import decode_rows


@dataclass(frozen=True)
class ItemLayout:
    """One item's place in the batch, already validated."""

    page_ids: Sequence[int]
    num_ctx: int  # tokens already in the pages before this forward
    num_new: int
    mask_rows: Sequence[Sequence[int]]  # one BRLE row per new token, or empty for causal


# One more attention call (its launch, gathers and scatters, ~100 us on a 2-core CPU) in units of the
# attention work it may save: (query, slot) pairs, ~25 ns each in SDPA there. `float("inf")` keeps
# every batch in one padded call (the path before ragged groups; bench/mixed_batch.py compares them).
CALL_COST_PAIRS: float = 4096


@dataclass(frozen=True)
class PaddedGroup:
    """Items attended in one SDPA call, their queries padded to the group's longest item."""

    # [B, 2, Tkv] row of every K (0) and V (1) slot an item reads, in a layer's cache viewed as
    # [pages * 2 * page_size, KVH, D]: one gather per layer yields both, already in SDPA's layout.
    kv_index: torch.Tensor
    mask: torch.Tensor  # [B, 1, Tq, Tkv] additive, of the model dtype: 0 = attend, -inf = hidden
    scatter_index: torch.Tensor | None  # [n] flat row in B*Tq of each of the group's tokens; None: identity
    num_items: int
    max_new: int


@dataclass(frozen=True)
class DecodePlan:
    """Single-token items, for `torch.ops.l4m_cpu.decode_layers` / `decode_attention`."""

    page_table: torch.Tensor  # [B, max_pages] int64
    ctx_len: torch.Tensor  # [B] int64: the item's tokens, the new one included (it sits at slot ctx_len - 1)
    visible: torch.Tensor  # [B, max_pages * page_size] uint8: 1 = the new token may attend that slot


AttentionGroup = PaddedGroup | DecodePlan


@dataclass(frozen=True)
class AttentionPlan:
    write_pages: torch.Tensor  # [N] page of each new token
    write_offsets: torch.Tensor  # [N] slot inside that page
    groups: tuple[AttentionGroup, ...]
    # Per group, the batch rows of its tokens (item-major); None: the group is the whole batch, in order.
    group_rows: tuple[torch.Tensor | None, ...]
    dead_rows: torch.Tensor | None  # [n] tokens whose mask hides everything (attention output 0)


def build_plan(
    items: Sequence[ItemLayout],
    page_size: int,
    page_visible: torch.Tensor,
    dtype: torch.dtype,
    sliding_window: int = 0,
    decode_apart: bool = False,
) -> AttentionPlan:
    """Vectorized over items except for the cheap per-item index lists; built once, used by every layer.
    With `sliding_window` W > 0 a token at slot q also sees only slots > q - W. `decode_apart`: the
    single-token items form their own group (`group_items`)."""
    device = page_visible.device
    num_new = np.array([it.num_new for it in items], dtype=np.int64)
    num_ctx = np.array([it.num_ctx for it in items], dtype=np.int64)
    page_table = _page_table(items)
    # Slot (in the item's page list) of each new token, item-major like the concatenated tokens.
    item_of_token = np.repeat(np.arange(len(items)), num_new)
    first_row = np.cumsum(num_new) - num_new
    slot = num_ctx[item_of_token] + np.arange(int(num_new.sum())) - first_row[item_of_token]
    groups, group_rows, dead_rows = [], [], []
    for members in group_items(items, page_size, decode_apart):
        part = [items[b] for b in members]
        rows = np.concatenate([np.arange(first_row[b], first_row[b] + num_new[b]) for b in members])
        if all(it.num_new == 1 for it in part):
            groups.append(build_decode_plan(part, page_size, page_visible, sliding_window))
        else:
            group, dead = _build_padded(part, page_size, page_visible, dtype, sliding_window)
            groups.append(group)
            dead_rows.append(rows[dead])
        whole = len(members) == len(items)  # members are in batch order
        group_rows.append(None if whole else torch.from_numpy(rows).to(device))
    dead = np.concatenate(dead_rows) if dead_rows else np.zeros(0, dtype=np.int64)
    return AttentionPlan(
        write_pages=torch.from_numpy(page_table[item_of_token, slot // page_size]).to(device),
        write_offsets=torch.from_numpy(slot % page_size).to(device),
        groups=tuple(groups),
        group_rows=tuple(group_rows),
        dead_rows=torch.from_numpy(dead).to(device) if dead.size else None,
    )


@dataclass(frozen=True)
class MixedSplit:
    """A mixed batch's plan as `torch.ops.l4m_cpu.mixed_layers` takes it: the decode steps' rows first."""

    decode: DecodePlan
    group: PaddedGroup  # the rest of the batch: items of equal new tokens (no scatter)
    order: torch.Tensor  # [N] batch row of each kernel row: the decode steps', then the group's


def split_mixed(plan: AttentionPlan) -> MixedSplit | None:
    """The plan of decode steps beside one padded group of equal-length items (a prefill chunk beside
    decode streams, as chunked prefill makes them) as `mixed_layers` takes it; None for any other plan."""
    if len(plan.groups) != 2:
        return None
    decode = next((g for g in plan.groups if isinstance(g, DecodePlan)), None)
    group = next((g for g in plan.groups if isinstance(g, PaddedGroup)), None)
    if decode is None or group is None or group.scatter_index is not None:
        return None
    rows = dict(zip((type(g) for g in plan.groups), plan.group_rows, strict=True))
    return MixedSplit(decode, group, torch.cat((rows[DecodePlan], rows[PaddedGroup])))


def group_items(items: Sequence[ItemLayout], page_size: int, decode_apart: bool = False) -> list[list[int]]:
    """The batch cut into attention groups (item indices, each group in batch order): items sorted by
    new tokens, then pages, join the group before them while padding them into it costs less than a
    call of their own. Single-token items always join each other (the decode kernel reads no padding).
    `decode_apart`: single-token items never join a multi-token group either. Where the CPU kernels serve
    the batch, decode steps beside one chunk run with it in one fused call (`split_mixed`); joining the
    chunk's padded call would lose that for the whole batch (CALL_COST_PAIRS prices SDPA calls, not it)."""
    order = sorted(range(len(items)), key=lambda b: (-items[b].num_new, -len(items[b].page_ids)))
    groups: list[list[int]] = []
    max_new = max_pages = 0  # of the last group, whose first item has the most new tokens
    for b in order:
        num_new, num_pages = items[b].num_new, len(items[b].page_ids)
        if groups:
            padded = len(groups[-1]) * max_new * max_pages * page_size  # (query, slot) pairs
            merged = (len(groups[-1]) + 1) * max_new * max(max_pages, num_pages) * page_size
            joins = merged - padded <= CALL_COST_PAIRS + num_new * num_pages * page_size
            if max_new == 1 or (joins and not (decode_apart and num_new == 1)):
                groups[-1].append(b)
                max_pages = max(max_pages, num_pages)
                continue
        groups.append([b])
        max_new, max_pages = num_new, num_pages
    return [sorted(group) for group in groups]


def _page_table(items: Sequence[ItemLayout]) -> np.ndarray:
    """`[B, max_pages]` int64, each item's pages then zeros."""
    page_table = np.zeros((len(items), max(len(it.page_ids) for it in items)), dtype=np.int64)
    for b, it in enumerate(items):
        page_table[b, : len(it.page_ids)] = it.page_ids
    return page_table


def _build_padded(
    items: Sequence[ItemLayout],
    page_size: int,
    page_visible: torch.Tensor,
    dtype: torch.dtype,
    sliding_window: int,
) -> tuple[PaddedGroup, np.ndarray]:
    """One group's padded call, and its tokens (item-major, in the group) that see nothing."""
    device = page_visible.device
    num_items = len(items)
    num_new = np.array([it.num_new for it in items], dtype=np.int64)
    num_ctx = np.array([it.num_ctx for it in items], dtype=np.int64)
    max_new = int(num_new.max())
    page_table = _page_table(items)
    item_of_token = np.repeat(np.arange(num_items), num_new)
    row_of_token = np.arange(int(num_new.sum())) - np.repeat(np.cumsum(num_new) - num_new, num_new)

    width = page_table.shape[1] * page_size
    rows = np.arange(max_new)
    limit = num_ctx[:, None] + rows[None, :]  # [B, Tq] last visible slot under causal attention
    mask = np.arange(width)[None, None, :] <= limit[:, :, None]  # [B, Tq, Tkv]
    mask &= (rows[None, :] < num_new[:, None])[:, :, None]
    window = None
    if sliding_window:
        window = np.arange(width)[None, None, :] > (limit - sliding_window)[:, :, None]
        mask &= window
    custom = [b for b, it in enumerate(items) if it.mask_rows]
    if custom:
        decoded = decode_rows([r for b in custom for r in items[b].mask_rows], width)
        which = np.isin(item_of_token, custom)
        mask[item_of_token[which], row_of_token[which]] = decoded
        if window is not None:
            mask &= window

    mask_t = torch.from_numpy(mask).to(device)
    table_t = torch.from_numpy(page_table).to(device)
    mask_t &= page_visible[table_t].reshape(num_items, 1, width)
    has_any = mask_t.any(-1)  # [B, Tq]
    dead = np.zeros(0, dtype=np.int64)
    if not bool(has_any.all()):
        # Softmax over nothing is NaN: let such rows see everything, then zero real tokens' output.
        mask_t |= ~has_any[:, :, None]
        dead = np.flatnonzero(~has_any.cpu().numpy()[item_of_token, row_of_token])
    slots = np.arange(page_size)
    k_rows = (page_table[:, :, None] * (2 * page_size) + slots).reshape(num_items, width)  # [B, Tkv]
    kv_index = np.stack((k_rows, k_rows + page_size), axis=1)  # V sits one page_size after K
    additive = torch.zeros(mask_t.shape, dtype=dtype, device=device).masked_fill_(~mask_t, float("-inf"))
    identity = bool((num_new == max_new).all())
    scatter = None if identity else torch.from_numpy(item_of_token * max_new + row_of_token).to(device)
    group = PaddedGroup(torch.from_numpy(kv_index).to(device), additive[:, None], scatter, num_items, max_new)
    return group, dead


def paged_attention(q: torch.Tensor, cache: torch.Tensor, plan: AttentionPlan, decode_kernel: bool = False) -> torch.Tensor:
    """q `[N, H, D]` (new tokens, RoPE applied; their K/V already written) -> `[N, H * D]`, group by group.

    `decode_kernel`: the single-token group of a mixed batch takes `torch.ops.l4m_cpu.decode_attention`
    (the caller vouches for a float32 or float16 CPU cache, head_dim 64 or 128, the kernels loaded). A batch of
    decode steps alone stays on torch ops here: the kernel path for it is `decode_layers`, whole."""
    num_tokens, num_heads, head_dim = q.shape
    if len(plan.groups) == 1 and plan.group_rows[0] is None:
        out = _attend(q, cache, plan.groups[0], decode_kernel=False)
    else:
        out = q.new_empty(num_tokens, num_heads * head_dim)
        for group, rows in zip(plan.groups, plan.group_rows, strict=True):
            out.index_copy_(0, rows, _attend(q.index_select(0, rows), cache, group, decode_kernel))
    if plan.dead_rows is not None:
        out[plan.dead_rows] = 0
    return out


def _attend(q: torch.Tensor, cache: torch.Tensor, group: AttentionGroup, decode_kernel: bool) -> torch.Tensor:
    """One group's tokens `[n, H, D]` -> `[n, H * D]`."""
    if isinstance(group, PaddedGroup):
        return _padded_attention(q, cache, group)
    if decode_kernel:
        num_heads = q.shape[1]
        return torch.ops.l4m_cpu.decode_attention(
            q.reshape(q.shape[0], -1), cache, group.page_table, group.ctx_len, group.visible, num_heads
        )
    return _decode_attention(q, cache, group)


def _padded_attention(q: torch.Tensor, cache: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    batch, max_new = group.num_items, group.max_new
    num_kv_heads = cache.shape[-2]
    flat = cache.view(-1, num_kv_heads, head_dim)
    ctx = flat.index_select(0, group.kv_index.view(-1)).view(*group.kv_index.shape, num_kv_heads, head_dim)
    # ctx: [B, 2, Tkv, KVH, D]; index_select is ~4x faster than advanced indexing for this gather
    ctx = ctx.to(q.dtype)  # a float16 cache (EngineConfig.kv_cache_dtype) attends in the compute dtype
    k = ctx[:, 0].transpose(1, 2)  # [B, KVH, Tkv, D]
    v = ctx[:, 1].transpose(1, 2)
    if group.scatter_index is None:
        q_pad = q.view(batch, max_new, num_heads, head_dim)
    else:
        q_pad = q.new_zeros(batch * max_new, num_heads, head_dim).index_copy_(0, group.scatter_index, q)
        q_pad = q_pad.view(batch, max_new, num_heads, head_dim)
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k, v, attn_mask=group.mask, enable_gqa=True)
    out = out.transpose(1, 2).reshape(batch * max_new, num_heads * head_dim)  # [B*Tq, H*D]
    return out if group.scatter_index is None else out[group.scatter_index]


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """`decode_attention` on torch ops (any device and dtype): gather each item's pages, one SDPA call."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = cache.shape[-2], cache.shape[2]
    slots = torch.arange(page_size, device=q.device)
    k_rows = (plan.page_table[:, :, None] * (2 * page_size) + slots).reshape(batch, -1)  # [B, Tkv]
    flat = cache.view(-1, num_kv_heads, head_dim)
    k = flat.index_select(0, k_rows.view(-1)).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    v = flat.index_select(0, (k_rows + page_size).view(-1)).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v.to(q.dtype)
    width = k_rows.shape[1]
    visible = plan.visible.bool() & (torch.arange(width, device=q.device)[None, :] < plan.ctx_len[:, None])
    has_any = visible.any(-1)  # [B]; softmax over nothing is NaN: such items see everything, output 0
    visible |= ~has_any[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=visible[:, None, None], enable_gqa=True)
    return out.reshape(batch, num_heads * head_dim).masked_fill_(~has_any[:, None], 0)


def is_decode_batch(items: Sequence[ItemLayout]) -> bool:
    return all(it.num_new == 1 for it in items)


def build_decode_plan(
    items: Sequence[ItemLayout], page_size: int, page_visible: torch.Tensor, sliding_window: int = 0
) -> DecodePlan:
    """Vectorized like `build_plan`, on `page_visible`'s device; slots at or after `ctx_len` are never
    read, so need no masking; with `sliding_window` W > 0, slots before `ctx_len - W` are hidden."""
    device = page_visible.device
    num_items = len(items)
    table_t = torch.from_numpy(_page_table(items)).to(device)
    ctx_len = np.array([it.num_ctx + 1 for it in items], dtype=np.int64)
    width = table_t.shape[1] * page_size
    visible = page_visible[table_t].reshape(num_items, width)
    custom = [b for b, it in enumerate(items) if it.mask_rows]
    if custom:
        decoded = decode_rows([items[b].mask_rows[0] for b in custom], width)
        visible[custom] &= torch.from_numpy(decoded).to(device)
    ctx_t = torch.from_numpy(ctx_len).to(device)
    if sliding_window:
        visible &= torch.arange(width, device=device)[None, :] >= (ctx_t - sliding_window)[:, None]
    return DecodePlan(table_t, ctx_t, visible.view(torch.uint8))
