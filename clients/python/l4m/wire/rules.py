"""The protocol's rules on a command's shape, each written once (common.proto's comments are the spec).

Pure functions over plain values (ints, floats, sequences of ints, BRLE run lengths), so that the
scheduler's validation (protobuf messages), the executor's checks (its frozen dataclasses, defence in
depth with the same code), the SDK's fake and item builders and the simulated executor all call the
same code. A broken rule raises `RuleViolation`, whose message states the rule with the offending value
and its limit and names no location: each caller prefixes its own ("forward_text item 2: ...") and maps
it to its own error type. Checks run cheapest first: counts before anything that iterates, a mask's runs
counted before they are summed.

Besides the checks, the arithmetic the rules define: the slots a page list spans (the LENGTH RULE), the
pages a number of slots takes, where and with which seed continuation step i runs, and the digest that
names a tokenizer (`ModelInfo.tokenizer_sha256`).

Sampler and resource kinds are named as the executor's `SamplerKind` / `ResourceKind` values ("greedy",
"kv_page", ...); a kind may also be given as its `l4m.v1` enum number.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Collection, Iterator, Sequence

from l4m.v1 import common_pb2, l4m_pb2
from l4m.wire import limits

# Continuation steps an executor runs for one forward_text at most: bounds how long one batch holds the
# executor. A scheduler may allow fewer (GetInfo's max_continuation_steps).
MAX_CONTINUATION_STEPS = 64
# A seed is a uint64 on the wire.
MAX_SEED = (1 << 64) - 1
# Logit bias entries one sampler may carry: room for a penalty over every distinct token of a long
# generation (the SDK folds presence / frequency penalties into the bias), while one sampler's bias stays
# well under a megabyte on the wire.
MAX_LOGIT_BIAS_ENTRIES = 65536
# Alternatives a GREEDY or SAMPLE output may return beside its token (OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20

DISTRIBUTION, GREEDY, SAMPLE = "distribution", "greedy", "sample"
KV_PAGE, EMBED_SLOT = "kv_page", "embed_slot"
_SAMPLER_KINDS = {
    common_pb2.SAMPLER_KIND_DISTRIBUTION: DISTRIBUTION,
    common_pb2.SAMPLER_KIND_GREEDY: GREEDY,
    common_pb2.SAMPLER_KIND_SAMPLE: SAMPLE,
}
_RESOURCE_KINDS = {common_pb2.RESOURCE_KIND_KV_PAGE: KV_PAGE, common_pb2.RESOURCE_KIND_EMBED_SLOT: EMBED_SLOT}
_STREAM_PRIORITIES = (l4m_pb2.STREAM_PRIORITY_LOW, l4m_pb2.STREAM_PRIORITY_NORMAL, l4m_pb2.STREAM_PRIORITY_HIGH)


class RuleViolation(ValueError):
    """A command breaks one of the protocol's rules; the message states the rule, the value and the limit."""


def _fail(reason: str) -> None:
    raise RuleViolation(reason)


@contextlib.contextmanager
def reported_as(error: Callable[[str], Exception], where: str = "") -> Iterator[None]:
    """A rule broken in the body raised as the caller's own `error(reason)`, the reason after `where: `
    when given (the scheduler's InvalidCommand trap, the executor's InvalidCommand, the fake's trap)."""
    try:
        yield
    except RuleViolation as violation:
        raise error(f"{where}: {violation}" if where else str(violation)) from None


# ---- the arithmetic of the LENGTH RULE and of continuation ---------------------------------------


def context_slots(num_pages: int, kv_last_page_length: int, page_size: int) -> int:
    """Token slots a page list spans: every page full but the last (LENGTH RULE)."""
    return page_size * (num_pages - 1) + kv_last_page_length


def continuation_position(last_position: int, step: int) -> int:
    """Position of the token fed at continuation step `step` (1-based): right after the item's last."""
    return last_position + step


def step_seed(seed: int, step: int) -> int:
    """Seed of a seeded SAMPLE at step `step` of a generation (continuation step `step` on the executor)."""
    return (seed + step) % (MAX_SEED + 1)


# ---- ids, tokens, positions ----------------------------------------------------------------------


def tokenizer_digest(tokenizer_json: str) -> str:
    """`ModelInfo.tokenizer_sha256`: the SHA-256 of a tokenizer's JSON, in hex; empty for no tokenizer."""
    return hashlib.sha256(tokenizer_json.encode()).hexdigest() if tokenizer_json else ""


def check_ids(field: str, ids: Sequence[int], max_count: int | None = None) -> None:
    """A non-empty list of distinct ids, at most `max_count` (what one instance may hold)."""
    num_ids = len(ids)
    if num_ids == 0:
        _fail(f"{field} is empty")
    if max_count is not None and num_ids > max_count:
        _fail(f"{field} lists {num_ids} ids, more than the {max_count} one instance may hold")
    if len(set(ids)) != num_ids:
        _fail(f"{field} lists an id twice: {list(ids)[:16]}")


def _check_range(field: str, what: str, values: Collection[int], limit: int, limit_name: str) -> None:
    if not values:
        return
    bad = max(values)
    if bad < limit:
        bad = min(values)
        if bad >= 0:
            return
    _fail(f"{field} holds {what}{bad}, not in [0, {limit_name}={limit})")


def check_token_ids(field: str, token_ids: Collection[int], vocab_size: int) -> None:
    """Every token id in [0, vocab_size)."""
    _check_range(field, "token id ", token_ids, vocab_size, "vocab_size")


def check_position_ids(field: str, position_ids: Collection[int], max_context: int) -> None:
    """Every position in [0, max_context_tokens) (positions need not be contiguous)."""
    _check_range(field, "position ", position_ids, max_context, "max_context_tokens")


def check_count(field: str, count: int, of_field: str, expected: int) -> None:
    """`field` has exactly one entry per entry of `of_field`."""
    if count != expected:
        _fail(f"{field} has {count} entries for {expected} {of_field}")


def check_num_inputs(field: str, num_inputs: int, max_batch_tokens: int | None = None) -> None:
    """At least one input, at most an executor's batch (`max_batch_tokens`, when given)."""
    if num_inputs == 0:
        _fail(f"{field} is empty")
    if max_batch_tokens is not None and num_inputs > max_batch_tokens:
        _fail(f"{num_inputs} {field} exceed the executor's max_batch_tokens {max_batch_tokens}")


# ---- LENGTH RULE, MASK RULE, outputs -------------------------------------------------------------


def check_context(kv_page_ids: Sequence[int], kv_last_page_length: int, page_size: int, num_inputs: int,
                  max_pages: int | None = None) -> int:
    """The LENGTH RULE: the pages span the context and the `num_inputs` slots written after it (with
    continuation, its steps count as inputs); the pages are distinct. Returns num_context."""
    num_pages = len(kv_page_ids)
    if num_pages == 0:
        _fail("kv_page_ids is empty (the context needs at least one page)")
    if max_pages is not None and num_pages > max_pages:
        _fail(f"kv_page_ids lists {num_pages} pages, more than max_kv_pages_per_instance {max_pages}")
    if not 0 < kv_last_page_length <= page_size:
        _fail(f"kv_last_page_length {kv_last_page_length} is not in [1, kv_page_size={page_size}]")
    total = context_slots(num_pages, kv_last_page_length, page_size)
    if num_inputs > total:
        _fail(f"{num_inputs} inputs do not fit the {total} token slots of {num_pages} pages (length rule)")
    if num_pages > 1 and len(set(kv_page_ids)) != num_pages:
        _fail(f"kv_page_ids lists a page twice: {list(kv_page_ids)[:16]}")
    return total - num_inputs


def check_brle(field: str, runs: Sequence[int], expected_length: int) -> None:
    """A BRLE mask of exactly `expected_length` values, its runs counted (at most 2 x values + 1,
    `l4m.wire.limits.max_brle_runs`) before they are summed."""
    max_runs = limits.max_brle_runs(expected_length)
    if len(runs) > max_runs:
        _fail(f"{field} has {len(runs)} runs, more than the {max_runs} a mask of {expected_length} values may have "
              "(2 x values + 1)")
    if runs and min(runs) < 0:
        _fail(f"{field} has a negative run ({min(runs)})")
    length = sum(runs)
    if length != expected_length:
        _fail(f"{field} decodes to {length} values, expected {expected_length}")


def check_mask_rows(rows: Sequence[Sequence[int]], num_context: int, num_tokens: int) -> None:
    """The MASK RULE: no rows (plain causal attention) or one per token, row i of num_context + i + 1 values."""
    if not rows:
        return
    if len(rows) != num_tokens:
        _fail(f"attention_masks has {len(rows)} rows for {num_tokens} tokens (mask rule: none or one per token)")
    for i, row in enumerate(rows):
        check_brle(f"attention_masks[{i}]", row, num_context + i + 1)


def check_mask_runs(num_runs: int, max_runs: int) -> None:
    """The BRLE runs of all of one command's masks, counted (not summed), within the per-command bound."""
    if num_runs > max_runs:
        _fail(f"the masks carry {num_runs} BRLE runs in all, more than max_mask_runs_per_command {max_runs} "
              "(GetInfo tells it)")


def check_outputs(output_indices: Sequence[int], num_inputs: int) -> None:
    """Distinct indices into the inputs, so at most one output per input."""
    if not output_indices:
        return
    if len(output_indices) > num_inputs:
        _fail(f"output_indices lists {len(output_indices)} indices for {num_inputs} inputs (at most one each)")
    _check_range("output_indices", "", output_indices, num_inputs, "num_inputs")
    if len(output_indices) > 1 and len(set(output_indices)) != len(output_indices):
        _fail("output_indices lists an index twice")


# ---- samplers ------------------------------------------------------------------------------------


def sampler_kind_name(kind: int | str) -> str | None:
    """The name of a sampler kind given by name or enum number; None for no known kind."""
    name = _SAMPLER_KINDS.get(kind, kind)  # type: ignore[call-overload]
    return name if name in (DISTRIBUTION, GREEDY, SAMPLE) else None


def check_distribution_top_k(distribution_top_k: int, vocab_size: int | None = None) -> None:
    """DISTRIBUTION: in [1, vocab_size] (only > 0 when the vocabulary is not known yet)."""
    if distribution_top_k <= 0 or (vocab_size is not None and distribution_top_k > vocab_size):
        bound = "vocab_size" if vocab_size is None else f"vocab_size={vocab_size}"
        _fail(f"distribution_top_k {distribution_top_k} is not in [1, {bound}]")


def check_sample(temperature: float, top_k: int, top_p: float, min_p: float, vocab_size: int | None = None) -> None:
    """SAMPLE's parameters: temperature finite > 0; top_k in [0, vocab_size] (0 = off); top_p in [0, 1]
    (0 or 1 = off); min_p in [0, 1) (0 = off)."""
    if not (temperature > 0 and math.isfinite(temperature)):
        _fail(f"temperature {temperature} is not a finite number > 0")
    if top_k < 0 or (vocab_size is not None and top_k > vocab_size):
        bound = "vocab_size" if vocab_size is None else f"vocab_size={vocab_size}"
        _fail(f"top_k {top_k} is not in [0, {bound}] (0 = off)")
    if not 0 <= top_p <= 1:
        _fail(f"top_p {top_p} is not in [0, 1] (0 or 1 = off)")
    if not 0 <= min_p < 1:
        _fail(f"min_p {min_p} is not in [0, 1) (0 = off)")


def check_seed(seed: int | None) -> None:
    """A seed, when given, is a uint64."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        _fail(f"seed {seed} is not in [0, 2^64 - 1]")


def check_vocabulary_mask(runs: Sequence[int], vocab_size: int) -> None:
    """Empty (every token allowed) or vocab_size values, first run ALLOWED, allowing some token."""
    if not runs:
        return
    check_brle("vocabulary_mask", runs, vocab_size)
    if not any(runs[0::2]):
        _fail("vocabulary_mask allows no token")


def check_logit_bias(token_ids: Sequence[int], values: Sequence[float], vocab_size: int | None = None) -> None:
    """A logit bias: as many values as ids, at most MAX_LOGIT_BIAS_ENTRIES, each id in the vocabulary
    and listed once, each value finite."""
    if len(token_ids) != len(values):
        _fail(f"logit_bias_token_ids has {len(token_ids)} entries but logit_bias_values {len(values)}; they must match")
    if len(token_ids) > MAX_LOGIT_BIAS_ENTRIES:
        _fail(f"logit_bias has {len(token_ids)} entries, more than {MAX_LOGIT_BIAS_ENTRIES}")
    if vocab_size is not None:
        check_token_ids("logit_bias_token_ids", token_ids, vocab_size)
    elif any(t < 0 for t in token_ids):
        _fail("logit_bias_token_ids has a negative token id")
    if len(set(token_ids)) != len(token_ids):
        _fail("logit_bias_token_ids lists a token id twice")
    for token_id, value in zip(token_ids, values, strict=True):
        if not math.isfinite(value):
            _fail(f"logit_bias value {value} of token {token_id} is not finite")


def check_top_logprobs(top_logprobs: int, kind: int | str = GREEDY) -> None:
    """top_logprobs in [0, MAX_TOP_LOGPROBS], and 0 for DISTRIBUTION (which returns its own top-k)."""
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        _fail(f"top_logprobs {top_logprobs} is not in [0, {MAX_TOP_LOGPROBS}]")
    if top_logprobs and sampler_kind_name(kind) == DISTRIBUTION:
        _fail("top_logprobs must be 0 for a DISTRIBUTION sampler (it returns its own top distribution_top_k)")


def check_sampler(kind: int | str, *, distribution_top_k: int, temperature: float, top_k: int, top_p: float,
                  min_p: float, seed: int | None, vocabulary_mask: Sequence[int], vocab_size: int,
                  logit_bias_token_ids: Sequence[int] = (), logit_bias_values: Sequence[float] = (),
                  top_logprobs: int = 0) -> None:
    """One SamplerSpec: a known kind, that kind's parameters, the seed, the vocabulary mask, the logit
    bias and top_logprobs."""
    name = sampler_kind_name(kind)
    if name is None:
        _fail(f"kind {kind!r} is not DISTRIBUTION, GREEDY or SAMPLE")
    if name == DISTRIBUTION:
        check_distribution_top_k(distribution_top_k, vocab_size)
    elif name == SAMPLE:
        check_sample(temperature, top_k, top_p, min_p, vocab_size)
    # What is absent passes its check: skipped (one sampler per decode step is the scheduler's hot path).
    if seed is not None:
        check_seed(seed)
    if len(vocabulary_mask):
        check_vocabulary_mask(vocabulary_mask, vocab_size)
    if len(logit_bias_token_ids) or len(logit_bias_values):
        check_logit_bias(logit_bias_token_ids, logit_bias_values, vocab_size)
    if top_logprobs:
        check_top_logprobs(top_logprobs, name)


# ---- per command kind ----------------------------------------------------------------------------


def check_forward_text(*, kv_page_ids: Sequence[int], kv_last_page_length: int, token_ids: Sequence[int],
                       position_ids: Sequence[int], attention_masks: Sequence[Sequence[int]],
                       output_indices: Sequence[int], num_samplers: int, num_continuation_steps: int,
                       vocab_size: int, max_context: int, page_size: int, max_pages: int | None = None,
                       max_batch_tokens: int | None = None) -> int:
    """A ForwardTextItem's lengths, tokens, positions, mask rows and outputs (its samplers:
    `check_sampler`; its continuation: `check_continuation`). Returns num_context."""
    num_tokens = len(token_ids)
    check_num_inputs("token_ids", num_tokens, max_batch_tokens)
    check_count("position_ids", len(position_ids), "token_ids", num_tokens)
    # The length rule counts the continuation slots.
    num_context = check_context(kv_page_ids, kv_last_page_length, page_size, num_tokens + num_continuation_steps,
                                max_pages)
    check_token_ids("token_ids", token_ids, vocab_size)
    check_position_ids("position_ids", position_ids, max_context)
    if num_samplers > num_tokens:
        _fail(f"samplers has {num_samplers} entries for {num_tokens} token_ids (at most one output each)")
    check_mask_rows(attention_masks, num_context, num_tokens)
    check_outputs(output_indices, num_tokens)
    check_count("samplers", num_samplers, "output_indices", len(output_indices))
    return num_context


def check_continuation(*, num_steps: int, stop_token_ids: Collection[int], num_tokens: int,
                       output_indices: Sequence[int], num_mask_rows: int, sampler_kind: int | str | None,
                       has_vocabulary_mask: bool, last_position: int, vocab_size: int, max_context: int,
                       max_steps: int = MAX_CONTINUATION_STEPS) -> None:
    """CONTINUATION (for an item with steps or stop ids): at most `max_steps` steps; stop ids only with
    steps; plain causal attention; one output, the last token's; its sampler GREEDY or SAMPLE without
    a vocabulary mask (its token is fed back); stop ids in the vocabulary; every fed position within
    max_context_tokens. (The LENGTH RULE's count of the steps is `check_context`'s.)"""
    check_continuation_steps(num_steps, max_steps)
    if num_steps == 0:
        _fail("continuation_stop_token_ids is set but num_continuation_steps is 0")
    if num_mask_rows:
        _fail("continuation needs plain causal attention: attention_masks must be empty")
    if list(output_indices) != [num_tokens - 1]:
        _fail(f"continuation needs exactly one output index, the last token's ({num_tokens - 1}), "
              f"not {list(output_indices)}")
    if sampler_kind is None or sampler_kind_name(sampler_kind) not in (GREEDY, SAMPLE) or has_vocabulary_mask:
        _fail("continuation needs a GREEDY or SAMPLE sampler without a vocabulary mask (its token is fed back)")
    check_token_ids("continuation_stop_token_ids", stop_token_ids, vocab_size)
    if continuation_position(last_position, num_steps) >= max_context:
        _fail(f"{num_steps} continuation steps after position {last_position} pass max_context_tokens "
              f"{max_context}")


def check_continuation_steps(num_steps: int, max_steps: int = MAX_CONTINUATION_STEPS) -> None:
    """num_continuation_steps in [0, max_steps] (0: no continuation)."""
    if not 0 <= num_steps <= max_steps:
        _fail(f"num_continuation_steps {num_steps} is not in [0, max_continuation_steps={max_steps}]")


def check_forward(*, kv_page_ids: Sequence[int], kv_last_page_length: int, num_inputs: int,
                  output_indices: Sequence[int], num_output_slots: int, page_size: int,
                  max_pages: int | None = None, max_batch_tokens: int | None = None) -> int:
    """A ForwardItem: at least one input, the LENGTH RULE, outputs, one slot per output. Returns num_context."""
    check_num_inputs("input_embed_slot_ids", num_inputs, max_batch_tokens)
    num_context = check_context(kv_page_ids, kv_last_page_length, page_size, num_inputs, max_pages)
    check_outputs(output_indices, num_inputs)
    check_count("output_embed_slot_ids", num_output_slots, "output_indices", len(output_indices))
    return num_context


def check_embed_text(*, embed_slot_ids: Sequence[int], token_ids: Sequence[int], position_ids: Sequence[int],
                     vocab_size: int, max_context: int, max_slots: int | None = None) -> None:
    """An EmbedTextItem: distinct slots, one token and one position per slot, each in range."""
    check_ids("embed_slot_ids", embed_slot_ids, max_slots)
    num_slots = len(embed_slot_ids)
    if len(token_ids) != num_slots or len(position_ids) != num_slots:
        _fail(f"embed_text has {num_slots} embed_slot_ids, {len(token_ids)} token_ids and "
              f"{len(position_ids)} position_ids; they must match")
    check_token_ids("token_ids", token_ids, vocab_size)
    check_position_ids("position_ids", position_ids, max_context)


def check_sample_top_k(k: int, vocab_size: int) -> None:
    """A SampleTopKItem's k in [1, vocab_size]."""
    if not 0 < k <= vocab_size:
        _fail(f"k {k} is not in [1, vocab_size={vocab_size}]")


def check_copy(source_offset: int, destination_offset: int, length: int, page_size: int) -> None:
    """A CopyKvPageItem: at least one slot; both ranges inside a page."""
    if length <= 0:
        _fail(f"length_tokens is {length}, not > 0")
    for name, offset in (("source", source_offset), ("destination", destination_offset)):
        if offset < 0 or offset + length > page_size:
            _fail(f"{name} range [{offset}, {offset + length}) exceeds kv_page_size {page_size}")


def check_page_visibility(runs: Sequence[int], page_size: int) -> None:
    """A MaskKvPageItem's visibility: exactly kv_page_size values."""
    check_brle("visibility", runs, page_size)


def check_resource_kind(kind: int | str) -> str:
    """KV_PAGE or EMBED_SLOT (by name or enum number); returns the name."""
    name = _RESOURCE_KINDS.get(kind, kind)  # type: ignore[call-overload]
    if name not in (KV_PAGE, EMBED_SLOT):
        _fail(f"kind {kind!r} is not KV_PAGE or EMBED_SLOT")
    return name  # type: ignore[no-any-return]


def check_reply(kind: str, num_entries: int, num_bytes: int, max_entries: int, max_bytes: int) -> None:
    """What one command's reply may hold (`l4m.wire.limits.reply_cost`): distribution entries (top_logprobs
    alternatives count as entries too) and bytes."""
    if num_entries > max_entries:
        what = f"k {num_entries} asks for" if kind == "sample_top_k" else \
            f"samplers ask for {num_entries} distribution entries (outputs x distribution_top_k),"
        _fail(f"{what} more than max_distribution_entries_per_command {max_entries} (GetInfo tells it)")
    if num_bytes > max_bytes:
        _fail(f"the reply could take {num_bytes} bytes, more than max_reply_bytes {max_bytes} "
              "(fewer outputs or a smaller distribution_top_k)")


def check_export_name(name: str, max_bytes: int) -> None:
    """An export's name: 1 to `max_bytes` bytes of UTF-8."""
    size = len(name.encode())
    if not 0 < size <= max_bytes:
        _fail(f"name {name[:40]!r} is {size} bytes, not in [1, {max_bytes}]")


def check_export_metadata(num_bytes: int, max_bytes: int) -> None:
    if num_bytes > max_bytes:
        _fail(f"metadata is {num_bytes} bytes, more than {max_bytes}")


def check_stream_priority(priority: int) -> None:
    if priority not in _STREAM_PRIORITIES:
        _fail(f"priority {priority} is not LOW, NORMAL or HIGH")
