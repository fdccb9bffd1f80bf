"""Protobuf <-> executor dataclasses (`from_pb` / `to_pb`); the only module of the core that knows pb.

Conversion errors (an unspecified enum, a batch with no kind) are `InvalidCommand`s, answered as that
batch's error like any validation failure. Conversion also enforces the bounds of `l4m.wire.limits` that the
executor advertises in GetInfo, before a batch costs any work: BRLE masks of at most
`max_brle_runs(length)` runs, and batches whose reply fits the gRPC send limit (distribution entries and
worst-case reply bytes). The scheduler checks the same bounds first; these are the executor's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from l4m.executor import commands as c
from l4m.executor.errors import ExecutorError, InvalidCommand
from l4m.v1 import common_pb2, executor_pb2
from l4m.wire import limits

# The budget of a batch's items in the reply: the send limit less the envelope.
MAX_BATCH_REPLY_BYTES = limits.EXECUTOR_MAX_REPLY_BYTES - limits.MESSAGE_MARGIN_BYTES

_RESOURCE_KINDS = {
    common_pb2.RESOURCE_KIND_KV_PAGE: c.ResourceKind.KV_PAGE,
    common_pb2.RESOURCE_KIND_EMBED_SLOT: c.ResourceKind.EMBED_SLOT,
}
_SAMPLER_KINDS = {
    common_pb2.SAMPLER_KIND_DISTRIBUTION: c.SamplerKind.DISTRIBUTION,
    common_pb2.SAMPLER_KIND_GREEDY: c.SamplerKind.GREEDY,
    common_pb2.SAMPLER_KIND_SAMPLE: c.SamplerKind.SAMPLE,
}


def _resource_kind(kind: int, index: int) -> c.ResourceKind:
    if kind not in _RESOURCE_KINDS:
        raise InvalidCommand(f"item {index}: resource kind {kind} is unspecified or unknown", index)
    return _RESOURCE_KINDS[kind]


def runs_from_pb(brle: common_pb2.Brle, field: str, index: int) -> tuple[int, ...]:
    """A BRLE's runs, refused when they are more than `limits.max_brle_runs` of their length."""
    runs = tuple(brle.run_lengths)
    if len(runs) > 1:
        num_values = sum(runs)
        if len(runs) > limits.max_brle_runs(num_values):
            raise InvalidCommand(f"item {index}: {field} has {len(runs)} runs for {num_values} values, more than "
                                 f"the {limits.max_brle_runs(num_values)} allowed", index)
    return runs


def sampler_from_pb(spec: common_pb2.SamplerSpec, index: int) -> c.SamplerSpec:
    # A decode loop sends the same sampler at every step: one converted before is taken from `_SAMPLERS` by its
    # bytes (equal bytes parse to equal fields), unless it carries per-token data (a mask, a logit bias).
    key = None if spec.HasField("vocabulary_mask") or spec.logit_bias_token_ids or spec.logit_bias_values \
        else spec.SerializeToString()
    if key is not None and (converted := _SAMPLERS.get(key)) is not None:
        return converted
    if spec.kind not in _SAMPLER_KINDS:
        raise InvalidCommand(f"item {index}: sampler kind {spec.kind} is unspecified or unknown", index)
    mask = runs_from_pb(spec.vocabulary_mask, "vocabulary_mask", index) if spec.HasField("vocabulary_mask") else ()
    converted = c.SamplerSpec(
        kind=_SAMPLER_KINDS[spec.kind],
        temperature=spec.temperature,
        top_k=spec.top_k,
        top_p=spec.top_p,
        min_p=spec.min_p,
        seed=spec.seed if spec.HasField("seed") else None,
        distribution_top_k=spec.distribution_top_k,
        vocab_mask=mask or None,
        logit_bias_token_ids=tuple(spec.logit_bias_token_ids),
        logit_bias_values=tuple(spec.logit_bias_values),
        top_logprobs=spec.top_logprobs,
    )
    if key is not None:
        if len(_SAMPLERS) >= _MAX_SAMPLERS:  # a client sending a new sampler every time costs a bounded dict
            _SAMPLERS.clear()
        _SAMPLERS[key] = converted
    return converted


# Samplers converted before, by their serialized bytes (frozen: one object serves every batch that sends them).
# Conversion only: the engine checks every batch's samplers against its rules whether converted now or before.
_SAMPLERS: dict[bytes, c.SamplerSpec] = {}
_MAX_SAMPLERS = 1024

_NO_STOP_TOKENS: frozenset[int] = frozenset()  # an item without stop ids shares this one


def _forward_text_from_pb(item: common_pb2.ForwardTextItem, index: int) -> c.ForwardText:
    masks, stop_token_ids = item.attention_masks, item.continuation_stop_token_ids
    return c.ForwardText(
        tuple(item.kv_page_ids),
        item.kv_last_page_length,
        tuple(item.token_ids),
        tuple(item.position_ids),
        tuple(runs_from_pb(row, f"attention_masks[{i}]", index) for i, row in enumerate(masks)) if masks else (),
        tuple(item.output_indices),
        tuple([sampler_from_pb(s, index) for s in item.samplers]),
        item.num_continuation_steps,
        frozenset(stop_token_ids) if stop_token_ids else _NO_STOP_TOKENS,
    )


_CONVERTERS: dict[str, Callable[[Any, int], c.Command]] = {
    "allocate": lambda it, i: c.Allocate(_resource_kind(it.kind, i), tuple(it.ids)),
    "deallocate": lambda it, i: c.Deallocate(_resource_kind(it.kind, i), tuple(it.ids)),
    "embed_text": lambda it, i: c.EmbedText(tuple(it.embed_slot_ids), tuple(it.token_ids), tuple(it.position_ids)),
    "forward": lambda it, i: c.Forward(
        tuple(it.kv_page_ids),
        it.kv_last_page_length,
        tuple(it.input_embed_slot_ids),
        tuple(it.output_indices),
        tuple(it.output_embed_slot_ids),
    ),
    "forward_text": _forward_text_from_pb,
    "sample_top_k": lambda it, i: c.SampleTopK(it.embed_slot_id, it.k),
    "copy_kv_page": lambda it, i: c.CopyKvPage(
        it.source_kv_page_id,
        it.destination_kv_page_id,
        it.source_offset_tokens,
        it.destination_offset_tokens,
        it.length_tokens,
    ),
    "mask_kv_page": lambda it, i: c.MaskKvPage(it.kv_page_id, runs_from_pb(it.visibility, "visibility", i)),
    "embed_image": lambda it, i: c.EmbedImage(tuple(it.embed_slot_ids), it.image_bytes, it.position_offset),
    "debug_query": lambda it, i: c.DebugQuery(it),
    "swap_out": lambda it, i: c.SwapOut(tuple(it.kv_page_ids), tuple(it.swap_slot_ids)),
    "swap_in": lambda it, i: c.SwapIn(tuple(it.kv_page_ids), tuple(it.swap_slot_ids)),
}


def batch_from_pb(request: executor_pb2.ExecuteRequest) -> list[c.Command]:
    """The batch's items as executor commands."""
    kind = request.WhichOneof("batch")
    if kind is None:
        raise InvalidCommand("the request carries no batch")
    items = getattr(request, kind).queries if kind == "debug_query" else getattr(request, kind).items
    check_reply_bounds(kind, items)
    convert = _CONVERTERS[kind]
    return [convert(item, i) for i, item in enumerate(items)]


def check_reply_bounds(kind: str, items: Sequence[object]) -> None:
    """Refuses a batch whose reply could pass the send limit (which would break the stream, and every
    instance on it, instead of failing this batch): too many distribution entries, or too many bytes at
    the worst case. An item over a bound alone is named (item_index); a batch over it only together
    names none."""
    if kind not in ("forward_text", "sample_top_k"):
        return
    max_entries = limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH
    num_entries, num_bytes = 0, 0
    for index, item in enumerate(items):
        item_entries, item_bytes = limits.reply_cost(kind, item)
        if item_entries > max_entries:
            raise InvalidCommand(f"{kind} item {index}: asks for {item_entries} distribution entries, more than "
                                 f"max_distribution_entries_per_batch {max_entries}", index)
        if item_bytes > MAX_BATCH_REPLY_BYTES:
            raise InvalidCommand(f"{kind} item {index}: its reply could take {item_bytes} bytes, more than "
                                 f"max_reply_bytes less the envelope ({MAX_BATCH_REPLY_BYTES})", index)
        num_entries += item_entries
        num_bytes += item_bytes
    if num_entries > max_entries:
        raise InvalidCommand(f"the {kind} batch asks for {num_entries} distribution entries, more than "
                             f"max_distribution_entries_per_batch {max_entries}")
    if num_bytes > MAX_BATCH_REPLY_BYTES:
        raise InvalidCommand(f"the {kind} batch's reply could take {num_bytes} bytes, more than max_reply_bytes "
                             f"less the envelope ({MAX_BATCH_REPLY_BYTES})")


def outputs_to_pb(results: Sequence[c.SamplerResult], outputs: Any) -> None:
    """Each result appended to `outputs` (a repeated OutputResult field), in place: filling messages the
    reply already holds costs a quarter of building them apart and copying them in."""
    for result in results:
        if isinstance(result, c.Distribution):
            distribution_to_pb(result, outputs.add().distribution)
            continue
        token = outputs.add().token
        token.token_id = result.token_id
        token.logprob = result.logprob
        if result.top_token_ids:
            token.top_token_ids.extend(result.top_token_ids)
            token.top_logprobs.extend(result.top_logprobs)


def distribution_to_pb(result: c.Distribution, distribution: common_pb2.Distribution) -> None:
    """`result` into `distribution`, a message the reply already holds."""
    distribution.token_ids.extend(result.token_ids)
    distribution.probabilities.extend(result.probs)


def reply_to_pb(
    correlation_id: int, batch: Sequence[c.Command], result: object
) -> executor_pb2.ExecuteResponse | None:
    """The batch's reply, or None for fire-and-forget batches.

    Every forward_text and forward batch is answered, with or without outputs: the scheduler counts
    forward passes in flight by their replies.
    """
    first = batch[0]
    reply = executor_pb2.ExecuteResponse(correlation_id=correlation_id)
    if isinstance(first, c.ForwardText):
        items = reply.forward_text.items
        for item_result in result:
            outputs_to_pb(item_result.outputs, items.add().outputs)
    elif isinstance(first, c.Forward):
        reply.forward.num_items = len(batch)
    elif isinstance(first, c.SampleTopK):
        items = reply.sample_top_k.items
        for distribution in result:
            distribution_to_pb(distribution, items.add())
    elif isinstance(first, c.DebugQuery):
        reply.debug_query.responses.extend(result)
    else:
        return None
    return reply


def error_to_pb(
    correlation_id: int, error: ExecutorError, is_unsupported: bool
) -> executor_pb2.ExecuteResponse:
    return executor_pb2.ExecuteResponse(
        correlation_id=correlation_id,
        error=executor_pb2.BatchError(
            item_index=error.item_index or 0, reason=error.reason, is_unsupported=is_unsupported,
            has_item_index=error.item_index is not None,
        ),
    )


def info_to_pb(info: c.ExecutorInfo) -> executor_pb2.ExecutorServiceGetInfoResponse:
    model = common_pb2.ModelInfo(
        name=info.model_name,
        architecture=info.architecture,
        vocab_size=info.vocab_size,
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        num_attention_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        max_context_tokens=info.max_context,
        tokenizer_json=info.tokenizer_json,
        chat_template=info.chat_template,
        stop_token_ids=info.eos_token_ids,
        special_token_ids=info.special_tokens,
        capabilities=info.capabilities,
        chat_template_variables=info.chat_template_variables,
    )
    return executor_pb2.ExecutorServiceGetInfoResponse(
        model=model,
        device=info.device,
        dtype=info.dtype,
        kv_page_size=info.page_size,
        num_kv_pages=info.num_kv_pages,
        num_embed_slots=info.num_embed_slots,
        max_batch_tokens=info.max_batch_tokens,
        max_request_bytes=limits.EXECUTOR_MAX_REQUEST_BYTES,
        max_reply_bytes=limits.EXECUTOR_MAX_REPLY_BYTES,
        max_distribution_entries_per_batch=limits.EXECUTOR_MAX_DISTRIBUTION_ENTRIES_PER_BATCH,
        num_swap_slots=info.num_swap_slots,
    )
