"""Validation of every L4M command, in two halves.

`check_command` runs when a command arrives and needs nothing but the command and the model's limits
(lengths, ranges, mask rows, sampler parameters). `translate_*` runs when the command is sent to its
executor, in send order, and rewrites the controller's virtual ids into physical ones in place; an id
the instance does not own fails there. Both raise a `TrapError` whose reason names field and value.

The LENGTH RULE and MASK RULE are the ones written in `common.proto` (ForwardTextItem).

Work and reply size are bounded per command (`l4m.wire.limits`): distribution entries (outputs x
distribution_top_k, or a sample_top_k's k), the worst-case bytes of the reply, and the runs of every BRLE
mask (counted before they are summed, so a mask of millions of runs costs nothing to refuse). Checks run
cheapest first: lengths before anything that iterates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from l4m.scheduler.errors import InvalidCommand, Unsupported
from l4m.v1 import common_pb2, l4m_pb2
from l4m.wire import limits as bounds

KV_PAGE = common_pb2.RESOURCE_KIND_KV_PAGE
EMBED_SLOT = common_pb2.RESOURCE_KIND_EMBED_SLOT
_RESOURCE_NAMES = {KV_PAGE: "kv page", EMBED_SLOT: "embed slot"}
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


def _fail(reason: str) -> None:
    raise InvalidCommand(reason)


def _check_ids(field: str, ids: object, max_count: int) -> None:
    num_ids = len(ids)  # type: ignore[arg-type]
    if num_ids == 0:
        _fail(f"{field} is empty")
    if num_ids > max_count:
        _fail(f"{field} lists {num_ids} ids, more than the {max_count} one instance may hold")
    if len(set(ids)) != num_ids:  # type: ignore[arg-type]
        _fail(f"{field} lists an id twice: {list(ids)[:16]}")  # type: ignore[call-overload]


def _check_tokens(field: str, token_ids: object, vocab_size: int) -> None:
    top = max(token_ids)  # type: ignore[call-overload]
    if top >= vocab_size:
        _fail(f"{field} holds token id {top}, not below vocab_size {vocab_size}")


def _check_positions(field: str, position_ids: object, max_context: int) -> None:
    top = max(position_ids)  # type: ignore[call-overload]
    if top >= max_context:
        _fail(f"{field} holds position {top}, not below max_context_tokens {max_context}")


# Continuation steps an executor runs for one forward_text at most (the scheduler may allow fewer).
MAX_CONTINUATION_STEPS = 64


def _check_context(item: object, num_inputs: int, limits: ModelLimits) -> int:
    """Checks pages and last-page length against the LENGTH RULE; returns num_context."""
    page_size = limits.kv_page_size
    num_pages = len(item.kv_page_ids)  # type: ignore[attr-defined]
    if num_pages == 0:
        _fail("kv_page_ids is empty (the context needs at least one page)")
    if num_pages > limits.max_kv_pages_per_instance:
        _fail(f"kv_page_ids lists {num_pages} pages, more than max_kv_pages_per_instance {limits.max_kv_pages_per_instance}")
    last = item.kv_last_page_length  # type: ignore[attr-defined]
    if not 0 < last <= page_size:
        _fail(f"kv_last_page_length {last} is not in [1, kv_page_size={page_size}]")
    total = page_size * (num_pages - 1) + last
    if num_inputs > total:
        _fail(f"{num_inputs} inputs do not fit the {total} token slots of {num_pages} pages (length rule)")
    if num_pages > 1 and len(set(item.kv_page_ids)) != num_pages:  # type: ignore[attr-defined]
        _fail(f"kv_page_ids lists a page twice: {list(item.kv_page_ids)[:16]}")  # type: ignore[attr-defined]
    return total - num_inputs


def _check_outputs(output_indices: object, num_inputs: int) -> None:
    if not output_indices:
        return
    if len(output_indices) > num_inputs:  # type: ignore[arg-type]
        _fail(f"output_indices lists {len(output_indices)} indices for {num_inputs} inputs (at most one each)")  # type: ignore[arg-type]
    if max(output_indices) >= num_inputs:  # type: ignore[call-overload]
        _fail(f"output_indices holds {max(output_indices)}, not below the {num_inputs} inputs")  # type: ignore[call-overload]
    if len(output_indices) > 1 and len(set(output_indices)) != len(output_indices):  # type: ignore[arg-type]
        _fail("output_indices lists an index twice")


def check_brle(field: str, brle: common_pb2.Brle, expected_length: int) -> None:
    runs = brle.run_lengths
    max_runs = bounds.max_brle_runs(expected_length)
    if len(runs) > max_runs:
        _fail(f"{field} has {len(runs)} runs, more than the {max_runs} a mask of {expected_length} values may have "
              "(2 x values + 1)")
    length = sum(runs)
    if length != expected_length:
        _fail(f"{field} decodes to {length} values, expected {expected_length}")


def _check_sampler(index: int, sampler: common_pb2.SamplerSpec, vocab_size: int) -> None:
    field = f"samplers[{index}]"
    kind = sampler.kind
    if kind == common_pb2.SAMPLER_KIND_DISTRIBUTION:
        if not 0 < sampler.distribution_top_k <= vocab_size:
            _fail(f"{field}.distribution_top_k {sampler.distribution_top_k} is not in [1, vocab_size={vocab_size}]")
    elif kind == common_pb2.SAMPLER_KIND_SAMPLE:
        temperature = sampler.temperature
        if not (temperature > 0 and math.isfinite(temperature)):
            _fail(f"{field}.temperature {temperature} is not a finite number > 0")
        if sampler.top_k > vocab_size:
            _fail(f"{field}.top_k {sampler.top_k} exceeds vocab_size {vocab_size}")
        if not 0 <= sampler.top_p <= 1:
            _fail(f"{field}.top_p {sampler.top_p} is not in [0, 1]")
        if not 0 <= sampler.min_p < 1:
            _fail(f"{field}.min_p {sampler.min_p} is not in [0, 1)")
    elif kind != common_pb2.SAMPLER_KIND_GREEDY:
        _fail(f"{field}.kind {kind} is not DISTRIBUTION, GREEDY or SAMPLE")
    if sampler.HasField("vocabulary_mask") and sampler.vocabulary_mask.run_lengths:
        mask = sampler.vocabulary_mask
        check_brle(f"{field}.vocabulary_mask", mask, vocab_size)
        if not any(mask.run_lengths[0::2]):
            _fail(f"{field}.vocabulary_mask allows no token")


def check_forward_text(item: common_pb2.ForwardTextItem, limits: ModelLimits) -> None:
    num_tokens = len(item.token_ids)
    if num_tokens == 0:
        _fail("token_ids is empty")
    if num_tokens > limits.max_batch_tokens:
        _fail(f"{num_tokens} token_ids exceed the executor's max_batch_tokens {limits.max_batch_tokens}")
    if len(item.position_ids) != num_tokens:
        _fail(f"position_ids has {len(item.position_ids)} entries for {num_tokens} token_ids")
    num_steps = item.num_continuation_steps
    num_context = _check_context(item, num_tokens + num_steps, limits)  # the length rule counts continuation
    _check_tokens("token_ids", item.token_ids, limits.vocab_size)
    _check_positions("position_ids", item.position_ids, limits.max_context_tokens)
    masks = item.attention_masks
    if masks and len(masks) != num_tokens:
        _fail(f"attention_masks has {len(masks)} rows for {num_tokens} tokens (mask rule: none or one per token)")
    if len(item.samplers) > num_tokens:
        _fail(f"samplers has {len(item.samplers)} entries for {num_tokens} token_ids (at most one output each)")
    _check_mask_runs(item, limits)
    for i, row in enumerate(masks):
        check_brle(f"attention_masks[{i}]", row, num_context + i + 1)  # the mask rule
    _check_outputs(item.output_indices, num_tokens)
    if len(item.samplers) != len(item.output_indices):
        _fail(f"samplers has {len(item.samplers)} entries for {len(item.output_indices)} output_indices")
    for i, sampler in enumerate(item.samplers):
        _check_sampler(i, sampler, limits.vocab_size)
    if num_steps or item.continuation_stop_token_ids:
        _check_continuation(item, num_tokens, limits)
    _check_reply("forward_text", item, limits)


def _check_mask_runs(item: common_pb2.ForwardTextItem, limits: ModelLimits) -> None:
    """Counts the runs of every mask (not their values) against the per-command bound."""
    num_runs = sum(len(row.run_lengths) for row in item.attention_masks) + \
        sum(len(s.vocabulary_mask.run_lengths) for s in item.samplers)
    if num_runs > limits.max_mask_runs_per_command:
        _fail(f"the masks carry {num_runs} BRLE runs in all, more than max_mask_runs_per_command "
              f"{limits.max_mask_runs_per_command} (GetInfo tells it)")


def _check_reply(kind: str, item: object, limits: ModelLimits) -> None:
    """Bounds what the command's reply may hold, so that it fits any batch and the controller's stream."""
    num_entries, num_bytes = bounds.reply_cost(kind, item)
    max_entries = limits.max_distribution_entries_per_command
    if num_entries > max_entries:
        what = f"k {num_entries} asks for" if kind == "sample_top_k" else \
            f"samplers ask for {num_entries} distribution entries (outputs x distribution_top_k),"
        _fail(f"{what} more than max_distribution_entries_per_command {max_entries} (GetInfo tells it)")
    if num_bytes > limits.max_reply_bytes:
        _fail(f"the reply could take {num_bytes} bytes, more than max_reply_bytes {limits.max_reply_bytes} "
              "(fewer outputs or a smaller distribution_top_k)")


def _check_continuation(item: common_pb2.ForwardTextItem, num_tokens: int, limits: ModelLimits) -> None:
    num_steps = item.num_continuation_steps
    if num_steps > limits.max_continuation_steps:
        _fail(f"num_continuation_steps {num_steps} exceeds this scheduler's max_continuation_steps "
              f"{limits.max_continuation_steps} (GetInfo tells it)")
    if num_steps == 0:
        _fail("continuation_stop_token_ids is set but num_continuation_steps is 0")
    if item.attention_masks:
        _fail("continuation needs plain causal attention: attention_masks must be empty")
    if list(item.output_indices) != [num_tokens - 1]:
        _fail(f"continuation needs exactly one output index, the last token's ({num_tokens - 1}), "
              f"not {list(item.output_indices)}")
    sampler = item.samplers[0]
    if sampler.kind not in (common_pb2.SAMPLER_KIND_GREEDY, common_pb2.SAMPLER_KIND_SAMPLE) or \
            sampler.vocabulary_mask.run_lengths:
        _fail("continuation needs a GREEDY or SAMPLE sampler without a vocabulary mask (its token is fed back)")
    if item.continuation_stop_token_ids:
        _check_tokens("continuation_stop_token_ids", item.continuation_stop_token_ids, limits.vocab_size)
    last_position = item.position_ids[-1]
    if last_position + num_steps >= limits.max_context_tokens:
        _fail(f"{num_steps} continuation steps after position {last_position} pass max_context_tokens "
              f"{limits.max_context_tokens}")


def check_forward(item: common_pb2.ForwardItem, limits: ModelLimits) -> None:
    num_inputs = len(item.input_embed_slot_ids)
    if num_inputs == 0:
        _fail("input_embed_slot_ids is empty")
    if num_inputs > limits.max_batch_tokens:
        _fail(f"{num_inputs} inputs exceed the executor's max_batch_tokens {limits.max_batch_tokens}")
    _check_context(item, num_inputs, limits)
    _check_outputs(item.output_indices, num_inputs)
    if len(item.output_embed_slot_ids) != len(item.output_indices):
        _fail(
            f"output_embed_slot_ids has {len(item.output_embed_slot_ids)} entries for "
            f"{len(item.output_indices)} output_indices"
        )


def _check_allocation(item: common_pb2.AllocateItem, limits: ModelLimits) -> None:
    if item.kind == KV_PAGE:
        _check_ids("ids", item.ids, limits.max_kv_pages_per_instance)
    elif item.kind == EMBED_SLOT:
        _check_ids("ids", item.ids, limits.max_embed_slots_per_instance)
    else:
        _fail(f"kind {item.kind} is not KV_PAGE or EMBED_SLOT")


def _check_embed_text(item: common_pb2.EmbedTextItem, limits: ModelLimits) -> None:
    _check_ids("embed_slot_ids", item.embed_slot_ids, limits.max_embed_slots_per_instance)
    num_slots = len(item.embed_slot_ids)
    if len(item.token_ids) != num_slots or len(item.position_ids) != num_slots:
        _fail(
            f"embed_text has {num_slots} embed_slot_ids, {len(item.token_ids)} token_ids and "
            f"{len(item.position_ids)} position_ids; they must match"
        )
    _check_tokens("token_ids", item.token_ids, limits.vocab_size)
    _check_positions("position_ids", item.position_ids, limits.max_context_tokens)


def _check_copy(item: common_pb2.CopyKvPageItem, limits: ModelLimits) -> None:
    page_size = limits.kv_page_size
    if item.length_tokens == 0:
        _fail("length_tokens is 0")
    if item.source_offset_tokens + item.length_tokens > page_size:
        _fail(
            f"source range [{item.source_offset_tokens}, {item.source_offset_tokens + item.length_tokens}) "
            f"exceeds kv_page_size {page_size}"
        )
    if item.destination_offset_tokens + item.length_tokens > page_size:
        _fail(
            f"destination range [{item.destination_offset_tokens}, "
            f"{item.destination_offset_tokens + item.length_tokens}) exceeds kv_page_size {page_size}"
        )


def check_name(name: str, limits: ModelLimits) -> None:
    size = len(name.encode())
    if not 0 < size <= limits.max_export_name_bytes:
        _fail(f"name {name[:40]!r} is {size} bytes, not in [1, {limits.max_export_name_bytes}]")


def _check_export(command: l4m_pb2.ExportKvPagesCommand, limits: ModelLimits) -> None:
    check_name(command.name, limits)
    _check_ids("kv_page_ids", command.kv_page_ids, limits.max_kv_pages_per_instance)
    if len(command.metadata) > limits.max_export_metadata_bytes:
        _fail(f"metadata is {len(command.metadata)} bytes, more than {limits.max_export_metadata_bytes}")


def _check_import(command: l4m_pb2.ImportKvPagesCommand, limits: ModelLimits) -> None:
    check_name(command.name, limits)
    _check_ids("kv_page_ids", command.kv_page_ids, limits.max_kv_pages_per_instance)


def _check_debug_query(command: l4m_pb2.DebugQueryCommand) -> None:
    query = command.query
    if query in _DEBUG_QUERIES:
        return
    if query.startswith("batching:"):
        from l4m.scheduler.batcher import parse_strategy  # late: batcher imports nothing from here

        try:
            parse_strategy(query.removeprefix("batching:"))
        except ValueError as error:
            _fail(f"debug_query {query!r}: {error}")
        return
    _fail(f"debug_query {query[:60]!r} is unknown; known: ping, stats, batching, batching:<strategy>")


def check_command(kind: str | None, command: object, limits: ModelLimits) -> None:
    """Validate one command's shape (no ownership); raises `TrapError`."""
    if kind == "forward_text":
        check_forward_text(command, limits)  # type: ignore[arg-type]
    elif kind in ("allocate", "deallocate"):
        _check_allocation(command, limits)  # type: ignore[arg-type]
    elif kind == "embed_text":
        _check_embed_text(command, limits)  # type: ignore[arg-type]
    elif kind == "forward":
        check_forward(command, limits)  # type: ignore[arg-type]
    elif kind == "sample_top_k":
        if not 0 < command.k <= limits.vocab_size:  # type: ignore[attr-defined]
            _fail(f"k {command.k} is not in [1, vocab_size={limits.vocab_size}]")  # type: ignore[attr-defined]
        _check_reply(kind, command, limits)
    elif kind == "copy_kv_page":
        _check_copy(command, limits)  # type: ignore[arg-type]
    elif kind == "mask_kv_page":
        check_brle("visibility", command.visibility, limits.kv_page_size)  # type: ignore[attr-defined]
    elif kind == "embed_image":
        if "vision" not in limits.capabilities:
            raise Unsupported("embed_image needs the 'vision' capability; this model has only " + ", ".join(sorted(limits.capabilities)))
        _check_ids("embed_slot_ids", command.embed_slot_ids, limits.max_embed_slots_per_instance)  # type: ignore[attr-defined]
        if not command.image_bytes:  # type: ignore[attr-defined]
            _fail("image_bytes is empty")
    elif kind == "export_kv_pages":
        _check_export(command, limits)  # type: ignore[arg-type]
    elif kind == "unexport_kv_pages":
        check_name(command.name, limits)  # type: ignore[attr-defined]
    elif kind == "import_kv_pages":
        _check_import(command, limits)  # type: ignore[arg-type]
    elif kind == "set_stream_priority":
        if command.priority not in (1, 2, 3):  # type: ignore[attr-defined]
            _fail(f"priority {command.priority} is not LOW, NORMAL or HIGH")  # type: ignore[attr-defined]
    elif kind == "debug_query":
        _check_debug_query(command)  # type: ignore[arg-type]
    elif kind is None:
        _fail("the SessionRequest carries no command")


# ---- translation (virtual → physical), in send order ----


def _unowned(what: str, virtual_id: int) -> InvalidCommand:
    return InvalidCommand(f"{what} {virtual_id} is not allocated by this instance")


def translate_ids(table: dict[int, int], virtual_ids: object, what: str) -> list[int]:
    try:
        return [table[v] for v in virtual_ids]  # type: ignore[attr-defined]
    except KeyError as missing:
        raise _unowned(what, missing.args[0]) from None


def translate_one(table: dict[int, int], virtual_id: int, what: str) -> int:
    physical_id = table.get(virtual_id)
    if physical_id is None:
        raise _unowned(what, virtual_id)
    return physical_id


def resource_name(kind: int) -> str:
    return _RESOURCE_NAMES[kind]
