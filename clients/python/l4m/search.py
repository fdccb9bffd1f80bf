"""Beam search over forked Contexts.

Every step asks each live beam for its top `beam_width` next tokens (all beams in parallel, each on
its own stream, so the scheduler batches them), keeps the `beam_width` best continuations by total
log-probability, and forks a beam only when more than one of its continuations survives (the first
one continues in the beam's own Context).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from dataclasses import dataclass

from l4m.context import Context


@dataclass(frozen=True)
class Beam:
    token_ids: tuple[int, ...]
    logprob: float
    text: str
    is_finished: bool  # ended with a stop token (else max_tokens was reached)


async def beam_search(
    context: Context,
    beam_width: int,
    max_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
) -> list[Beam]:
    """The `beam_width` best continuations of `context` (left unchanged), best first."""
    if beam_width <= 0 or max_tokens <= 0:
        raise ValueError("beam_width and max_tokens must be > 0")
    model = context.model
    stop = frozenset(model.stop_token_ids if stop_token_ids is None else stop_token_ids)
    live: list[tuple[Context, tuple[int, ...], float]] = [(context.fork(), (), 0.0)]
    finished: list[tuple[tuple[int, ...], float]] = []
    for _ in range(max_tokens):
        distributions = await asyncio.gather(*(c.next_distribution(beam_width) for c, _, _ in live))
        candidates = sorted(
            ((score + math.log(max(p, 1e-30)), i, token)
             for i, ((_, _, score), (tokens, probabilities)) in enumerate(zip(live, distributions, strict=True))
             for token, p in zip(tokens, probabilities, strict=True)),
            key=lambda c: -c[0],
        )[:beam_width]
        live = await _expand(live, candidates, stop, finished)
        if not live or _is_settled(live, finished, beam_width):
            break
    results = [(tokens, score, True) for tokens, score in finished] + [(t, s, False) for _, t, s in live]
    await asyncio.gather(*(c.free() for c, _, _ in live))
    results.sort(key=lambda r: -r[1])
    tokenizer = model.tokenizer
    return [Beam(t, s, tokenizer.decode(t), f) for t, s, f in results[:beam_width]]


async def _expand(live: list[tuple[Context, tuple[int, ...], float]], candidates: list[tuple[float, int, int]],
                  stop: frozenset[int], finished: list[tuple[tuple[int, ...], float]]
                  ) -> list[tuple[Context, tuple[int, ...], float]]:
    chosen: dict[int, list[tuple[float, int]]] = {}
    for score, parent, token in candidates:
        chosen.setdefault(parent, []).append((score, token))
    next_live, to_free = [], []
    for parent, (context, tokens, _) in enumerate(live):
        picks = chosen.get(parent, [])
        if not picks:
            to_free.append(context)
            continue
        contexts = [context] + [context.fork() for _ in picks[1:]]  # fork before appending
        for child, (score, token) in zip(contexts, picks, strict=True):
            if token in stop:
                finished.append((tokens + (token,), score))
                to_free.append(child)
            else:
                child.fill([token])
                next_live.append((child, tokens + (token,), score))
    await asyncio.gather(*(c.free() for c in to_free))
    return next_live


def _is_settled(live: list[tuple[Context, tuple[int, ...], float]], finished: list[tuple[tuple[int, ...], float]],
                beam_width: int) -> bool:
    """Scores only fall: once `beam_width` finished beams beat every live one, nothing can change."""
    if len(finished) < beam_width:
        return False
    worst_kept = sorted((s for _, s in finished), reverse=True)[beam_width - 1]
    return worst_kept >= max(s for _, _, s in live)
