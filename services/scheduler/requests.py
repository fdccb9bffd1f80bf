"""Builders of `SessionRequest`s, for tests, the benchmark and examples (the SDK has its own)."""

from __future__ import annotations

from collections.abc import Sequence

from l4m.v1 import common_pb2, l4m_pb2

KV_PAGE = common_pb2.RESOURCE_KIND_KV_PAGE
EMBED_SLOT = common_pb2.RESOURCE_KIND_EMBED_SLOT


def request(request_id: int = 0, stream_id: int = 0, **command: object) -> l4m_pb2.SessionRequest:
    return l4m_pb2.SessionRequest(request_id=request_id, stream_id=stream_id, **command)  # type: ignore[arg-type]


def allocate(ids: Sequence[int], kind: int = KV_PAGE, **kw: int) -> l4m_pb2.SessionRequest:
    return request(allocate=common_pb2.AllocateItem(kind=kind, ids=ids), **kw)


def deallocate(ids: Sequence[int], kind: int = KV_PAGE, **kw: int) -> l4m_pb2.SessionRequest:
    return request(deallocate=common_pb2.DeallocateItem(kind=kind, ids=ids), **kw)


def greedy() -> common_pb2.SamplerSpec:
    return common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY)


def forward_text(
    pages: Sequence[int],
    last_page_length: int,
    tokens: Sequence[int],
    positions: Sequence[int] | None = None,
    outputs: Sequence[int] = (),
    samplers: Sequence[common_pb2.SamplerSpec] | None = None,
    masks: Sequence[Sequence[int]] = (),
    **kw: int,
) -> l4m_pb2.SessionRequest:
    """A forward_text; positions default to 0 .. len(tokens) - 1."""
    if positions is None:
        positions = list(range(len(tokens)))
    item = common_pb2.ForwardTextItem(
        kv_page_ids=pages, kv_last_page_length=last_page_length, token_ids=tokens, position_ids=positions,
        attention_masks=[common_pb2.Brle(run_lengths=m) for m in masks], output_indices=outputs,
        samplers=samplers if samplers is not None else [greedy() for _ in outputs],
    )
    return request(forward_text=item, **kw)


def synchronize(**kw: int) -> l4m_pb2.SessionRequest:
    return request(synchronize=l4m_pb2.SynchronizeCommand(), **kw)


def debug_query(query: str, **kw: int) -> l4m_pb2.SessionRequest:
    return request(debug_query=l4m_pb2.DebugQueryCommand(query=query), **kw)


def export(name: str, pages: Sequence[int], persistent: bool = False, metadata: bytes = b"", is_public: bool = False,
           pinned: bool = False, **kw: int) -> l4m_pb2.SessionRequest:
    command = l4m_pb2.ExportKvPagesCommand(name=name, kv_page_ids=pages, persistent=persistent, metadata=metadata,
                                           is_public=is_public, pinned=pinned)
    return request(export_kv_pages=command, **kw)


def unexport(name: str, **kw: int) -> l4m_pb2.SessionRequest:
    return request(unexport_kv_pages=l4m_pb2.UnexportKvPagesCommand(name=name), **kw)


def import_pages(name: str, pages: Sequence[int], **kw: int) -> l4m_pb2.SessionRequest:
    return request(import_kv_pages=l4m_pb2.ImportKvPagesCommand(name=name, kv_page_ids=pages), **kw)
