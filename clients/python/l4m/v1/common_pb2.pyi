from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResourceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESOURCE_KIND_UNSPECIFIED: _ClassVar[ResourceKind]
    RESOURCE_KIND_KV_PAGE: _ClassVar[ResourceKind]
    RESOURCE_KIND_EMBED_SLOT: _ClassVar[ResourceKind]

class SamplerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLER_KIND_UNSPECIFIED: _ClassVar[SamplerKind]
    SAMPLER_KIND_DISTRIBUTION: _ClassVar[SamplerKind]
    SAMPLER_KIND_GREEDY: _ClassVar[SamplerKind]
    SAMPLER_KIND_SAMPLE: _ClassVar[SamplerKind]
RESOURCE_KIND_UNSPECIFIED: ResourceKind
RESOURCE_KIND_KV_PAGE: ResourceKind
RESOURCE_KIND_EMBED_SLOT: ResourceKind
SAMPLER_KIND_UNSPECIFIED: SamplerKind
SAMPLER_KIND_DISTRIBUTION: SamplerKind
SAMPLER_KIND_GREEDY: SamplerKind
SAMPLER_KIND_SAMPLE: SamplerKind

class Brle(_message.Message):
    __slots__ = ("run_lengths",)
    RUN_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    run_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, run_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplerSpec(_message.Message):
    __slots__ = ("kind", "distribution_top_k", "temperature", "top_k", "top_p", "min_p", "seed", "vocabulary_mask", "logit_bias_token_ids", "logit_bias_values", "top_logprobs")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTION_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    VOCABULARY_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    kind: SamplerKind
    distribution_top_k: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    vocabulary_mask: Brle
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: int
    def __init__(self, kind: _Optional[_Union[SamplerKind, str]] = ..., distribution_top_k: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., vocabulary_mask: _Optional[_Union[Brle, _Mapping]] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("token_ids", "probabilities")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probabilities: _Optional[_Iterable[float]] = ...) -> None: ...

class OutputResult(_message.Message):
    __slots__ = ("token", "distribution")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    token: SampledToken
    distribution: Distribution
    def __init__(self, token: _Optional[_Union[SampledToken, _Mapping]] = ..., distribution: _Optional[_Union[Distribution, _Mapping]] = ...) -> None: ...

class AllocateItem(_message.Message):
    __slots__ = ("kind", "ids", "max_wait_ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    kind: ResourceKind
    ids: _containers.RepeatedScalarFieldContainer[int]
    max_wait_ms: int
    def __init__(self, kind: _Optional[_Union[ResourceKind, str]] = ..., ids: _Optional[_Iterable[int]] = ..., max_wait_ms: _Optional[int] = ...) -> None: ...

class DeallocateItem(_message.Message):
    __slots__ = ("kind", "ids")
    KIND_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    kind: ResourceKind
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[ResourceKind, str]] = ..., ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedTextItem(_message.Message):
    __slots__ = ("embed_slot_ids", "token_ids", "position_ids")
    EMBED_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    embed_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    position_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, embed_slot_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., position_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardItem(_message.Message):
    __slots__ = ("kv_page_ids", "kv_last_page_length", "input_embed_slot_ids", "output_indices", "output_embed_slot_ids")
    KV_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_LAST_PAGE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    INPUT_EMBED_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDICES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_EMBED_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    kv_page_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_last_page_length: int
    input_embed_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    output_indices: _containers.RepeatedScalarFieldContainer[int]
    output_embed_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_page_ids: _Optional[_Iterable[int]] = ..., kv_last_page_length: _Optional[int] = ..., input_embed_slot_ids: _Optional[_Iterable[int]] = ..., output_indices: _Optional[_Iterable[int]] = ..., output_embed_slot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardTextItem(_message.Message):
    __slots__ = ("kv_page_ids", "kv_last_page_length", "token_ids", "position_ids", "attention_masks", "output_indices", "samplers", "num_continuation_steps", "continuation_stop_token_ids")
    KV_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_LAST_PAGE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDICES_FIELD_NUMBER: _ClassVar[int]
    SAMPLERS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONTINUATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    kv_page_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_last_page_length: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    position_ids: _containers.RepeatedScalarFieldContainer[int]
    attention_masks: _containers.RepeatedCompositeFieldContainer[Brle]
    output_indices: _containers.RepeatedScalarFieldContainer[int]
    samplers: _containers.RepeatedCompositeFieldContainer[SamplerSpec]
    num_continuation_steps: int
    continuation_stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kv_page_ids: _Optional[_Iterable[int]] = ..., kv_last_page_length: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., position_ids: _Optional[_Iterable[int]] = ..., attention_masks: _Optional[_Iterable[_Union[Brle, _Mapping]]] = ..., output_indices: _Optional[_Iterable[int]] = ..., samplers: _Optional[_Iterable[_Union[SamplerSpec, _Mapping]]] = ..., num_continuation_steps: _Optional[int] = ..., continuation_stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardTextResult(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[OutputResult]
    def __init__(self, outputs: _Optional[_Iterable[_Union[OutputResult, _Mapping]]] = ...) -> None: ...

class SampleTopKItem(_message.Message):
    __slots__ = ("embed_slot_id", "k")
    EMBED_SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    embed_slot_id: int
    k: int
    def __init__(self, embed_slot_id: _Optional[int] = ..., k: _Optional[int] = ...) -> None: ...

class CopyKvPageItem(_message.Message):
    __slots__ = ("source_kv_page_id", "destination_kv_page_id", "source_offset_tokens", "destination_offset_tokens", "length_tokens")
    SOURCE_KV_PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_KV_PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_OFFSET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_OFFSET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    source_kv_page_id: int
    destination_kv_page_id: int
    source_offset_tokens: int
    destination_offset_tokens: int
    length_tokens: int
    def __init__(self, source_kv_page_id: _Optional[int] = ..., destination_kv_page_id: _Optional[int] = ..., source_offset_tokens: _Optional[int] = ..., destination_offset_tokens: _Optional[int] = ..., length_tokens: _Optional[int] = ...) -> None: ...

class MaskKvPageItem(_message.Message):
    __slots__ = ("kv_page_id", "visibility")
    KV_PAGE_ID_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    kv_page_id: int
    visibility: Brle
    def __init__(self, kv_page_id: _Optional[int] = ..., visibility: _Optional[_Union[Brle, _Mapping]] = ...) -> None: ...

class EmbedImageItem(_message.Message):
    __slots__ = ("embed_slot_ids", "image_bytes", "position_offset")
    EMBED_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    POSITION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    embed_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    image_bytes: bytes
    position_offset: int
    def __init__(self, embed_slot_ids: _Optional[_Iterable[int]] = ..., image_bytes: _Optional[bytes] = ..., position_offset: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "vocab_size", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "max_context_tokens", "tokenizer_json", "chat_template", "stop_token_ids", "special_token_ids", "capabilities", "chat_template_variables", "tokenizer_sha256")
    class SpecialTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ChatTemplateVariablesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_tokens: int
    tokenizer_json: str
    chat_template: str
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    special_token_ids: _containers.ScalarMap[str, int]
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    chat_template_variables: _containers.ScalarMap[str, str]
    tokenizer_sha256: str
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., tokenizer_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., special_token_ids: _Optional[_Mapping[str, int]] = ..., capabilities: _Optional[_Iterable[str]] = ..., chat_template_variables: _Optional[_Mapping[str, str]] = ..., tokenizer_sha256: _Optional[str] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...
