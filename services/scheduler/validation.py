"""Validation of every L4M command's shape: one check per kind, run when the command arrives.

The rules themselves are the protocol's rulebook, `l4m.wire.rules` (the executor checks its batches with
the same code); here each kind's protobuf message is taken apart for them, against this scheduler's
`ModelLimits`, and a broken rule becomes an `InvalidCommand` trap. A check needs nothing but the command
and the limits; `kinds.py` names each kind's check. Ownership is checked later, when the command's
virtual ids are translated in send order (`translate.py`).

Work and reply size are bounded per command (`l4m.wire.limits`): distribution entries (outputs x
distribution_top_k, or a sample_top_k's k), the worst-case bytes of the reply, and the runs of every BRLE
mask (counted before they are summed, so a mask of millions of runs costs nothing to refuse). Checks run
cheapest first: lengths before anything that iterates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from l4m.scheduler.batcher import parse_strategy
from l4m.scheduler.errors import InvalidCommand
from l4m.v1 import common_pb2, l4m_pb2
from l4m.wire import limits as bounds
from l4m.wire import rules

KV_PAGE = common_pb2.RESOURCE_KIND_KV_PAGE
EMBED_SLOT = common_pb2.RESOURCE_KIND_EMBED_SLOT
_DEBUG_QUERIES = ("ping", "stats", "batching")


@dataclass(frozen=True)
class ModelLimits:
    """What a command is checked against (from the executors' GetInfo and the config)."""

    vocab_size: int
    kv_page_size: int
    max_context_tokens: int
    max_batch_tokens: int
    max_kv_pages_per_instance: int
    max_embed_slots_per_instance: int
    capabilities: frozenset[str]
    max_continuation_steps: int = 0
    max_export_name_bytes: int = 256
    max_export_metadata_bytes: int = 1 << 20
    # Per command: the smaller of the executors' per-batch bound and the scheduler's default.
    max_distribution_entries_per_command: int = bounds.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND
    # Worst-case bytes of one command's reply (`l4m.wire.limits.reply_bytes`): it must fit an empty batch's
    # reply and the SessionResponse to the controller, each less its envelope.
    max_reply_bytes: int = bounds.MAX_RESPONSE_BYTES - bounds.MESSAGE_MARGIN_BYTES
    # BRLE runs in all of one command's masks (each mask is also bounded by its length).
    max_mask_runs_per_command: int = bounds.DEFAULT_MAX_MASK_RUNS_PER_COMMAND
    # A forward_text with more tokens runs as chunks of at most this many (prefill.py), so it may carry up
    # to the context window; 0: never split, a forward_text is bounded by `max_batch_tokens` like a forward.
    prefill_chunk_tokens: int = 0
    # With > 0, chunks shrink as their context grows (`prefill.chunk_sizes`): one token's own work in slots.
    prefill_chunk_token_slots: int = 0


# `with _obeys():` a broken rule as an `InvalidCommand` trap (the hot path, forward_text, has its own try).
_obeys = functools.partial(rules.reported_as, InvalidCommand)


def check_forward_text(item: common_pb2.ForwardTextItem, limits: ModelLimits) -> tuple[int, int]:
    """The hot path (one per decode step): one try for every rule, each field read once (a repeated or
    message field costs a container object per read, more than most rules); returns the reply's cost
    (`l4m.wire.limits.reply_cost`, which the batcher needs too)."""
    sampler_index = -1  # the sampler being checked, for the reason's prefix
    try:
        num_steps = item.num_continuation_steps
        if num_steps:
            rules.check_continuation_steps(num_steps, limits.max_continuation_steps)
        # Plain lists: a slice of a repeated scalar field copies it at C speed, and the rules then iterate
        # lists, not protobuf containers (several times cheaper to read).
        token_ids = item.token_ids[:]
        output_indices = item.output_indices[:]
        position_ids = item.position_ids[:]
        samplers = item.samplers[:]  # a list: iterating the container costs ~1 us even for one sampler
        num_tokens = len(token_ids)
        vocab_size = limits.vocab_size
        max_tokens: int | None = limits.max_batch_tokens
        if limits.prefill_chunk_tokens:  # chunked: the context window bounds it, not one batch
            if num_tokens > limits.max_context_tokens:
                raise rules.RuleViolation(f"{num_tokens} token_ids exceed the context window, max_context_tokens "
                                          f"{limits.max_context_tokens}")
            max_tokens = None
        masks = item.attention_masks
        mask_rows = [row.run_lengths for row in masks] if masks else ()
        num_context = rules.check_forward_text(
            kv_page_ids=item.kv_page_ids[:], kv_last_page_length=item.kv_last_page_length, token_ids=token_ids,
            position_ids=position_ids, attention_masks=(), output_indices=output_indices,
            num_samplers=len(samplers), num_continuation_steps=num_steps, vocab_size=vocab_size,
            max_context=limits.max_context_tokens, page_size=limits.kv_page_size,
            max_pages=limits.max_kv_pages_per_instance, max_batch_tokens=max_tokens)
        # A sampler checked before (the same bytes, the same vocabulary) is not read again: a decode loop
        # sends the same one every step, and reading its fields costs more than its rules.
        # (A sampler with a vocabulary mask is never kept: it is not serialized for a key either, since its
        # runs are counted against their bound before anything else reads them.)
        specs, unchecked = [], []
        for sampler in samplers:
            key = None if sampler.HasField("vocabulary_mask") else (sampler.SerializeToString(), vocab_size)
            spec = _CHECKED_SAMPLERS.get(key) if key is not None else None
            if spec is None:
                spec = _sampler_values(sampler)
                unchecked.append((len(specs), spec, key))
            specs.append(spec)
        # Every mask's runs counted against the per-command bound before any row is summed.
        num_runs = sum(len(spec[_MASK]) for spec in specs) if specs else 0
        if mask_rows:
            num_runs += sum(len(row) for row in mask_rows)
        if num_runs:
            rules.check_mask_runs(num_runs, limits.max_mask_runs_per_command)
        if mask_rows:
            rules.check_mask_rows(mask_rows, num_context, num_tokens)
        for sampler_index, spec, key in unchecked:  # noqa: B007 (the except clause reads sampler_index)
            (kind, distribution_top_k, temperature, top_k, top_p, min_p, vocabulary_mask, bias_ids, bias_values,
             top_logprobs) = spec
            rules.check_sampler(
                kind, distribution_top_k=distribution_top_k, temperature=temperature, top_k=top_k, top_p=top_p,
                min_p=min_p, seed=None, vocabulary_mask=vocabulary_mask, vocab_size=vocab_size,
                logit_bias_token_ids=bias_ids, logit_bias_values=bias_values, top_logprobs=top_logprobs)
            _remember_checked(key, spec)
        sampler_index = -1
        if num_steps or item.continuation_stop_token_ids:
            rules.check_continuation(
                num_steps=num_steps, stop_token_ids=item.continuation_stop_token_ids, num_tokens=num_tokens,
                output_indices=output_indices, num_mask_rows=len(mask_rows),
                sampler_kind=specs[0][_KIND] if specs else None, has_vocabulary_mask=bool(specs and specs[0][_MASK]),
                last_position=position_ids[-1], vocab_size=vocab_size, max_context=limits.max_context_tokens,
                max_steps=limits.max_continuation_steps)
        cost = bounds.forward_text_reply_cost(num_steps, [(s[_KIND], s[_DISTRIBUTION_TOP_K], s[_TOP_LOGPROBS]) for s in specs])
        rules.check_reply("forward_text", *cost, limits.max_distribution_entries_per_command, limits.max_reply_bytes)
    except rules.RuleViolation as violation:
        where = f"samplers[{sampler_index}]: " if sampler_index >= 0 else ""
        raise InvalidCommand(f"{where}{violation}") from None
    return cost


_KIND, _DISTRIBUTION_TOP_K, _MASK, _BIAS_IDS, _TOP_LOGPROBS = 0, 1, 6, 7, 9  # in `_sampler_values`

# Samplers that passed `rules.check_sampler`, by (serialized bytes, vocab_size), as `_sampler_values` read
# them. Equal bytes parse to equal fields, so a hit is the same sampler checked against the same vocabulary.
# Only samplers without a vocabulary mask or a logit bias are kept (those hold per-token data, and their
# spec would keep the request's message alive); the whole cache is dropped once it holds
# `_MAX_CHECKED_SAMPLERS`, so a client that sends a new sampler every time costs a bounded dict, no more.
_CHECKED_SAMPLERS: dict[tuple[bytes, int], tuple[Any, ...]] = {}
_MAX_CHECKED_SAMPLERS = 1024


def _remember_checked(key: tuple[bytes, int] | None, spec: tuple[Any, ...]) -> None:
    if key is None or spec[_MASK] or spec[_BIAS_IDS]:
        return
    if len(_CHECKED_SAMPLERS) >= _MAX_CHECKED_SAMPLERS:
        _CHECKED_SAMPLERS.clear()
    _CHECKED_SAMPLERS[key] = spec


def _sampler_values(sampler: common_pb2.SamplerSpec) -> tuple[Any, ...]:
    """A SamplerSpec as plain values, each field read once: (kind, distribution_top_k, temperature, top_k, top_p,
    min_p, vocabulary mask runs, logit bias ids, logit bias values, top_logprobs); an absent mask is (). The
    mask stays a protobuf container: its runs are counted before anything reads them."""
    # HasField first: reading an absent message field builds an empty one.
    return (sampler.kind, sampler.distribution_top_k, sampler.temperature, sampler.top_k, sampler.top_p,
            sampler.min_p, sampler.vocabulary_mask.run_lengths if sampler.HasField("vocabulary_mask") else (),
            sampler.logit_bias_token_ids[:], sampler.logit_bias_values[:], sampler.top_logprobs)


def _check_reply(kind: str, item: common_pb2.ForwardTextItem | common_pb2.SampleTopKItem, limits: ModelLimits) -> None:
    """Bounds what the command's reply may hold, so that it fits any batch and the controller's stream."""
    num_entries, num_bytes = bounds.reply_cost(kind, item)
    rules.check_reply(kind, num_entries, num_bytes, limits.max_distribution_entries_per_command,
                      limits.max_reply_bytes)


def check_forward(item: common_pb2.ForwardItem, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_forward(
            kv_page_ids=item.kv_page_ids[:], kv_last_page_length=item.kv_last_page_length,
            num_inputs=len(item.input_embed_slot_ids), output_indices=item.output_indices,
            num_output_slots=len(item.output_embed_slot_ids), page_size=limits.kv_page_size,
            max_pages=limits.max_kv_pages_per_instance, max_batch_tokens=limits.max_batch_tokens)


def check_allocation(item: common_pb2.AllocateItem | common_pb2.DeallocateItem, limits: ModelLimits) -> None:
    """allocate and deallocate."""
    with _obeys():
        is_kv = rules.check_resource_kind(item.kind) == rules.KV_PAGE
        rules.check_ids("ids", item.ids,
                        limits.max_kv_pages_per_instance if is_kv else limits.max_embed_slots_per_instance)


def check_embed_text(item: common_pb2.EmbedTextItem, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_embed_text(embed_slot_ids=item.embed_slot_ids, token_ids=item.token_ids,
                               position_ids=item.position_ids, vocab_size=limits.vocab_size,
                               max_context=limits.max_context_tokens, max_slots=limits.max_embed_slots_per_instance)


def check_sample_top_k(item: common_pb2.SampleTopKItem, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_sample_top_k(item.k, limits.vocab_size)
        _check_reply("sample_top_k", item, limits)


def check_copy_kv_page(item: common_pb2.CopyKvPageItem, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_copy(item.source_offset_tokens, item.destination_offset_tokens, item.length_tokens,
                         limits.kv_page_size)


def check_mask_kv_page(item: common_pb2.MaskKvPageItem, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_page_visibility(item.visibility.run_lengths, limits.kv_page_size)


def check_embed_image(item: common_pb2.EmbedImageItem, limits: ModelLimits) -> None:
    """Its capability ('vision') is checked first, from the kind table."""
    with _obeys():
        rules.check_ids("embed_slot_ids", item.embed_slot_ids, limits.max_embed_slots_per_instance)
    if not item.image_bytes:
        raise InvalidCommand("image_bytes is empty")


def check_export(command: l4m_pb2.ExportKvPagesCommand, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_export_name(command.name, limits.max_export_name_bytes)
        rules.check_ids("kv_page_ids", command.kv_page_ids, limits.max_kv_pages_per_instance)
        rules.check_export_metadata(len(command.metadata), limits.max_export_metadata_bytes)


def check_unexport(command: l4m_pb2.UnexportKvPagesCommand, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_export_name(command.name, limits.max_export_name_bytes)


def check_import(command: l4m_pb2.ImportKvPagesCommand, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_export_name(command.name, limits.max_export_name_bytes)
        rules.check_ids("kv_page_ids", command.kv_page_ids, limits.max_kv_pages_per_instance)


def check_set_stream_priority(command: l4m_pb2.SetStreamPriorityCommand, limits: ModelLimits) -> None:
    with _obeys():
        rules.check_stream_priority(command.priority)


def check_debug_query(command: l4m_pb2.DebugQueryCommand, limits: ModelLimits) -> None:
    query = command.query
    if query in _DEBUG_QUERIES:
        return
    if query.startswith("batching:"):
        try:
            parse_strategy(query.removeprefix("batching:"))
        except ValueError as error:
            raise InvalidCommand(f"debug_query {query!r}: {error}") from None
        return
    raise InvalidCommand(f"debug_query {query[:60]!r} is unknown; known: ping, stats, batching, batching:<strategy>")


def check_nothing(command: object, limits: ModelLimits) -> None:
    """Commands without fields to check (get_info, list_exports, synchronize)."""
