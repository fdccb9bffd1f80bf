"""The executor's own checks of a batch, before it touches any state (defence in depth behind the
scheduler's validation).

Pure functions over the command dataclasses, the model's numbers (`ModelConfig`) and the KV cache's
allocation state (`KvCache.is_page_allocated` / `is_slot_allocated`, read only): each raises a typed
`ExecutorError` naming `where` (e.g. "forward_text item 2"). Per-item checks run inside
`blame_item(n)`, which sets the error's `item_index`; batch-wide checks set it themselves or leave it
unset when no single item is at fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from l4m.executor.attention import ItemLayout
from l4m.executor.commands import (
    Allocate,
    CopyKvPage,
    Deallocate,
    EmbedText,
    Forward,
    ForwardText,
    MaskKvPage,
    ResourceKind,
    SamplerKind,
    SamplerSpec,
    SampleTopK,
)
from l4m.executor.errors import ExecutorError, InvalidCommand, UnknownResource
from l4m.executor.sampler import decode_vocab_masks, validate_sampler
from l4m.wire.brle import BrleError, decode_rows

if TYPE_CHECKING:
    from l4m.executor.kv_cache import KvCache
    from l4m.executor.weights import ModelConfig

MAX_CONTINUATION_STEPS = 64  # per forward_text item: bounds how long one batch holds the executor


@contextlib.contextmanager
def blame_item(index: int) -> Iterator[None]:
    """Tag an error raised while validating item `index` with that index."""
    try:
        yield
    except ExecutorError as exc:
        exc.item_index = index
        raise


@dataclass(frozen=True)
class PreparedItem:
    layout: ItemLayout
    write_slots: np.ndarray  # [num_new] flat page_id * page_size + offset


# ---- ids, tokens, positions ---------------------------------------------------------------------


def check_pages(cache: KvCache, page_ids: Sequence[int], where: str) -> None:
    for page in page_ids:
        if not 0 <= page < cache.num_pages:
            raise UnknownResource(f"{where}: kv page {page} is out of range (0..{cache.num_pages - 1})")
        if not cache.is_page_allocated[page]:
            raise UnknownResource(f"{where}: kv page {page} is not allocated")


def check_slots(cache: KvCache, slot_ids: Sequence[int], where: str) -> None:
    for slot in slot_ids:
        if not 0 <= slot < cache.num_embed_slots:
            raise UnknownResource(
                f"{where}: embed slot {slot} is out of range (0..{cache.num_embed_slots - 1})"
            )
        if not cache.is_slot_allocated[slot]:
            raise UnknownResource(f"{where}: embed slot {slot} is not allocated")


def check_tokens(token_ids: Sequence[int], vocab_size: int, where: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidCommand(f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")


def check_positions(position_ids: Sequence[int], num_tokens: int, max_context: int, where: str) -> None:
    if len(position_ids) != num_tokens:
        raise InvalidCommand(f"{where}: {len(position_ids)} position ids for {num_tokens} tokens")
    bad = [p for p in position_ids if not 0 <= p < max_context]
    if bad:
        raise InvalidCommand(
            f"{where}: position id {bad[0]} is outside the model's context (0..{max_context - 1})"
        )


def check_outputs(output_indices: Sequence[int], num_new: int, where: str) -> None:
    bad = [j for j in output_indices if not 0 <= j < num_new]
    if bad:
        raise InvalidCommand(f"{where}: output index {bad[0]} is out of range (0..{num_new - 1})")


# ---- an item's pages and where its new tokens go ------------------------------------------------


def prepare_layout(
    cache: KvCache,
    page_ids: Sequence[int],
    last_len: int,
    num_new: int,
    mask_rows: Sequence[Sequence[int]],
    where: str,
) -> PreparedItem:
    """Check an item's pages, lengths and mask rows; where its new tokens go."""
    page_size = cache.page_size
    if not page_ids:
        raise InvalidCommand(f"{where}: no kv pages")
    if len(set(page_ids)) != len(page_ids):
        raise InvalidCommand(f"{where}: a kv page appears twice in the item's page list")
    check_pages(cache, page_ids, where)
    if not 0 < last_len <= page_size:
        raise InvalidCommand(f"{where}: kv_last_page_length must be in 1..{page_size}, got {last_len}")
    if num_new < 1:
        raise InvalidCommand(f"{where}: no input tokens")
    total = page_size * (len(page_ids) - 1) + last_len
    if num_new > total:
        raise InvalidCommand(
            f"{where}: {num_new} new tokens do not fit in a context of {total} slots "
            "(the pages must already include room for the new tokens)"
        )
    num_ctx = total - num_new
    if mask_rows:
        if len(mask_rows) != num_new:
            raise InvalidCommand(
                f"{where}: {len(mask_rows)} attention-mask rows for {num_new} tokens (one per token)"
            )
        for i, row in enumerate(mask_rows):
            if any(r < 0 for r in row):
                raise InvalidCommand(f"{where}: attention-mask row {i} has a negative run")
            if sum(row) != num_ctx + i + 1:
                raise InvalidCommand(
                    f"{where}: attention-mask row {i} decodes to {sum(row)} values, expected {num_ctx + i + 1} "
                    f"(context {num_ctx} + {i + 1})"
                )
    slots = np.arange(num_ctx, total)
    write_slots = np.asarray(page_ids, dtype=np.int64)[slots // page_size] * page_size + slots % page_size
    return PreparedItem(ItemLayout(tuple(page_ids), num_ctx, num_new, tuple(mask_rows)), write_slots)


def check_no_write_collision(prepared: Sequence[PreparedItem], page_size: int, kind: str) -> None:
    """Raises, naming the first item that writes a slot an earlier item of the batch writes too
    (an item never writes one slot twice: its pages are distinct)."""
    slots = np.concatenate([p.write_slots for p in prepared])
    if np.unique(slots).size == slots.size:
        return
    owners = np.repeat(np.arange(len(prepared)), [p.write_slots.size for p in prepared])
    order = np.argsort(slots, kind="stable")  # equal slots stay in item order
    repeated = np.flatnonzero(slots[order][1:] == slots[order][:-1]) + 1
    first = repeated[np.argmin(owners[order][repeated])]
    item, earlier = int(owners[order][first]), int(owners[order][first - 1])
    page, offset = divmod(int(slots[order][first]), page_size)
    raise InvalidCommand(
        f"{kind} item {item}: writes kv page {page} slot {offset}, the same kv page slot as item {earlier} of this batch",
        item_index=item,
    )


def check_batch_tokens(num_tokens: int, max_batch_tokens: int) -> None:
    if num_tokens > max_batch_tokens:
        raise InvalidCommand(
            f"the batch carries {num_tokens} new tokens, more than max_batch_tokens={max_batch_tokens}"
        )


# ---- per command kind ---------------------------------------------------------------------------


def check_resource_batch(
    items: Sequence[Allocate | Deallocate], cache: KvCache, should_be_allocated: bool
) -> None:
    verb = "deallocate" if should_be_allocated else "allocate"
    seen: dict[ResourceKind, set[int]] = {ResourceKind.KV_PAGE: set(), ResourceKind.EMBED_SLOT: set()}
    for n, it in enumerate(items):
        where = f"{verb} item {n}"
        if not isinstance(it.kind, ResourceKind):
            raise InvalidCommand(f"{where}: unknown resource kind {it.kind!r}", item_index=n)
        if it.kind is ResourceKind.KV_PAGE:
            label, capacity, table = "kv page", cache.num_pages, cache.is_page_allocated
        else:
            label, capacity, table = "embed slot", cache.num_embed_slots, cache.is_slot_allocated
        for i in it.ids:
            if not 0 <= i < capacity:
                raise UnknownResource(f"{where}: {label} {i} is out of range (0..{capacity - 1})", item_index=n)
            if table[i] != should_be_allocated:
                state = "not allocated" if should_be_allocated else "already allocated"
                raise InvalidCommand(f"{where}: {label} {i} is {state}", item_index=n)
            if i in seen[it.kind]:
                raise InvalidCommand(f"{where}: {label} {i} appears twice in the batch", item_index=n)
            seen[it.kind].add(i)


def check_forward_text_item(item: ForwardText, cache: KvCache, model: ModelConfig, where: str) -> PreparedItem:
    p = prepare_layout(
        cache, item.kv_page_ids, item.kv_last_page_length, len(item.token_ids), item.attention_mask, where
    )
    check_tokens(item.token_ids, model.vocab_size, where)
    check_positions(item.position_ids, len(item.token_ids), model.max_context, where)
    check_outputs(item.output_indices, len(item.token_ids), where)
    if len(item.samplers) != len(item.output_indices):
        raise InvalidCommand(
            f"{where}: {len(item.samplers)} samplers for {len(item.output_indices)} output indices (one each)"
        )
    for j, spec in enumerate(item.samplers):
        validate_sampler(spec, model.vocab_size, f"{where} sampler {j}")
    return p


def check_continuation(item: ForwardText, cache: KvCache, model: ModelConfig, where: str) -> PreparedItem:
    """Checks what continuation needs beyond a plain forward_text (see common.proto); returns the pages,
    room and write slots of everything the item may write, the continuation included."""
    num_steps, num_tokens = item.num_continuation_steps, len(item.token_ids)
    if num_steps == 0:
        return prepare_layout(cache, item.kv_page_ids, item.kv_last_page_length, max(num_tokens, 1), (), where)
    if num_steps > MAX_CONTINUATION_STEPS:
        raise InvalidCommand(f"{where}: {num_steps} continuation steps, more than {MAX_CONTINUATION_STEPS}")
    if item.attention_mask:
        raise InvalidCommand(f"{where}: continuation needs plain causal attention (no attention masks)")
    if tuple(item.output_indices) != (num_tokens - 1,):
        raise InvalidCommand(
            f"{where}: continuation needs exactly one output index, the last token's ({num_tokens - 1}), "
            f"not {list(item.output_indices)}"
        )
    (sampler,) = item.samplers or (None,)
    if sampler is None or sampler.kind not in (SamplerKind.GREEDY, SamplerKind.SAMPLE) or sampler.vocab_mask:
        raise InvalidCommand(
            f"{where}: continuation needs a GREEDY or SAMPLE sampler without a vocabulary mask (its token is fed back)"
        )
    check_tokens(tuple(item.continuation_stop_token_ids), model.vocab_size, f"{where} continuation_stop_token_ids")
    if item.position_ids and item.position_ids[-1] + num_steps >= model.max_context:
        raise InvalidCommand(
            f"{where}: {num_steps} continuation steps after position {item.position_ids[-1]} pass the "
            f"model's context ({model.max_context} positions)"
        )
    return prepare_layout(cache, item.kv_page_ids, item.kv_last_page_length, num_tokens + num_steps, (), where)


def decode_batch_vocab_masks(
    items: Sequence[ForwardText], specs: Sequence[SamplerSpec], wheres: Sequence[str], vocab_size: int
) -> np.ndarray | None:
    """The batch's decoded vocabulary masks; a bad mask is blamed on its item (each item is decoded
    alone only then, to find it)."""
    try:
        return decode_vocab_masks(specs, vocab_size, wheres)
    except InvalidCommand:
        for n, item in enumerate(items):
            with blame_item(n):
                decode_vocab_masks(item.samplers, vocab_size, [f"forward_text item {n} sampler {j}"
                                                                for j in range(len(item.samplers))])
        raise


def check_forward_item(item: Forward, cache: KvCache, where: str) -> PreparedItem:
    check_slots(cache, item.input_slot_ids, where)
    p = prepare_layout(cache, item.kv_page_ids, item.kv_last_page_length, len(item.input_slot_ids), (), where)
    check_outputs(item.output_indices, len(item.input_slot_ids), where)
    if len(item.output_slot_ids) != len(item.output_indices):
        raise InvalidCommand(
            f"{where}: {len(item.output_slot_ids)} output slots for {len(item.output_indices)} output indices"
        )
    check_slots(cache, item.output_slot_ids, where)
    return p


def check_embed_text_item(item: EmbedText, cache: KvCache, model: ModelConfig, where: str) -> None:
    if len(item.slot_ids) != len(item.token_ids):
        raise InvalidCommand(f"{where}: {len(item.slot_ids)} slots for {len(item.token_ids)} tokens")
    check_slots(cache, item.slot_ids, where)
    check_tokens(item.token_ids, model.vocab_size, where)
    check_positions(item.position_ids, len(item.token_ids), model.max_context, where)


def check_sample_top_k_item(item: SampleTopK, cache: KvCache, vocab_size: int, where: str) -> None:
    check_slots(cache, [item.slot_id], where)
    if not 0 < item.k <= vocab_size:
        raise InvalidCommand(f"{where}: k must be in 1..{vocab_size}, got {item.k}")


def check_copy(item: CopyKvPage, cache: KvCache, where: str) -> None:
    page_size = cache.page_size
    check_pages(cache, [item.src_page_id, item.dst_page_id], where)
    for name, offset in (("src_offset", item.src_offset), ("dst_offset", item.dst_offset)):
        if not offset >= 0 or offset + item.length > page_size:
            raise InvalidCommand(
                f"{where}: {name} {offset} + length {item.length} leaves the page (page_size {page_size})"
            )
    if item.length < 0:
        raise InvalidCommand(f"{where}: length must be >= 0, got {item.length}")


def check_page_mask(item: MaskKvPage, cache: KvCache, where: str) -> None:
    check_pages(cache, [item.page_id], where)
    if any(r < 0 for r in item.mask) or sum(item.mask) != cache.page_size:
        raise InvalidCommand(
            f"{where}: mask must decode to exactly page_size={cache.page_size} values, got {sum(item.mask)}"
        )


def decode_page_masks(items: Sequence[MaskKvPage], page_size: int) -> np.ndarray:
    """The batch's page masks decoded, `[len(items), page_size]` bool; a mask that does not decode is
    blamed on its item (each is decoded alone only then, to find it)."""
    try:
        return decode_rows([it.mask for it in items], page_size)
    except BrleError as exc:
        for n, item in enumerate(items):
            try:
                decode_rows([item.mask], page_size)
            except BrleError as item_exc:
                raise InvalidCommand(f"mask_kv_page item {n}: {item_exc}", item_index=n) from item_exc
        raise InvalidCommand(f"mask_kv_page: {exc}") from exc
