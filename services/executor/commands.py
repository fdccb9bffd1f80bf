"""Batched executor commands and their results, as plain frozen dataclasses with physical ids.

The scheduler has already translated every controller-visible id into a physical one; the executor
only checks them again (defense in depth). One batch is a sequence of items of one command class.

Context arithmetic of `ForwardText` / `Forward` (shared with the proto): the item's total context is
`page_size * (len(kv_page_ids) - 1) + kv_last_page_length` and INCLUDES the new tokens, so the
caller grows its pages first. With `num_ctx = total - num_new`, new token `i` is written at slot
`num_ctx + i` of the page list, and its attention-mask row decodes to exactly `num_ctx + i + 1`
values (BRLE, first run visible). Output index `j` yields the next-token distribution after token `j`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ResourceKind(enum.StrEnum):
    KV_PAGE = "kv_page"
    EMBED_SLOT = "embed_slot"


class SamplerKind(enum.StrEnum):
    DISTRIBUTION = "distribution"  # top `distribution_top_k` ids + probabilities, sorted descending
    GREEDY = "greedy"
    SAMPLE = "sample"  # temperature, then top_k / top_p / min_p truncation, optionally seeded


@dataclass(frozen=True)
class SamplerSpec:
    """How to turn one output's logits into a result.

    `vocab_mask` is a BRLE over the vocabulary (first run = allowed); masked tokens get -inf before
    anything else, including the returned logprob (log-softmax at temperature 1).
    `top_k == 0`, `top_p` of 0 or >= 1 and `min_p == 0` switch that filter off.
    `logit_bias_values[i]` is added to the logit of `logit_bias_token_ids[i]` before the mask (so every
    probability and logprob returned is of the biased distribution); `top_logprobs` > 0 (GREEDY, SAMPLE)
    returns that many most probable tokens of the step beside the sampled one.
    """

    kind: SamplerKind = SamplerKind.GREEDY
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    seed: int | None = None
    distribution_top_k: int = 0
    vocab_mask: tuple[int, ...] | None = None
    logit_bias_token_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    top_logprobs: int = 0


@dataclass(frozen=True)
class Allocate:
    kind: ResourceKind
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Deallocate:
    kind: ResourceKind
    ids: tuple[int, ...]


@dataclass(frozen=True)
class EmbedText:
    """Write each token's input embedding and position into an embedding slot."""

    slot_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]


@dataclass(frozen=True)
class Forward:
    """Run the slots `input_slot_ids` through the model into the pages (plain causal attention,
    ANDed with page visibility); final hidden states of `output_indices` go to `output_slot_ids`."""

    kv_page_ids: tuple[int, ...]
    kv_last_page_length: int
    input_slot_ids: tuple[int, ...]
    output_indices: tuple[int, ...] = ()
    output_slot_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ForwardText:
    """Tokens through the model into the pages; one sampler per output index.

    `attention_mask` holds one BRLE row per token, or is empty for plain causal attention.
    With `num_continuation_steps` > 0 the executor then feeds each sampled token back and samples
    again, that many times at most (see `ForwardTextItem` in common.proto): the pages (and
    `kv_last_page_length`) already count the slots of those fed tokens.
    """

    kv_page_ids: tuple[int, ...]
    kv_last_page_length: int
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    attention_mask: tuple[tuple[int, ...], ...] = ()
    output_indices: tuple[int, ...] = ()
    samplers: tuple[SamplerSpec, ...] = ()
    num_continuation_steps: int = 0
    continuation_stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class SampleTopK:
    """Top-k next-token distribution from the hidden state stored in an embedding slot."""

    slot_id: int
    k: int


@dataclass(frozen=True)
class CopyKvPage:
    src_page_id: int
    dst_page_id: int
    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class MaskKvPage:
    """BRLE over the page's `page_size` slots, first run visible; ANDed into later attention."""

    page_id: int
    mask: tuple[int, ...]


@dataclass(frozen=True)
class EmbedImage:
    slot_ids: tuple[int, ...]
    image: bytes = b""
    position_offset: int = 0


@dataclass(frozen=True)
class SwapOut:
    """Copy each page (every layer's K/V and its slot visibility) into the host swap slot at the same
    position, then free the page."""

    page_ids: tuple[int, ...]
    swap_slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class SwapIn:
    """Allocate each free page and fill it from the host swap slot at the same position (as `SwapOut` left it)."""

    page_ids: tuple[int, ...]
    swap_slot_ids: tuple[int, ...]


@dataclass(frozen=True)
class DebugQuery:
    """ "ping" -> "pong"; "stats" -> JSON counters."""

    query: str


@dataclass(frozen=True)
class Distribution:
    token_ids: tuple[int, ...]
    probs: tuple[float, ...]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    # The sampler's top_logprobs alternatives, most probable first (empty when it asked for none).
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


SamplerResult = Distribution | SampledToken


@dataclass(frozen=True)
class ForwardTextResult:
    outputs: tuple[SamplerResult, ...] = field(default_factory=tuple)


Command = (
    Allocate
    | Deallocate
    | EmbedText
    | Forward
    | ForwardText
    | SampleTopK
    | CopyKvPage
    | MaskKvPage
    | EmbedImage
    | DebugQuery
    | SwapOut
    | SwapIn
)


@dataclass(frozen=True)
class ExecutorInfo:
    """What get_info reports: the model, its numbers, capacities and tokenizer."""

    model_name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    page_size: int
    num_kv_pages: int
    num_embed_slots: int
    num_free_kv_pages: int
    num_free_embed_slots: int
    device: str
    dtype: str
    tokenizer_json: str
    special_tokens: dict[str, int]
    eos_token_ids: tuple[int, ...]
    chat_template: str
    capabilities: tuple[str, ...]
    max_batch_tokens: int
    chat_template_variables: dict[str, str] = field(default_factory=dict)  # "bos_token"/"eos_token" -> text
    num_swap_slots: int = 0  # host swap slots for preempted instances' pages (0: no swap space)
