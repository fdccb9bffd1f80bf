"""Chunked prefill: a forward_text with more tokens than the chunk budget runs as consecutive chunks.

A long prompt in one forward pass would need a batch of its own size (past the executor's
`max_batch_tokens` it cannot run at all) and would stall every decode step batched behind it. So when
a forward_text arrives with more `token_ids` than `prefill_chunk_tokens`, the scheduler splits it into
chunks of at most that many tokens, each a forward_text over a slice of the tokens: their positions,
their attention-mask rows, and the pages and last-page length the context has at the end of the
slice (the LENGTH RULE), so chunk j reads what chunks 0 .. j-1 wrote. The chunks queue on the
command's stream in order, one at a time (the batcher moves a chunk alone and nothing of the stream
after it), so each joins a batch with other streams' work and nothing of the stream overtakes them.

How many tokens a chunk takes: `prefill_chunk_tokens` T, at any context by default. A chunk token's
attention reads every slot before it, so a chunk deep into a long prompt costs more than one at its
start (on a 2-core CPU a 16-token chunk added ~3.5x as much to its batch's time at 3,500 tokens of
context as at 250). With `prefill_chunk_token_slots` L > 0 (what one token's own work, its linears,
costs in slots of attention), chunks shrink as their context grows so that each costs about what the
prompt's first chunk of T tokens does: chunk j at context c takes the most tokens t <= T with
`chunk_cost(t, c, L) <= chunk_cost(T, 0, L)`, and at least T / 8. The streams beside the prompt then
see the same delay from every chunk, the last ones included.

Each output index lands in the chunk that holds its token; the chunks' results are gathered here
and the command gets one reply, the unchunked pass's, when its last chunk is answered. Continuation
steps run with the last chunk only (they need the last token's output, which is there).

Pure functions and plain state: no asyncio, no I/O; the core (core.py) queues and answers.
"""

from __future__ import annotations

import math

from l4m.v1 import common_pb2
from l4m.wire import rules

# The default chunk when the scheduler is not told one (`--prefill-chunk-tokens 0`): half of the
# executors' batch, so that a chunk leaves room for decode steps beside it, and at most this many,
# so that one chunk adds a bounded delay to those steps.
DEFAULT_MAX_PREFILL_CHUNK_TOKENS = 2048


# Shrinking chunks carry at least 1 / MIN_CHUNK_SHARE of the chunk budget: each chunk is a batch and an
# item the scheduler holds until it runs, so a long prompt deep into its context stays a bounded number.
MIN_CHUNK_SHARE = 8


def chunk_cost(num_tokens: int, num_context: int, token_slots: int) -> int:
    """A chunk's cost in slots of attention: `token_slots` per token for its own work, and the slots its
    tokens read (the `num_context` before the chunk, then each token its predecessors in it and itself)."""
    return num_tokens * (token_slots + num_context) + num_tokens * (num_tokens + 1) // 2


def chunk_sizes(num_tokens: int, num_context: int, chunk_tokens: int, token_slots: int) -> list[int]:
    """The token counts of the consecutive chunks of `num_tokens` new tokens after `num_context` slots:
    `chunk_tokens` each (the last one the rest) when `token_slots` is 0, else each the most that costs
    no more than `chunk_tokens` tokens at no context (`chunk_cost`), but at least an eighth of
    `chunk_tokens` (`MIN_CHUNK_SHARE`: a command makes at most 8x the chunks of fixed-size ones)."""
    if token_slots <= 0:
        return [min(chunk_tokens, num_tokens - start) for start in range(0, num_tokens, chunk_tokens)]
    budget = chunk_cost(chunk_tokens, 0, token_slots)
    least = -(-chunk_tokens // MIN_CHUNK_SHARE)
    sizes, done = [], 0
    while done < num_tokens:
        # The largest t with t^2 / 2 + t (L + c + 1/2) <= budget, then corrected for float rounding.
        linear = token_slots + num_context + done + 0.5
        size = int(math.sqrt(linear * linear + 2 * budget) - linear)
        size = min(max(least, size), chunk_tokens, num_tokens - done)
        while size > least and chunk_cost(size, num_context + done, token_slots) > budget:
            size -= 1
        while (size < min(chunk_tokens, num_tokens - done)
               and chunk_cost(size + 1, num_context + done, token_slots) <= budget):
            size += 1
        sizes.append(size)
        done += size
    return sizes


def chunk_budget(configured: int, max_batch_tokens: int) -> int:
    """The tokens one chunk may carry: `configured` (0: the default) within the executors' batch."""
    if configured <= 0:
        configured = min(DEFAULT_MAX_PREFILL_CHUNK_TOKENS, max_batch_tokens // 2)
    return max(1, min(configured, max_batch_tokens))


class ChunkedPrefill:
    """One forward_text split into `items` (chunk items, in order) and the outputs gathered so far.

    Invariant: `output_positions[j]` lists, in order, the positions in the command's `output_indices`
    whose tokens chunk j holds; chunk j's result answers them in that order (the executor answers an
    item's outputs in its `output_indices` order), and the last chunk's continuation outputs follow."""

    __slots__ = ("items", "output_positions", "num_outputs", "outputs", "continued")

    def __init__(self, items: list[common_pb2.ForwardTextItem], output_positions: list[list[int]],
                 num_outputs: int) -> None:
        self.items = items
        self.output_positions = output_positions
        self.num_outputs = num_outputs
        self.outputs: list[common_pb2.OutputResult | None] = [None] * num_outputs
        self.continued: list[common_pb2.OutputResult] = []

    @property
    def num_chunks(self) -> int:
        return len(self.items)

    @property
    def has_outputs(self) -> bool:
        return self.num_outputs > 0

    def collect(self, index: int, result: common_pb2.ForwardTextResult) -> None:
        """Chunk `index` was answered: keep its outputs where the unchunked pass puts them."""
        positions = self.output_positions[index]
        for position, output in zip(positions, result.outputs, strict=False):
            self.outputs[position] = output
        self.continued.extend(result.outputs[len(positions):])

    def result(self) -> common_pb2.ForwardTextResult:
        """The command's reply, once every chunk was answered."""
        return common_pb2.ForwardTextResult(outputs=[*self.outputs, *self.continued])  # type: ignore[list-item]


class Chunk:
    """Chunk `index` of a `ChunkedPrefill`, carried by the chunk's batcher `Command`."""

    __slots__ = ("prefill", "index")

    def __init__(self, prefill: ChunkedPrefill, index: int) -> None:
        self.prefill = prefill
        self.index = index

    @property
    def is_last(self) -> bool:
        return self.index == self.prefill.num_chunks - 1


def split_forward_text(item: common_pb2.ForwardTextItem, page_size: int, chunk_tokens: int,
                       token_slots: int = 0) -> ChunkedPrefill | None:
    """The chunks of a (validated) forward_text with more than `chunk_tokens` tokens (`chunk_sizes`);
    None when it fits one."""
    num_tokens = len(item.token_ids)
    if chunk_tokens <= 0 or num_tokens <= chunk_tokens:
        return None
    num_steps = item.num_continuation_steps
    total = rules.context_slots(len(item.kv_page_ids), item.kv_last_page_length, page_size)
    num_context = total - num_tokens - num_steps  # slots before the first new token
    by_index = {index: position for position, index in enumerate(item.output_indices)}
    items, output_positions = [], []
    end = 0
    for size in chunk_sizes(num_tokens, num_context, chunk_tokens, token_slots):
        start, end = end, end + size
        is_last = end == num_tokens
        num_slots = num_context + end + (num_steps if is_last else 0)  # the context when the slice is in
        num_pages = -(-num_slots // page_size)
        chunk = common_pb2.ForwardTextItem(
            kv_page_ids=item.kv_page_ids[:num_pages],
            kv_last_page_length=num_slots - page_size * (num_pages - 1),
            token_ids=item.token_ids[start:end],
            position_ids=item.position_ids[start:end],
            attention_masks=item.attention_masks[start:end],  # row i's length depends only on its slot
        )
        positions = sorted(by_index[i] for i in range(start, end) if i in by_index) if by_index else []
        chunk.output_indices.extend(item.output_indices[p] - start for p in positions)
        chunk.samplers.extend(item.samplers[p] for p in positions)
        if is_last:
            chunk.num_continuation_steps = num_steps
            chunk.continuation_stop_token_ids.extend(item.continuation_stop_token_ids)
        items.append(chunk)
        output_positions.append(positions)
    return ChunkedPrefill(items, output_positions, len(item.output_indices))
