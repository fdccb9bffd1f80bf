"""The executor's own checks of a batch, before it touches any state (defence in depth behind the
scheduler's validation, with the same code: the protocol's rules are `l4m.wire.rules`').

Pure functions over the command dataclasses, the model's numbers (`ModelConfig`) and the KV cache's
allocation state (`KvCache.is_page_allocated` / `is_slot_allocated`, read only): each raises a typed
`ExecutorError` naming `where` (e.g. "forward_text item 2"); a broken rule of the protocol is an
`InvalidCommand` with the rule's own wording after `where`. Per-item checks run inside `blame_item(n)`,
which sets the error's `item_index`; batch-wide checks set it themselves or leave it unset when no
single item is at fault.
"""

from __future__ import annotations

import contextlib
import functools
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
    SamplerSpec,
    SampleTopK,
)
from l4m.executor.errors import ExecutorError, InvalidCommand, UnknownResource
from l4m.executor.sampler import decode_vocab_masks
from l4m.wire import rules
from l4m.wire.brle import BrleError, decode_rows

if TYPE_CHECKING:
    from l4m.executor.kv_cache import KvCache
    from l4m.executor.weights import ModelConfig


@contextlib.contextmanager
def blame_item(index: int) -> Iterator[None]:
    """Tag an error raised while validating item `index` with that index."""
    try:
        yield
    except ExecutorError as exc:
        exc.item_index = index
        raise


# `with obey(where):` a broken rule of the protocol (`l4m.wire.rules`) as an `InvalidCommand` naming `where`.
obey = functools.partial(rules.reported_as, InvalidCommand)


@dataclass(frozen=True)
class PreparedItem:
    layout: ItemLayout
    write_slots: np.ndarray  # [num_new] flat page_id * page_size + offset


# ---- ids, tokens, positions ---------------------------------------------------------------------


_PAGES_CHECKED_ONE_BY_ONE = 48  # up to this many pages (768 tokens of 16) a Python loop costs less than numpy


def check_pages(cache: KvCache, page_ids: Sequence[int], where: str) -> None:
    if len(page_ids) > _PAGES_CHECKED_ONE_BY_ONE:  # a long context: one pass in numpy, every step
        ids = np.fromiter(page_ids, dtype=np.int64, count=len(page_ids))
        if ids.min() >= 0 and ids.max() < cache.num_pages and cache.is_page_allocated[ids].all():
            return
    for page in page_ids:  # finds the first bad page, and names it
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


# ---- an item's pages and where its new tokens go ------------------------------------------------


def prepare_layout(
    cache: KvCache, page_ids: Sequence[int], num_context: int, num_new: int,
    mask_rows: Sequence[Sequence[int]], where: str,
) -> PreparedItem:
    """An item whose shape obeys the rules: its pages must be allocated; where its new tokens go."""
    check_pages(cache, page_ids, where)
    page_size = cache.page_size
    if num_new == 1:  # a decode step: its one slot, without an array of the whole page list
        page, offset = divmod(num_context, page_size)
        write_slots = np.array((page_ids[page] * page_size + offset,), dtype=np.int64)
    else:
        slots = np.arange(num_context, num_context + num_new)
        write_slots = np.asarray(page_ids, dtype=np.int64)[slots // page_size] * page_size + slots % page_size
    return PreparedItem(ItemLayout(tuple(page_ids), num_context, num_new, tuple(mask_rows)), write_slots)


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
    with obey(where):
        num_context = rules.check_forward_text(
            kv_page_ids=item.kv_page_ids, kv_last_page_length=item.kv_last_page_length, token_ids=item.token_ids,
            position_ids=item.position_ids, attention_masks=item.attention_mask,
            output_indices=item.output_indices, num_samplers=len(item.samplers),
            num_continuation_steps=item.num_continuation_steps, vocab_size=model.vocab_size,
            max_context=model.max_context, page_size=cache.page_size,
        )
    for j, spec in enumerate(item.samplers):
        check_sampler(spec, model.vocab_size, f"{where}: samplers[{j}]")
    if item.num_continuation_steps or item.continuation_stop_token_ids:
        _check_continuation_rules(item, model, where)
    return prepare_layout(cache, item.kv_page_ids, num_context, len(item.token_ids), item.attention_mask, where)


def check_sampler(spec: SamplerSpec, vocab_size: int, field: str) -> None:
    """One sampler's rules (`rules.check_sampler`); the message names `field` ("... samplers[0]")."""
    with obey(field):
        rules.check_sampler(
            spec.kind, distribution_top_k=spec.distribution_top_k, temperature=spec.temperature, top_k=spec.top_k,
            top_p=spec.top_p, min_p=spec.min_p, seed=spec.seed, vocabulary_mask=spec.vocab_mask or (),
            vocab_size=vocab_size, logit_bias_token_ids=spec.logit_bias_token_ids,
            logit_bias_values=spec.logit_bias_values, top_logprobs=spec.top_logprobs,
        )


def _check_continuation_rules(item: ForwardText, model: ModelConfig, where: str) -> None:
    (sampler,) = item.samplers if len(item.samplers) == 1 else (None,)
    with obey(where):
        rules.check_continuation(
            num_steps=item.num_continuation_steps, stop_token_ids=item.continuation_stop_token_ids,
            num_tokens=len(item.token_ids), output_indices=item.output_indices,
            num_mask_rows=len(item.attention_mask), sampler_kind=None if sampler is None else sampler.kind,
            has_vocabulary_mask=bool(sampler is not None and sampler.vocab_mask),
            last_position=item.position_ids[-1] if item.position_ids else 0,
            vocab_size=model.vocab_size, max_context=model.max_context,
        )


def check_continuation(item: ForwardText, cache: KvCache, model: ModelConfig, where: str) -> PreparedItem:
    """Checks what continuation needs beyond a plain forward_text (`rules.check_continuation`, then the
    LENGTH RULE counting the steps); returns the pages, room and write slots of everything the item may
    write, the continuation included. (The first pass is checked in full as a plain forward_text.)"""
    num_steps, num_tokens = item.num_continuation_steps, len(item.token_ids)
    if num_steps:
        _check_continuation_rules(item, model, where)
    num_new = max(num_tokens + num_steps, 1)
    with obey(where):
        num_context = rules.check_context(item.kv_page_ids, item.kv_last_page_length, cache.page_size, num_new)
    return prepare_layout(cache, item.kv_page_ids, num_context, num_new, (), where)


def decode_batch_vocab_masks(
    items: Sequence[ForwardText], specs: Sequence[SamplerSpec], vocab_size: int
) -> np.ndarray | None:
    """The batch's decoded vocabulary masks (None when no sampler has one); a bad mask is blamed on its item
    (each item is decoded alone only then, to find it). The samplers' names are built only for a batch with a
    mask: only a mask's errors use them."""
    if all(spec.vocab_mask is None for spec in specs):
        return None
    wheres = [f"forward_text item {n} sampler {j}" for n, item in enumerate(items) for j in range(len(item.samplers))]
    try:
        return decode_vocab_masks(specs, vocab_size, wheres)
    except InvalidCommand:
        for n, item in enumerate(items):
            with blame_item(n):
                decode_vocab_masks(item.samplers, vocab_size, [f"forward_text item {n} sampler {j}"
                                                                for j in range(len(item.samplers))])
        raise


def check_forward_item(item: Forward, cache: KvCache, where: str) -> PreparedItem:
    with obey(where):
        num_context = rules.check_forward(
            kv_page_ids=item.kv_page_ids, kv_last_page_length=item.kv_last_page_length,
            num_inputs=len(item.input_slot_ids), output_indices=item.output_indices,
            num_output_slots=len(item.output_slot_ids), page_size=cache.page_size,
        )
    check_slots(cache, item.input_slot_ids, where)
    check_slots(cache, item.output_slot_ids, where)
    return prepare_layout(cache, item.kv_page_ids, num_context, len(item.input_slot_ids), (), where)


def check_embed_text_item(item: EmbedText, cache: KvCache, model: ModelConfig, where: str) -> None:
    with obey(where):
        rules.check_embed_text(embed_slot_ids=item.slot_ids, token_ids=item.token_ids, position_ids=item.position_ids,
                               vocab_size=model.vocab_size, max_context=model.max_context)
    check_slots(cache, item.slot_ids, where)


def check_sample_top_k_item(item: SampleTopK, cache: KvCache, vocab_size: int, where: str) -> None:
    with obey(where):
        rules.check_sample_top_k(item.k, vocab_size)
    check_slots(cache, [item.slot_id], where)


def check_copy(item: CopyKvPage, cache: KvCache, where: str) -> None:
    with obey(where):
        rules.check_copy(item.src_offset, item.dst_offset, item.length, cache.page_size)
    check_pages(cache, [item.src_page_id, item.dst_page_id], where)


def check_page_mask(item: MaskKvPage, cache: KvCache, where: str) -> None:
    with obey(where):
        rules.check_page_visibility(item.mask, cache.page_size)
    check_pages(cache, [item.page_id], where)


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
