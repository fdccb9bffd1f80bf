from l4m.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutorServiceResetRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorServiceResetResponse(_message.Message):
    __slots__ = ("num_kv_pages_freed", "num_embed_slots_freed")
    NUM_KV_PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBED_SLOTS_FREED_FIELD_NUMBER: _ClassVar[int]
    num_kv_pages_freed: int
    num_embed_slots_freed: int
    def __init__(self, num_kv_pages_freed: _Optional[int] = ..., num_embed_slots_freed: _Optional[int] = ...) -> None: ...

class ExecutorServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExecutorServiceGetInfoResponse(_message.Message):
    __slots__ = ("model", "device", "dtype", "kv_page_size", "num_kv_pages", "num_embed_slots", "max_batch_tokens", "max_request_bytes", "max_reply_bytes", "max_distribution_entries_per_batch", "framed_execute_path", "num_swap_slots")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_DISTRIBUTION_ENTRIES_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    FRAMED_EXECUTE_PATH_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_SLOTS_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    device: str
    dtype: str
    kv_page_size: int
    num_kv_pages: int
    num_embed_slots: int
    max_batch_tokens: int
    max_request_bytes: int
    max_reply_bytes: int
    max_distribution_entries_per_batch: int
    framed_execute_path: str
    num_swap_slots: int
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_page_size: _Optional[int] = ..., num_kv_pages: _Optional[int] = ..., num_embed_slots: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_reply_bytes: _Optional[int] = ..., max_distribution_entries_per_batch: _Optional[int] = ..., framed_execute_path: _Optional[str] = ..., num_swap_slots: _Optional[int] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("correlation_id", "trace_context", "allocate", "deallocate", "embed_text", "forward", "forward_text", "sample_top_k", "copy_kv_page", "mask_kv_page", "embed_image", "debug_query", "swap_out", "swap_in")
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    DEALLOCATE_FIELD_NUMBER: _ClassVar[int]
    EMBED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    COPY_KV_PAGE_FIELD_NUMBER: _ClassVar[int]
    MASK_KV_PAGE_FIELD_NUMBER: _ClassVar[int]
    EMBED_IMAGE_FIELD_NUMBER: _ClassVar[int]
    DEBUG_QUERY_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    correlation_id: int
    trace_context: _common_pb2.TraceContext
    allocate: BatchAllocate
    deallocate: BatchDeallocate
    embed_text: BatchEmbedText
    forward: BatchForward
    forward_text: BatchForwardText
    sample_top_k: BatchSampleTopK
    copy_kv_page: BatchCopyKvPage
    mask_kv_page: BatchMaskKvPage
    embed_image: BatchEmbedImage
    debug_query: BatchDebugQuery
    swap_out: BatchSwapOut
    swap_in: BatchSwapIn
    def __init__(self, correlation_id: _Optional[int] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., allocate: _Optional[_Union[BatchAllocate, _Mapping]] = ..., deallocate: _Optional[_Union[BatchDeallocate, _Mapping]] = ..., embed_text: _Optional[_Union[BatchEmbedText, _Mapping]] = ..., forward: _Optional[_Union[BatchForward, _Mapping]] = ..., forward_text: _Optional[_Union[BatchForwardText, _Mapping]] = ..., sample_top_k: _Optional[_Union[BatchSampleTopK, _Mapping]] = ..., copy_kv_page: _Optional[_Union[BatchCopyKvPage, _Mapping]] = ..., mask_kv_page: _Optional[_Union[BatchMaskKvPage, _Mapping]] = ..., embed_image: _Optional[_Union[BatchEmbedImage, _Mapping]] = ..., debug_query: _Optional[_Union[BatchDebugQuery, _Mapping]] = ..., swap_out: _Optional[_Union[BatchSwapOut, _Mapping]] = ..., swap_in: _Optional[_Union[BatchSwapIn, _Mapping]] = ...) -> None: ...

class BatchAllocate(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.AllocateItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.AllocateItem, _Mapping]]] = ...) -> None: ...

class BatchDeallocate(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.DeallocateItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.DeallocateItem, _Mapping]]] = ...) -> None: ...

class BatchEmbedText(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbedTextItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.EmbedTextItem, _Mapping]]] = ...) -> None: ...

class BatchForward(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.ForwardItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.ForwardItem, _Mapping]]] = ...) -> None: ...

class BatchForwardText(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.ForwardTextItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.ForwardTextItem, _Mapping]]] = ...) -> None: ...

class BatchSampleTopK(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.SampleTopKItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.SampleTopKItem, _Mapping]]] = ...) -> None: ...

class BatchCopyKvPage(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.CopyKvPageItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.CopyKvPageItem, _Mapping]]] = ...) -> None: ...

class BatchMaskKvPage(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.MaskKvPageItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.MaskKvPageItem, _Mapping]]] = ...) -> None: ...

class BatchEmbedImage(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbedImageItem]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.EmbedImageItem, _Mapping]]] = ...) -> None: ...

class BatchDebugQuery(_message.Message):
    __slots__ = ("queries",)
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    queries: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queries: _Optional[_Iterable[str]] = ...) -> None: ...

class SwapItem(_message.Message):
    __slots__ = ("kv_page_ids", "swap_slot_ids")
    KV_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    kv_page_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_page_ids: _Optional[_Iterable[int]] = ..., swap_slot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchSwapOut(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SwapItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SwapItem, _Mapping]]] = ...) -> None: ...

class BatchSwapIn(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SwapItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SwapItem, _Mapping]]] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("correlation_id", "error", "forward_text", "forward", "sample_top_k", "debug_query")
    CORRELATION_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TEXT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    DEBUG_QUERY_FIELD_NUMBER: _ClassVar[int]
    correlation_id: int
    error: BatchError
    forward_text: BatchForwardTextResult
    forward: BatchForwardResult
    sample_top_k: BatchSampleTopKResult
    debug_query: BatchDebugQueryResult
    def __init__(self, correlation_id: _Optional[int] = ..., error: _Optional[_Union[BatchError, _Mapping]] = ..., forward_text: _Optional[_Union[BatchForwardTextResult, _Mapping]] = ..., forward: _Optional[_Union[BatchForwardResult, _Mapping]] = ..., sample_top_k: _Optional[_Union[BatchSampleTopKResult, _Mapping]] = ..., debug_query: _Optional[_Union[BatchDebugQueryResult, _Mapping]] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("item_index", "reason", "is_unsupported", "has_item_index")
    ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IS_UNSUPPORTED_FIELD_NUMBER: _ClassVar[int]
    HAS_ITEM_INDEX_FIELD_NUMBER: _ClassVar[int]
    item_index: int
    reason: str
    is_unsupported: bool
    has_item_index: bool
    def __init__(self, item_index: _Optional[int] = ..., reason: _Optional[str] = ..., is_unsupported: _Optional[bool] = ..., has_item_index: _Optional[bool] = ...) -> None: ...

class BatchForwardTextResult(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.ForwardTextResult]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.ForwardTextResult, _Mapping]]] = ...) -> None: ...

class BatchForwardResult(_message.Message):
    __slots__ = ("num_items",)
    NUM_ITEMS_FIELD_NUMBER: _ClassVar[int]
    num_items: int
    def __init__(self, num_items: _Optional[int] = ...) -> None: ...

class BatchSampleTopKResult(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_common_pb2.Distribution]
    def __init__(self, items: _Optional[_Iterable[_Union[_common_pb2.Distribution, _Mapping]]] = ...) -> None: ...

class BatchDebugQueryResult(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, responses: _Optional[_Iterable[str]] = ...) -> None: ...

class FramedExecuteOpen(_message.Message):
    __slots__ = ("protocol_version", "cluster_secret")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_SECRET_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    cluster_secret: str
    def __init__(self, protocol_version: _Optional[str] = ..., cluster_secret: _Optional[str] = ...) -> None: ...
