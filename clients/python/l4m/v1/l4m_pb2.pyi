from l4m.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamPriority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM_PRIORITY_UNSPECIFIED: _ClassVar[StreamPriority]
    STREAM_PRIORITY_LOW: _ClassVar[StreamPriority]
    STREAM_PRIORITY_NORMAL: _ClassVar[StreamPriority]
    STREAM_PRIORITY_HIGH: _ClassVar[StreamPriority]

class TrapKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAP_KIND_UNSPECIFIED: _ClassVar[TrapKind]
    TRAP_KIND_INVALID_COMMAND: _ClassVar[TrapKind]
    TRAP_KIND_RESOURCE_EXHAUSTED: _ClassVar[TrapKind]
    TRAP_KIND_EVICTED: _ClassVar[TrapKind]
    TRAP_KIND_EXECUTOR_LOST: _ClassVar[TrapKind]
    TRAP_KIND_DESTROYED: _ClassVar[TrapKind]
    TRAP_KIND_TOKEN_BUDGET: _ClassVar[TrapKind]
    TRAP_KIND_UNSUPPORTED: _ClassVar[TrapKind]
    TRAP_KIND_PERMISSION_DENIED: _ClassVar[TrapKind]
STREAM_PRIORITY_UNSPECIFIED: StreamPriority
STREAM_PRIORITY_LOW: StreamPriority
STREAM_PRIORITY_NORMAL: StreamPriority
STREAM_PRIORITY_HIGH: StreamPriority
TRAP_KIND_UNSPECIFIED: TrapKind
TRAP_KIND_INVALID_COMMAND: TrapKind
TRAP_KIND_RESOURCE_EXHAUSTED: TrapKind
TRAP_KIND_EVICTED: TrapKind
TRAP_KIND_EXECUTOR_LOST: TrapKind
TRAP_KIND_DESTROYED: TrapKind
TRAP_KIND_TOKEN_BUDGET: TrapKind
TRAP_KIND_UNSUPPORTED: TrapKind
TRAP_KIND_PERMISSION_DENIED: TrapKind

class GetInfoRequest(_message.Message):
    __slots__ = ("omit_tokenizer_json", "model")
    OMIT_TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    omit_tokenizer_json: bool
    model: str
    def __init__(self, omit_tokenizer_json: _Optional[bool] = ..., model: _Optional[str] = ...) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("protocol_version", "model", "kv_page_size", "max_kv_pages_per_instance", "max_embed_slots_per_instance", "num_free_kv_pages", "num_executors", "max_continuation_steps", "max_distribution_entries_per_command", "max_tokens_per_command", "max_command_bytes", "max_response_bytes", "max_mask_runs_per_command", "model_names", "max_batch_tokens", "prefill_chunk_tokens", "max_tokens_per_forward_text")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_PAGES_PER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    MAX_EMBED_SLOTS_PER_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_EXECUTORS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTINUATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_DISTRIBUTION_ENTRIES_PER_COMMAND_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_COMMAND_FIELD_NUMBER: _ClassVar[int]
    MAX_COMMAND_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MASK_RUNS_PER_COMMAND_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_FORWARD_TEXT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    model: _common_pb2.ModelInfo
    kv_page_size: int
    max_kv_pages_per_instance: int
    max_embed_slots_per_instance: int
    num_free_kv_pages: int
    num_executors: int
    max_continuation_steps: int
    max_distribution_entries_per_command: int
    max_tokens_per_command: int
    max_command_bytes: int
    max_response_bytes: int
    max_mask_runs_per_command: int
    model_names: _containers.RepeatedScalarFieldContainer[str]
    max_batch_tokens: int
    prefill_chunk_tokens: int
    max_tokens_per_forward_text: int
    def __init__(self, protocol_version: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., kv_page_size: _Optional[int] = ..., max_kv_pages_per_instance: _Optional[int] = ..., max_embed_slots_per_instance: _Optional[int] = ..., num_free_kv_pages: _Optional[int] = ..., num_executors: _Optional[int] = ..., max_continuation_steps: _Optional[int] = ..., max_distribution_entries_per_command: _Optional[int] = ..., max_tokens_per_command: _Optional[int] = ..., max_command_bytes: _Optional[int] = ..., max_response_bytes: _Optional[int] = ..., max_mask_runs_per_command: _Optional[int] = ..., model_names: _Optional[_Iterable[str]] = ..., max_batch_tokens: _Optional[int] = ..., prefill_chunk_tokens: _Optional[int] = ..., max_tokens_per_forward_text: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("stream_id", "request_id", "get_info", "allocate", "deallocate", "embed_text", "forward", "forward_text", "sample_top_k", "copy_kv_page", "mask_kv_page", "export_kv_pages", "unexport_kv_pages", "import_kv_pages", "list_exports", "synchronize", "set_stream_priority", "embed_image", "debug_query")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GET_INFO_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    DEALLOCATE_FIELD_NUMBER: _ClassVar[int]
    EMBED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    COPY_KV_PAGE_FIELD_NUMBER: _ClassVar[int]
    MASK_KV_PAGE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    UNEXPORT_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    IMPORT_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    LIST_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZE_FIELD_NUMBER: _ClassVar[int]
    SET_STREAM_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    EMBED_IMAGE_FIELD_NUMBER: _ClassVar[int]
    DEBUG_QUERY_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request_id: int
    get_info: GetInfoCommand
    allocate: _common_pb2.AllocateItem
    deallocate: _common_pb2.DeallocateItem
    embed_text: _common_pb2.EmbedTextItem
    forward: _common_pb2.ForwardItem
    forward_text: _common_pb2.ForwardTextItem
    sample_top_k: _common_pb2.SampleTopKItem
    copy_kv_page: _common_pb2.CopyKvPageItem
    mask_kv_page: _common_pb2.MaskKvPageItem
    export_kv_pages: ExportKvPagesCommand
    unexport_kv_pages: UnexportKvPagesCommand
    import_kv_pages: ImportKvPagesCommand
    list_exports: ListExportsCommand
    synchronize: SynchronizeCommand
    set_stream_priority: SetStreamPriorityCommand
    embed_image: _common_pb2.EmbedImageItem
    debug_query: DebugQueryCommand
    def __init__(self, stream_id: _Optional[int] = ..., request_id: _Optional[int] = ..., get_info: _Optional[_Union[GetInfoCommand, _Mapping]] = ..., allocate: _Optional[_Union[_common_pb2.AllocateItem, _Mapping]] = ..., deallocate: _Optional[_Union[_common_pb2.DeallocateItem, _Mapping]] = ..., embed_text: _Optional[_Union[_common_pb2.EmbedTextItem, _Mapping]] = ..., forward: _Optional[_Union[_common_pb2.ForwardItem, _Mapping]] = ..., forward_text: _Optional[_Union[_common_pb2.ForwardTextItem, _Mapping]] = ..., sample_top_k: _Optional[_Union[_common_pb2.SampleTopKItem, _Mapping]] = ..., copy_kv_page: _Optional[_Union[_common_pb2.CopyKvPageItem, _Mapping]] = ..., mask_kv_page: _Optional[_Union[_common_pb2.MaskKvPageItem, _Mapping]] = ..., export_kv_pages: _Optional[_Union[ExportKvPagesCommand, _Mapping]] = ..., unexport_kv_pages: _Optional[_Union[UnexportKvPagesCommand, _Mapping]] = ..., import_kv_pages: _Optional[_Union[ImportKvPagesCommand, _Mapping]] = ..., list_exports: _Optional[_Union[ListExportsCommand, _Mapping]] = ..., synchronize: _Optional[_Union[SynchronizeCommand, _Mapping]] = ..., set_stream_priority: _Optional[_Union[SetStreamPriorityCommand, _Mapping]] = ..., embed_image: _Optional[_Union[_common_pb2.EmbedImageItem, _Mapping]] = ..., debug_query: _Optional[_Union[DebugQueryCommand, _Mapping]] = ...) -> None: ...

class GetInfoCommand(_message.Message):
    __slots__ = ("omit_tokenizer_json",)
    OMIT_TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    omit_tokenizer_json: bool
    def __init__(self, omit_tokenizer_json: _Optional[bool] = ...) -> None: ...

class ExportKvPagesCommand(_message.Message):
    __slots__ = ("name", "kv_page_ids", "persistent", "metadata", "is_public", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    kv_page_ids: _containers.RepeatedScalarFieldContainer[int]
    persistent: bool
    metadata: bytes
    is_public: bool
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., kv_page_ids: _Optional[_Iterable[int]] = ..., persistent: _Optional[bool] = ..., metadata: _Optional[bytes] = ..., is_public: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class UnexportKvPagesCommand(_message.Message):
    __slots__ = ("name", "missing_ok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    name: str
    missing_ok: bool
    def __init__(self, name: _Optional[str] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class ImportKvPagesCommand(_message.Message):
    __slots__ = ("name", "kv_page_ids", "missing_ok")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    name: str
    kv_page_ids: _containers.RepeatedScalarFieldContainer[int]
    missing_ok: bool
    def __init__(self, name: _Optional[str] = ..., kv_page_ids: _Optional[_Iterable[int]] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class ListExportsCommand(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SynchronizeCommand(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetStreamPriorityCommand(_message.Message):
    __slots__ = ("priority",)
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    priority: StreamPriority
    def __init__(self, priority: _Optional[_Union[StreamPriority, str]] = ...) -> None: ...

class DebugQueryCommand(_message.Message):
    __slots__ = ("query",)
    QUERY_FIELD_NUMBER: _ClassVar[int]
    query: str
    def __init__(self, query: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("stream_id", "request_id", "info", "forward_text", "forward", "sample_top_k", "import_kv_pages", "list_exports", "synchronize", "debug_query", "trap")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    FORWARD_TEXT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    IMPORT_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    LIST_EXPORTS_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZE_FIELD_NUMBER: _ClassVar[int]
    DEBUG_QUERY_FIELD_NUMBER: _ClassVar[int]
    TRAP_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    request_id: int
    info: GetInfoResponse
    forward_text: _common_pb2.ForwardTextResult
    forward: ForwardDone
    sample_top_k: _common_pb2.Distribution
    import_kv_pages: ImportKvPagesResult
    list_exports: ListExportsResult
    synchronize: SynchronizeDone
    debug_query: DebugQueryResult
    trap: Trap
    def __init__(self, stream_id: _Optional[int] = ..., request_id: _Optional[int] = ..., info: _Optional[_Union[GetInfoResponse, _Mapping]] = ..., forward_text: _Optional[_Union[_common_pb2.ForwardTextResult, _Mapping]] = ..., forward: _Optional[_Union[ForwardDone, _Mapping]] = ..., sample_top_k: _Optional[_Union[_common_pb2.Distribution, _Mapping]] = ..., import_kv_pages: _Optional[_Union[ImportKvPagesResult, _Mapping]] = ..., list_exports: _Optional[_Union[ListExportsResult, _Mapping]] = ..., synchronize: _Optional[_Union[SynchronizeDone, _Mapping]] = ..., debug_query: _Optional[_Union[DebugQueryResult, _Mapping]] = ..., trap: _Optional[_Union[Trap, _Mapping]] = ...) -> None: ...

class ForwardDone(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ImportKvPagesResult(_message.Message):
    __slots__ = ("num_kv_pages", "metadata", "is_missing")
    NUM_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    IS_MISSING_FIELD_NUMBER: _ClassVar[int]
    num_kv_pages: int
    metadata: bytes
    is_missing: bool
    def __init__(self, num_kv_pages: _Optional[int] = ..., metadata: _Optional[bytes] = ..., is_missing: _Optional[bool] = ...) -> None: ...

class ListExportsResult(_message.Message):
    __slots__ = ("exports",)
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    exports: _containers.RepeatedCompositeFieldContainer[ExportInfo]
    def __init__(self, exports: _Optional[_Iterable[_Union[ExportInfo, _Mapping]]] = ...) -> None: ...

class ExportInfo(_message.Message):
    __slots__ = ("name", "num_kv_pages", "persistent", "metadata_bytes", "is_public", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PERSISTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    IS_PUBLIC_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_kv_pages: int
    persistent: bool
    metadata_bytes: int
    is_public: bool
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., num_kv_pages: _Optional[int] = ..., persistent: _Optional[bool] = ..., metadata_bytes: _Optional[int] = ..., is_public: _Optional[bool] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SynchronizeDone(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DebugQueryResult(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: str
    def __init__(self, response: _Optional[str] = ...) -> None: ...

class Trap(_message.Message):
    __slots__ = ("kind", "reason", "offending_request_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OFFENDING_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    kind: TrapKind
    reason: str
    offending_request_id: int
    def __init__(self, kind: _Optional[_Union[TrapKind, str]] = ..., reason: _Optional[str] = ..., offending_request_id: _Optional[int] = ...) -> None: ...

class FramedSessionOpen(_message.Message):
    __slots__ = ("protocol_version", "instance_token", "traceparent", "model")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    protocol_version: str
    instance_token: str
    traceparent: str
    model: str
    def __init__(self, protocol_version: _Optional[str] = ..., instance_token: _Optional[str] = ..., traceparent: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class FramedSessionStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
