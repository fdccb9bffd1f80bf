"""Samplers applied on the device to a batch of logits, vectorized across outputs.

Order per output: logit bias (added, sparse) -> vocabulary mask (-inf outside it) -> logprobs at
temperature 1 (returned with each sampled token, with its `top_logprobs` alternatives) -> the sampler: DISTRIBUTION (top-k ids + probabilities, sorted descending), GREEDY
(argmax), SAMPLE (temperature, then top-k, top-p and min-p truncations, each renormalized, then a
draw). A seeded output draws its noise from its own `torch.Generator`, so it is reproducible
whatever else shares the batch. A SAMPLE temperature below `MIN_SAMPLE_TEMPERATURE` (the smallest
normal float32, ~1.18e-38) samples greedily: `logits / temperature` would overflow to inf and the
softmax to NaN; the logits are also shifted to max 0 before scaling, so larger temperatures never
overflow either.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from l4m.executor.commands import Distribution, SampledToken, SamplerKind, SamplerResult, SamplerSpec
from l4m.executor.errors import InvalidCommand
from l4m.wire.brle import BrleError, decode_rows

MIN_SAMPLE_TEMPERATURE = torch.finfo(torch.float32).tiny  # below it SAMPLE is GREEDY (module docstring)


def decode_vocab_masks(
    specs: Sequence[SamplerSpec], vocab_size: int, wheres: Sequence[str]
) -> np.ndarray | None:
    """`[M, vocab]` allowed-token matrix (True = allowed), or None when no output has a mask."""
    with_mask = [i for i, s in enumerate(specs) if s.vocab_mask is not None]
    if not with_mask:
        return None
    for i in with_mask:
        runs = specs[i].vocab_mask
        if any(r < 0 for r in runs) or sum(runs) != vocab_size:
            raise InvalidCommand(
                f"{wheres[i]}: vocab_mask must decode to exactly {vocab_size} values (non-negative runs), got {sum(runs)}"
            )
    try:
        decoded = decode_rows([specs[i].vocab_mask for i in with_mask], vocab_size)
    except BrleError as exc:
        raise InvalidCommand(f"vocab_mask: {exc}") from exc
    for row, i in enumerate(with_mask):
        if not decoded[row].any():
            raise InvalidCommand(f"{wheres[i]}: vocab_mask allows no token")
    allowed = np.ones((len(specs), vocab_size), dtype=bool)
    allowed[with_mask] = decoded
    return allowed


def _noise(num_rows: int, vocab_size: int, seeds: Sequence[int | None], device: torch.device) -> torch.Tensor:
    """Exponential(1) noise `[R, V]`; argmax(p / noise) is a draw from p (the exponential race)."""
    noise = torch.empty((num_rows, vocab_size), device=device).exponential_()
    for r, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device=device).manual_seed(seed)
            noise[r] = torch.empty(vocab_size, device=device).exponential_(generator=gen)
    return noise.clamp_min_(1e-30)


def _draw(logits: torch.Tensor, specs: Sequence[SamplerSpec]) -> torch.Tensor:
    """Token ids `[R]` drawn from `logits` `[R, V]` (already vocab-masked) under SAMPLE specs."""
    device = logits.device
    num_rows, vocab_size = logits.shape
    temps = torch.tensor([s.temperature for s in specs], device=device)[:, None]
    # Shifted to max 0 first: (logit - max) / temperature is <= 0, so a tiny temperature gives -inf, not inf.
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temps
    noise = _noise(num_rows, vocab_size, [s.seed for s in specs], device)
    if all(s.top_k == 0 and s.top_p in (0.0, 1.0) and s.min_p == 0.0 for s in specs):
        return (torch.softmax(scaled, dim=-1) / noise).argmax(dim=-1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size, device=device)[None, :]
    top_k = torch.tensor([s.top_k or vocab_size for s in specs], device=device)[:, None]
    keep = rank < top_k
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    top_p = torch.tensor([s.top_p if 0.0 < s.top_p < 1.0 else 1.0 for s in specs], device=device)[:, None]
    keep &= (probs.cumsum(dim=-1) - probs) < top_p  # the most likely token always survives
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    min_p = torch.tensor([s.min_p for s in specs], device=device)[:, None]
    keep &= probs >= min_p * probs[:, :1]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return sorted_ids.gather(-1, choice)[:, 0]


def add_logit_bias(logits: torch.Tensor, specs: Sequence[SamplerSpec]) -> torch.Tensor:
    """`logits` `[M, V]` with each spec's logit bias added to its row (a new tensor when any has one):
    one scatter-add over every row's entries together."""
    biased = [i for i, s in enumerate(specs) if s.logit_bias_token_ids]
    if not biased:
        return logits
    rows = [i for i in biased for _ in specs[i].logit_bias_token_ids]
    cols = [t for i in biased for t in specs[i].logit_bias_token_ids]
    values = [v for i in biased for v in specs[i].logit_bias_values]
    device = logits.device
    flat = torch.tensor(rows, device=device) * logits.shape[1] + torch.tensor(cols, device=device)
    bias = torch.tensor(values, dtype=logits.dtype, device=device)
    return logits.flatten().index_add(0, flat, bias).view_as(logits)  # ids are unique per row (rules)


def _top_logprobs(logprobs: torch.Tensor, specs: Sequence[SamplerSpec], rows: Sequence[int]
                  ) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """Per row in `rows`, its spec's `top_logprobs` most probable (ids, logprobs), most probable first;
    one topk for all of them at the largest k."""
    max_k = max((specs[i].top_logprobs for i in rows), default=0)
    if max_k == 0:
        return [((), ())] * len(rows)
    values, ids = logprobs[list(rows)].topk(max_k, dim=-1, sorted=True)
    values, ids = values.cpu().tolist(), ids.cpu().tolist()
    return [(tuple(ids[r][: specs[i].top_logprobs]), tuple(values[r][: specs[i].top_logprobs]))
            for r, i in enumerate(rows)]


def is_plain_greedy(spec: SamplerSpec) -> bool:
    return spec.kind is SamplerKind.GREEDY and not spec.logit_bias_token_ids and not spec.top_logprobs


def apply_samplers(
    logits: torch.Tensor,
    specs: Sequence[SamplerSpec],
    allowed: np.ndarray | None,
    greedy: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> list[SamplerResult]:
    """One result per row of `logits` `[M, V]` (float32), in order. `greedy` (the CPU kernels'
    `l4m_cpu.greedy`: argmax and its logprob per row, one call) serves batches whose every sampler is a
    plain greedy one (no mask, bias or top_logprobs); the same tokens as the torch path below, logprobs
    to float32 rounding."""
    if greedy is not None and allowed is None and all(is_plain_greedy(s) for s in specs):
        ids, logprobs = greedy(logits)
        return [SampledToken(t, p) for t, p in zip(ids.tolist(), logprobs.tolist(), strict=True)]
    device = logits.device
    logits = add_logit_bias(logits, specs)
    if allowed is not None:
        logits = logits.masked_fill(~torch.from_numpy(allowed).to(device), -math.inf)
    logprobs = torch.log_softmax(logits, dim=-1)
    results: list[SamplerResult | None] = [None] * len(specs)
    kinds = [s.kind for s in specs]

    dist_rows = [i for i, k in enumerate(kinds) if k is SamplerKind.DISTRIBUTION]
    if dist_rows:
        max_k = max(specs[i].distribution_top_k for i in dist_rows)
        probs, ids = logprobs[dist_rows].exp().topk(max_k, dim=-1, sorted=True)
        probs, ids = probs.cpu().tolist(), ids.cpu().tolist()
        for r, i in enumerate(dist_rows):
            k = specs[i].distribution_top_k
            results[i] = Distribution(tuple(ids[r][:k]), tuple(probs[r][:k]))

    token_rows = [i for i, k in enumerate(kinds) if k is not SamplerKind.DISTRIBUTION]
    if token_rows:
        tokens = logits[token_rows].argmax(dim=-1)
        sample_rows = [
            r for r, i in enumerate(token_rows)
            if kinds[i] is SamplerKind.SAMPLE and specs[i].temperature >= MIN_SAMPLE_TEMPERATURE
        ]
        if sample_rows:
            drawn = _draw(
                logits[[token_rows[r] for r in sample_rows]], [specs[token_rows[r]] for r in sample_rows]
            )
            tokens[sample_rows] = drawn
        chosen = logprobs[token_rows].gather(-1, tokens[:, None])[:, 0]
        tops = _top_logprobs(logprobs, specs, token_rows)
        for i, token, logprob, (top_ids, top_values) in zip(
                token_rows, tokens.cpu().tolist(), chosen.cpu().tolist(), tops, strict=True):
            results[i] = SampledToken(token, logprob, top_ids, top_values)
    return results  # type: ignore[return-value]
