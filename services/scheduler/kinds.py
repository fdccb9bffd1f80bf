"""The table of command kinds: everything the scheduler knows about each L4M command, in one place.

One `Kind` per field of `SessionRequest.command`, typed by its message: its shape check (validation.py),
the capability and trust checks it needs, where it runs (translated and sent to an executor, or run here
as a local command), whether its batches are answered, whether it is a forward pass, the tokens it feeds
and the kv pages it names, and the chunks a command too long for one batch runs as. This module and the functions it names are the only ones that read the
commands' protobuf fields; the core looks a kind up here instead of testing its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from google.protobuf.message import Message

from l4m.scheduler import exports, local, prefill, translate, validation
from l4m.scheduler.errors import Unsupported
from l4m.scheduler.validation import KV_PAGE, ModelLimits
from l4m.v1 import common_pb2, l4m_pb2

if TYPE_CHECKING:  # the handlers' argument types; those modules import this one
    from l4m.scheduler.batcher import Command
    from l4m.scheduler.executors import Executor
    from l4m.scheduler.instances import Instance
    from l4m.scheduler.local import SchedulerView
    from l4m.scheduler.outbound import LocalOutcome
    from l4m.scheduler.prefill import ChunkedPrefill
    from l4m.scheduler.resources import ResourceTable

M = TypeVar("M", bound=Message)

# Returns the reply's cost, (distribution entries, bytes) as `l4m.wire.limits.reply_cost` counts it, when the
# check computed it on the way (the batcher needs it too), else None.
Check = Callable[[M, ModelLimits], "tuple[int, int] | None"]
# Rewrites the item's virtual ids in place (instance table, its executor or None when unbound); returns
# what to send, or None when nothing must be.
Translate = Callable[[M, "ResourceTable", "Executor | None", ModelLimits], "M | None"]
RunLocal = Callable[["SchedulerView", "Command", M], "LocalOutcome"]
Permit = Callable[["Instance", M], None]
# A command too long for one batch as consecutive chunks (prefill.py); None when it fits one.
Split = Callable[[M, ModelLimits, int], "ChunkedPrefill | None"]  # (item, limits, num_tokens)


def _zero(item: Message) -> int:
    return 0


def _always(item: Message) -> bool:
    return True


def _never(item: Message) -> bool:
    return False


@dataclass(frozen=True)
class Kind(Generic[M]):
    """One command kind. Exactly one of `translate` (an executor kind) and `run_local` is set."""

    name: str  # the SessionRequest field, also the ExecuteRequest field of executor kinds
    check: Check[M]  # its shape against the model's limits, when it arrives (see `Check`)
    translate: Translate[M] | None = None  # virtual -> physical ids when its batch is built
    run_local: RunLocal[M] | None = None  # runs in the scheduler at the head of its stream
    capability: str | None = None  # the model capability it needs (Unsupported without it)
    permit: Permit[M] | None = None  # trust: who may run it, checked at the head of its stream
    is_forward: bool = False  # batched with the forward strategy; one pass in flight per executor
    is_replied: bool = False  # the executor answers its batches
    has_reply: Callable[[M], bool] = _never  # the command gets a reply event of its own
    is_sharing: bool = False  # changes what the instance's pages mean to others (blame: `_on_batch_error`)
    # Translating it returns ids to the pools: once translated it must reach the executor, even when its
    # instance was trapped meanwhile or its batch is rejected for another item.
    frees_when_translated: bool = False
    num_tokens: Callable[[M], int] = _zero  # tokens it feeds (charged to the budgets when sent)
    num_kv_pages: Callable[[M], int] = _zero  # kv pages it names (a span attribute)
    split: Split[M] | None = None  # chunks it runs as when it is too long for one batch

    @property
    def is_executor_kind(self) -> bool:
        return self.translate is not None

    def check_capability(self, limits: ModelLimits) -> None:
        if self.capability is not None and self.capability not in limits.capabilities:
            raise Unsupported(f"{self.name} needs the {self.capability!r} capability; this model has only "
                              + ", ".join(sorted(limits.capabilities)))


def _forward_text_tokens(item: common_pb2.ForwardTextItem) -> int:
    """Its tokens and every continuation step (the budget is spent up front)."""
    return len(item.token_ids) + item.num_continuation_steps


def _forward_tokens(item: common_pb2.ForwardItem) -> int:
    return len(item.input_embed_slot_ids)


def _split_forward_text(item: common_pb2.ForwardTextItem, limits: ModelLimits,
                        num_tokens: int) -> ChunkedPrefill | None:
    """`num_tokens`: `_forward_text_tokens`'s count (steps included), at least the item's tokens: an item
    whose count fits one chunk is not read again."""
    if not limits.prefill_chunk_tokens or num_tokens <= limits.prefill_chunk_tokens:
        return None
    return prefill.split_forward_text(item, limits.kv_page_size, limits.prefill_chunk_tokens,
                                      limits.prefill_chunk_token_slots)


def _has_outputs(item: common_pb2.ForwardTextItem) -> bool:
    """forward_text batches are answered even without outputs, so that every forward pass counts as in
    flight (the adaptive strategy fires the next one when none is); only items with outputs are replied."""
    return len(item.output_indices) > 0


def _kv_page_list(item: common_pb2.ForwardTextItem | common_pb2.ForwardItem | l4m_pb2.ExportKvPagesCommand
                  | l4m_pb2.ImportKvPagesCommand) -> int:
    return len(item.kv_page_ids)


def _kv_ids(item: common_pb2.AllocateItem | common_pb2.DeallocateItem) -> int:
    return len(item.ids) if item.kind == KV_PAGE else 0


_KINDS: tuple[Kind[Any], ...] = (  # executor kinds first, in the order their batch queues fire
    Kind[common_pb2.AllocateItem](
        "allocate", validation.check_allocation, translate.translate_allocate, num_kv_pages=_kv_ids),
    Kind[common_pb2.DeallocateItem](
        "deallocate", validation.check_allocation, translate.translate_deallocate, frees_when_translated=True,
        num_kv_pages=_kv_ids),
    Kind[common_pb2.EmbedTextItem]("embed_text", validation.check_embed_text, translate.translate_embed),
    Kind[common_pb2.ForwardItem](
        "forward", validation.check_forward, translate.translate_forward, is_forward=True, is_replied=True,
        has_reply=_always, num_tokens=_forward_tokens, num_kv_pages=_kv_page_list),
    Kind[common_pb2.ForwardTextItem](
        "forward_text", validation.check_forward_text, translate.translate_forward_text, is_forward=True,
        is_replied=True, has_reply=_has_outputs, num_tokens=_forward_text_tokens, num_kv_pages=_kv_page_list,
        split=_split_forward_text),
    Kind[common_pb2.SampleTopKItem](
        "sample_top_k", validation.check_sample_top_k, translate.translate_sample_top_k, is_replied=True,
        has_reply=_always),
    Kind[common_pb2.CopyKvPageItem](
        "copy_kv_page", validation.check_copy_kv_page, translate.translate_copy_kv_page,
        num_kv_pages=lambda item: 2),
    Kind[common_pb2.MaskKvPageItem](
        "mask_kv_page", validation.check_mask_kv_page, translate.translate_mask_kv_page,
        num_kv_pages=lambda item: 1),
    Kind[common_pb2.EmbedImageItem](
        "embed_image", validation.check_embed_image, translate.translate_embed, capability="vision"),
    Kind[l4m_pb2.GetInfoCommand]("get_info", validation.check_nothing, run_local=local.run_get_info),
    Kind[l4m_pb2.ExportKvPagesCommand](
        "export_kv_pages", validation.check_export, run_local=exports.run_export, is_sharing=True,
        num_kv_pages=_kv_page_list),
    Kind[l4m_pb2.UnexportKvPagesCommand](
        "unexport_kv_pages", validation.check_unexport, run_local=exports.run_unexport, is_sharing=True),
    Kind[l4m_pb2.ImportKvPagesCommand](
        "import_kv_pages", validation.check_import, run_local=exports.run_import, is_sharing=True,
        num_kv_pages=_kv_page_list),
    Kind[l4m_pb2.ListExportsCommand]("list_exports", validation.check_nothing, run_local=exports.run_list_exports),
    Kind[l4m_pb2.SynchronizeCommand]("synchronize", validation.check_nothing, run_local=local.run_synchronize),
    Kind[l4m_pb2.SetStreamPriorityCommand](
        "set_stream_priority", validation.check_set_stream_priority, run_local=local.run_set_stream_priority),
    Kind[l4m_pb2.DebugQueryCommand](
        "debug_query", validation.check_debug_query, run_local=local.run_debug_query,
        permit=local.permit_debug_query),
)

KINDS: dict[str, Kind[Any]] = {kind.name: kind for kind in _KINDS}
# The kinds an executor runs, in the order the executor's batch queues are made.
EXECUTOR_KINDS: tuple[str, ...] = tuple(kind.name for kind in _KINDS if kind.is_executor_kind)
