"""Continuation: a forward_text item that decodes on by itself, feeding back each token it samples.

A batch with continuation runs as a first pass (every item as if it had no continuation slots), then
one batched single-token step at a time over the items still going, until each has run its steps or
sampled one of its stop tokens. This module plans the items (`plan_continuations`) and drives the
steps (`run_continuations`) through a callback that runs one plain forward_text batch, so it never
touches tensors itself. Where every continuing item samples greedily, the engine may instead hand
all the steps to one callback that runs them on the device (`run_continuations_on_device`, with
`decode_graphs.StaticDecoder.continue_greedy`): the outputs are the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from l4m.executor.checks import PreparedItem, blame_item, check_continuation, check_no_write_collision
from l4m.executor.commands import ForwardText, ForwardTextResult, SampledToken, SamplerKind
from l4m.wire import rules

if TYPE_CHECKING:
    from l4m.executor.kv_cache import KvCache
    from l4m.executor.weights import ModelConfig

ForwardOnce = Callable[[Sequence[ForwardText]], list[ForwardTextResult]]
# (the continuing plans, the token each feeds first) -> per plan, (token, logprob) of every step run
ContinueGreedy = Callable[[Sequence["Continuation"], Sequence[int]], list[list[tuple[int, float]]]]


class Continuation:
    """One forward_text item of a batch with continuation: its first pass (the item as if it had no
    continuation slots) and the single-token item of each later step."""

    def __init__(self, item: ForwardText, num_steps: int, written: PreparedItem, page_size: int,
                 first_total: int) -> None:
        self.item = item
        self.num_steps = num_steps
        self.written = written  # every slot the item may write, for the batch's collision check
        self._page_size = page_size
        self._first_total = first_total
        if num_steps == 0:
            self.first_pass = item
            return
        self.first_pass = dataclasses.replace(
            item, num_continuation_steps=0, continuation_stop_token_ids=frozenset(),
            **self._pages(first_total),
        )

    def _pages(self, total: int) -> dict[str, object]:
        num_pages = -(-total // self._page_size)
        return {"kv_page_ids": self.item.kv_page_ids[:num_pages],
                "kv_last_page_length": total - self._page_size * (num_pages - 1)}

    @property
    def first_total(self) -> int:
        """Tokens in the item's pages after its first pass: step 1 writes the slot of this index."""
        return self._first_total

    @property
    def greedy(self) -> bool:
        """Every step samples greedily with no vocabulary mask, logit bias or top logprobs: what the device
        loop runs (its step is a plain argmax and one logprob; anything else takes the host loop, whose
        steps still run through the static decode step)."""
        (sampler,) = self.item.samplers
        return (sampler.kind is SamplerKind.GREEDY and not sampler.vocab_mask
                and not sampler.logit_bias_token_ids and not sampler.top_logprobs)

    def stops(self, output: object) -> bool:
        return getattr(output, "token_id", None) in self.item.continuation_stop_token_ids

    def step_item(self, step: int, token_id: int) -> ForwardText:
        """Continuation step `step` (1-based): feed `token_id`, the last one sampled, and sample the next."""
        (sampler,) = self.item.samplers
        if sampler.seed is not None:  # as the SDK numbers a generation's steps: step i draws with seed + i
            sampler = dataclasses.replace(sampler, seed=rules.step_seed(sampler.seed, step))
        position = self.item.position_ids[-1] + step
        return ForwardText(token_ids=(token_id,), position_ids=(position,), output_indices=(0,),
                           samplers=(sampler,), **self._pages(self._first_total + step))  # type: ignore[arg-type]


def plan_continuation(item: ForwardText, cache: KvCache, model: ModelConfig, where: str) -> Continuation:
    """Checks the item (`checks.check_continuation`); the first pass is the item without its
    continuation slots."""
    written = check_continuation(item, cache, model, where)
    if item.num_continuation_steps == 0:
        return Continuation(item, 0, written, cache.page_size, 0)
    first_total = written.layout.num_ctx + len(item.token_ids)
    return Continuation(item, item.num_continuation_steps, written, cache.page_size, first_total)


def plan_continuations(items: Sequence[ForwardText], cache: KvCache, model: ModelConfig) -> list[Continuation]:
    """Every item's plan, checked as one batch: no two items may write one slot, counting every slot a
    continuation may write."""
    plans = []
    for n, item in enumerate(items):
        with blame_item(n):
            plans.append(plan_continuation(item, cache, model, f"forward_text item {n}"))
    check_no_write_collision([plan.written for plan in plans], cache.page_size, "forward_text")
    return plans


def run_continuations(plans: Sequence[Continuation], forward_once: ForwardOnce) -> list[ForwardTextResult]:
    """The first pass of every item, then the batched steps of those still going; each item's outputs
    are its first pass's, then one per step."""
    results = forward_once([plan.first_pass for plan in plans])
    outputs = [list(result.outputs) for result in results]
    active = [n for n, plan in enumerate(plans) if plan.num_steps and not plan.stops(outputs[n][-1])]
    step = 0
    while active:
        step += 1
        answers = forward_once([plans[n].step_item(step, outputs[n][-1].token_id) for n in active])
        for n, answer in zip(active, answers, strict=True):
            outputs[n].append(answer.outputs[0])
        active = [n for n in active if plans[n].num_steps > step and not plans[n].stops(outputs[n][-1])]
    return [ForwardTextResult(tuple(o)) for o in outputs]


def run_continuations_on_device(
    plans: Sequence[Continuation], forward_once: ForwardOnce, continue_greedy: ContinueGreedy
) -> list[ForwardTextResult]:
    """`run_continuations` with the steps after the first pass handed to `continue_greedy` in one call
    (every continuing plan must be `greedy`)."""
    results = forward_once([plan.first_pass for plan in plans])
    outputs = [list(result.outputs) for result in results]
    active = [n for n, plan in enumerate(plans) if plan.num_steps and not plan.stops(outputs[n][-1])]
    if active:
        steps = continue_greedy([plans[n] for n in active], [outputs[n][-1].token_id for n in active])
        for n, got in zip(active, steps, strict=True):
            outputs[n].extend(SampledToken(token, logprob) for token, logprob in got)
    return [ForwardTextResult(tuple(o)) for o in outputs]
