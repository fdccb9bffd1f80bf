"""Translation: a command's virtual ids rewritten to its executor's physical ids, in send order.

Each executor kind has one translator (named in `kinds.py`): it rewrites the item in place and
returns it, or None when nothing must be sent (a deallocate whose pages are all still shared). An id
the instance does not own, or a write into a frozen (exported or imported) page, raises a `TrapError`.
Translators touch only the instance's table and its executor's pools; what to send, and whom to trap,
is the core's to act on.

Allocation is split in two, so that eviction is decided before a batch is built: `claim_allocation`
checks an allocate against the instance (ids not held, the per-instance limit) and says how many ids it
takes; the core makes room for the whole batch (contention.py); `translate_allocate` then only takes
the ids from the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from l4m.scheduler.errors import InvalidCommand, NoExecutor, ResourceExhausted
from l4m.scheduler.resources import RefCountedPool, ResourceTable
from l4m.scheduler.validation import KV_PAGE, ModelLimits
from l4m.v1 import common_pb2
from l4m.wire import rules

if TYPE_CHECKING:
    from l4m.scheduler.executors import Executor

_RESOURCE_NAMES = {KV_PAGE: "kv page", common_pb2.RESOURCE_KIND_EMBED_SLOT: "embed slot"}


def resource_name(kind: int) -> str:
    return _RESOURCE_NAMES[kind]


def _unowned(what: str, virtual_id: int) -> InvalidCommand:
    return InvalidCommand(f"{what} {virtual_id} is not allocated by this instance")


def translate_ids(table: dict[int, int], virtual_ids: Iterable[int], what: str) -> list[int]:
    try:
        return [table[v] for v in virtual_ids]
    except KeyError as missing:
        raise _unowned(what, missing.args[0]) from None


def translate_one(table: dict[int, int], virtual_id: int, what: str) -> int:
    physical_id = table.get(virtual_id)
    if physical_id is None:
        raise _unowned(what, virtual_id)
    return physical_id


def frozen_pool(executor: Executor | None) -> RefCountedPool | None:
    """The executor's kv page pool when any of its pages is frozen (exported or imported), else None."""
    pool = executor.resources.kv_pages if executor is not None and executor.resources is not None else None
    return pool if pool is not None and pool.has_frozen else None


def check_writable(executor: Executor | None, virtual_ids: Sequence[int], physical_ids: list[int],
                   page_size: int, last_page_length: int = 0, num_written: int = 0) -> None:
    """Traps when a command would write into a frozen (exported or imported) page. With
    `num_written`, only the pages holding the last `num_written` token slots are written (the
    LENGTH RULE puts the new tokens at the end); without it every listed page is."""
    pool = frozen_pool(executor)
    if pool is None:  # the common case: nothing is exported on this executor
        return
    first = 0
    if num_written:
        num_slots = rules.context_slots(len(physical_ids), last_page_length, page_size)
        first = (num_slots - num_written) // page_size
    for index in range(first, len(physical_ids)):
        if pool.is_frozen(physical_ids[index]):
            raise InvalidCommand(f"kv page {virtual_ids[index]} is shared by an export (read-only): "
                                 f"copy_kv_page it into a page you own first")


# ---- one translator per executor kind: (item, instance table, executor, limits) -> item to send | None ----


def translate_forward_text(item: common_pb2.ForwardTextItem, table: ResourceTable, executor: Executor | None,
                           limits: ModelLimits) -> common_pb2.ForwardTextItem:
    virtual = item.kv_page_ids[:]  # a list: one read of the field (the hot path)
    physical = translate_ids(table.kv_pages, virtual, "kv page")
    if frozen_pool(executor) is not None:
        check_writable(executor, virtual, physical, limits.kv_page_size, item.kv_last_page_length,
                       len(item.token_ids) + item.num_continuation_steps)
    item.kv_page_ids[:] = physical
    return item


def translate_forward(item: common_pb2.ForwardItem, table: ResourceTable, executor: Executor | None,
                      limits: ModelLimits) -> common_pb2.ForwardItem:
    pages = translate_ids(table.kv_pages, item.kv_page_ids, "kv page")
    inputs = translate_ids(table.embed_slots, item.input_embed_slot_ids, "embed slot")
    outputs = translate_ids(table.embed_slots, item.output_embed_slot_ids, "embed slot")
    check_writable(executor, item.kv_page_ids, pages, limits.kv_page_size, item.kv_last_page_length, len(inputs))
    item.kv_page_ids[:] = pages
    item.input_embed_slot_ids[:] = inputs
    item.output_embed_slot_ids[:] = outputs
    return item


def translate_embed(item: common_pb2.EmbedTextItem | common_pb2.EmbedImageItem, table: ResourceTable,
                    executor: Executor | None, limits: ModelLimits) -> common_pb2.EmbedTextItem | common_pb2.EmbedImageItem:
    """embed_text and embed_image."""
    item.embed_slot_ids[:] = translate_ids(table.embed_slots, item.embed_slot_ids, "embed slot")
    return item


def translate_sample_top_k(item: common_pb2.SampleTopKItem, table: ResourceTable, executor: Executor | None,
                           limits: ModelLimits) -> common_pb2.SampleTopKItem:
    item.embed_slot_id = translate_one(table.embed_slots, item.embed_slot_id, "embed slot")
    return item


def translate_copy_kv_page(item: common_pb2.CopyKvPageItem, table: ResourceTable, executor: Executor | None,
                           limits: ModelLimits) -> common_pb2.CopyKvPageItem:
    source = translate_one(table.kv_pages, item.source_kv_page_id, "kv page")
    destination = translate_one(table.kv_pages, item.destination_kv_page_id, "kv page")
    check_writable(executor, [item.destination_kv_page_id], [destination], limits.kv_page_size)
    item.destination_kv_page_id = destination
    item.source_kv_page_id = source
    return item


def translate_mask_kv_page(item: common_pb2.MaskKvPageItem, table: ResourceTable, executor: Executor | None,
                           limits: ModelLimits) -> common_pb2.MaskKvPageItem:
    physical_id = translate_one(table.kv_pages, item.kv_page_id, "kv page")
    check_writable(executor, [item.kv_page_id], [physical_id], limits.kv_page_size)
    item.kv_page_id = physical_id
    return item


def _pool(executor: Executor | None, is_kv: bool) -> RefCountedPool:
    if executor is None or executor.resources is None:
        raise NoExecutor("no executor is connected")
    return executor.resources.kv_pages if is_kv else executor.resources.embed_slots


def translate_deallocate(item: common_pb2.DeallocateItem, table: ResourceTable, executor: Executor | None,
                         limits: ModelLimits) -> common_pb2.DeallocateItem | None:
    """Drops the instance's references; sends only the ids nobody holds any more."""
    is_kv = item.kind == KV_PAGE
    what = resource_name(item.kind)
    held = table.kv_pages if is_kv else table.embed_slots
    physical = translate_ids(held, item.ids, what)
    for virtual_id in item.ids:
        del held[virtual_id]
    freed = _pool(executor, is_kv).release(physical)
    if not freed:  # every page is still shared: the executor keeps it
        return None
    item.ids[:] = freed
    return item


def claim_allocation(item: common_pb2.AllocateItem, table: ResourceTable, limits: ModelLimits,
                     claimed: set[int]) -> int:
    """How many ids an allocate takes, after checking it against what the instance holds and what its
    earlier allocates of the same batch claimed (`claimed`, virtual ids of this kind, updated here)."""
    is_kv = item.kind == KV_PAGE
    what = resource_name(item.kind)
    held = table.kv_pages if is_kv else table.embed_slots
    for virtual_id in item.ids:
        if virtual_id in held or virtual_id in claimed:
            raise InvalidCommand(f"{what} id {virtual_id} is already allocated by this instance")
    num_ids = len(item.ids)
    limit = limits.max_kv_pages_per_instance if is_kv else limits.max_embed_slots_per_instance
    num_held = len(held) + len(claimed)
    if num_held + num_ids > limit:
        raise ResourceExhausted(
            f"allocating {num_ids} {what}s would hold {num_held + num_ids}, more than the {limit} one instance may hold"
        )
    claimed.update(item.ids)
    return num_ids


def translate_allocate(item: common_pb2.AllocateItem, table: ResourceTable, executor: Executor | None,
                       limits: ModelLimits) -> common_pb2.AllocateItem:
    """Takes the ids `claim_allocation` counted; the core made room for them before the batch was built."""
    is_kv = item.kind == KV_PAGE
    physical = _pool(executor, is_kv).allocate(len(item.ids))
    (table.kv_pages if is_kv else table.embed_slots).update(zip(item.ids, physical, strict=True))
    item.ids[:] = physical
    return item
