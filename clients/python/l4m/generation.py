"""Generation: the decode loop of one Context, and what it yields.

`Context.generate` returns a `Generation`: async-iterate it for `Token`s, or await it for the
`Completion`. Each step it samples (one round trip, or with L4M continuation up to
`1 + max_continuation_steps` tokens per round trip), applies the constraint's forced tokens and mask,
and checks the stop condition; the text is decoded as it goes, or lazily when no stop condition reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Generator
from typing import TYPE_CHECKING, Any

from l4m.sampler import Greedy, Sample, Sampler
from l4m.stop import Stop, StopCondition, needs_text, token_bounds
from l4m.tokenizer import StreamDecoder

if TYPE_CHECKING:
    from l4m.constraint import Constraint
    from l4m.context import Context

# Continuation steps a generation asks for when its stop condition reads token ids only (see
# `Context.step_many`): one round trip per up to 9 tokens, streamed in bursts of as many.
DEFAULT_CONTINUATION_STEPS = 8


# A constraint mask that took less than this is computed on the event loop's thread next time.
MASK_INLINE_BELOW_S = 0.002


def _timed_mask(constraint: Constraint) -> tuple[list[int], float]:
    started = time.perf_counter()
    return constraint.mask(), time.perf_counter() - started


class Token:
    """One generated token and the text it adds to the visible output (may be "" while held back).

    Immutable. When no stop condition needs the text, `text` is decoded on first access (a controller
    that only reads token ids never loads the tokenizer); its value is the same either way."""

    __slots__ = ("token_id", "logprob", "forced", "top_logprobs", "_text", "_generation", "_index")

    def __init__(self, token_id: int, logprob: float, text: str, forced: bool = False,
                 top_logprobs: tuple[tuple[int, float], ...] = ()) -> None:
        object.__setattr__(self, "token_id", token_id)
        object.__setattr__(self, "logprob", logprob)
        object.__setattr__(self, "forced", forced)  # fast-forwarded by a constraint, not sampled
        # The sampler's `top_logprobs` alternatives of this step, (token id, logprob) most probable first;
        # empty when it asked for none (and for a forced token).
        object.__setattr__(self, "top_logprobs", top_logprobs)
        object.__setattr__(self, "_text", text)
        object.__setattr__(self, "_generation", None)

    @classmethod
    def _lazy(cls, token_id: int, logprob: float, forced: bool, generation: Generation, index: int,
              top_logprobs: tuple[tuple[int, float], ...] = ()) -> Token:
        token = cls(token_id, logprob, "", forced, top_logprobs)
        object.__setattr__(token, "_text", None)
        object.__setattr__(token, "_generation", generation)
        object.__setattr__(token, "_index", index)
        return token

    @property
    def text(self) -> str:
        if self._text is None:
            object.__setattr__(self, "_text", self._generation._delta_of(self._index))
            object.__setattr__(self, "_generation", None)
        return self._text

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Token is immutable (cannot set {name!r})")

    def _key(self) -> tuple[int, float, str, bool, tuple[tuple[int, float], ...]]:
        return (self.token_id, self.logprob, self.text, self.forced, self.top_logprobs)

    def __eq__(self, other: object) -> bool:
        return self._key() == other._key() if isinstance(other, Token) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Token(token_id={self.token_id!r}, logprob={self.logprob!r}, text={self.text!r}, forced={self.forced!r})"


class Completion:
    """The whole result of a generation. `text` may be decoded on first access (see `Token`)."""

    def __init__(self, text: str = "", token_ids: list[int] | None = None, logprobs: list[float] | None = None,
                 stop: Stop | None = None) -> None:
        self._text: str | None = text
        self._text_source: Generation | None = None
        self.token_ids: list[int] = [] if token_ids is None else token_ids
        self.logprobs: list[float] = [] if logprobs is None else logprobs
        self.stop = stop
        # Per token, the sampler's top_logprobs alternatives ((token id, logprob), ...); filled only when
        # the sampler asks for some (a forced token has none).
        self.top_logprobs: list[tuple[tuple[int, float], ...]] = []

    @property
    def text(self) -> str:
        if self._text_source is not None:
            self._text = self._text_source._visible_text_of(len(self.token_ids))
            if self.stop is not None:
                self._text_source = None  # final
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self._text_source = value, None

    @property
    def logprob(self) -> float:
        return float(sum(self.logprobs))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Completion):
            return NotImplemented
        return (self.text, self.token_ids, self.logprobs, self.stop, self.top_logprobs) == (
            other.text, other.token_ids, other.logprobs, other.stop, other.top_logprobs)

    __hash__ = None  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return (f"Completion(text={self.text!r}, token_ids={self.token_ids!r}, logprobs={self.logprobs!r}, "
                f"stop={self.stop!r})")


class Generation:
    """A generation in progress: async-iterate for `Token`s, or await for the `Completion`.

    When the stop condition does not read the text (token ids, length), the text is not decoded while
    generating: `Token.text` and `Completion.text` decode it on first access, in token order (the same
    values as decoding as we go, without loading the tokenizer for controllers that never ask)."""

    def __init__(self, context: Context, sampler: Sampler, stop: StopCondition, constraint: Constraint | None,
                 max_continuation_steps: int = 0) -> None:
        self._context = context
        self._sampler = sampler
        self._stop = stop
        self._constraint = constraint
        # (most tokens the stop lets through or None, its stop token ids) when the executor may decode on
        # by itself (`step_many`); None when every step must come back here (a constraint's mask, or
        # penalties: each step's bias depends on the tokens before it).
        self._continuation = (
            token_bounds(stop)
            if constraint is None and max_continuation_steps > 0 and isinstance(sampler, (Greedy, Sample))
            and not sampler.has_penalties
            else None
        )
        self._with_top_logprobs = bool(getattr(sampler, "top_logprobs", 0))
        self._max_continuation_steps = max_continuation_steps
        # How long the constraint's last mask took (None: none yet). A quick one is computed inline: handing
        # it to a thread and back costs more CPU than it does (bench/sdk.py, json-schema); a slow one goes to
        # a thread, so the controller's other work goes on meanwhile.
        self._mask_s: float | None = None
        self._is_text_lazy = not needs_text(stop)
        self._decoder: StreamDecoder | None = None
        self._num_emitted_chars = 0
        self._num_decoded = 0  # lazy: tokens whose text was computed
        self._deltas: list[str] = []  # lazy: the text each token added
        self._visible_text = ""
        self.completion = Completion()
        if self._is_text_lazy:
            self.completion._text_source = self

    def __aiter__(self) -> AsyncIterator[Token]:
        return self._run()

    def __await__(self) -> Generator[Any, None, Completion]:
        return self._drain().__await__()

    async def _drain(self) -> Completion:
        async for _ in self._run():
            pass
        return self.completion

    async def _run(self) -> AsyncIterator[Token]:
        context, constraint, sampler = self._context, self._constraint, self._sampler
        step_index = 0
        if constraint is not None:
            # Overlap: the prompt is fed while the first mask is computed.
            context.flush()
        while self.completion.stop is None:
            for token_id in constraint.forced_tokens() if constraint is not None else []:
                context.fill([token_id])
                yield self._accept(token_id, 0.0, forced=True)
                if self.completion.stop is not None:
                    return
            num_steps = self._num_continuation_steps()
            if num_steps > 0:
                tokens = await context.step_many(sampler, num_steps, self._continuation[1], step_index)  # type: ignore[index]
                step_index += len(tokens)
                for index, sampled in enumerate(tokens):
                    yield self._accept(sampled.token_id, sampled.logprob, top_logprobs=sampled.top_logprobs)
                    if self.completion.stop is not None:
                        # Only the last can stop (the executor stops on the stop tokens and the step
                        # count respects the length); a condition that stops earlier gets the rest back.
                        context.rollback(len(tokens) - 1 - index)
                        return
                continue
            mask = await self._next_mask(constraint) if constraint is not None else None
            step_sampler = sampler.penalized(self.completion.token_ids) if sampler.has_penalties else sampler
            token = (await context.step(step_sampler, mask, step_index)).token
            step_index += 1
            token_id = token.token_id
            context.fill((token_id,))
            yield self._accept(token_id, token.logprob, top_logprobs=token.top_logprobs)

    async def _next_mask(self, constraint: Constraint) -> list[int]:
        """The constraint's mask for the next step: inline when the last one was quick (under
        MASK_INLINE_BELOW_S), on a thread otherwise (the first one too: it overlaps the prompt's feed)."""
        if self._mask_s is not None and self._mask_s < MASK_INLINE_BELOW_S:
            started = time.perf_counter()
            mask = constraint.mask()
            self._mask_s = time.perf_counter() - started
            return mask
        mask, self._mask_s = await asyncio.to_thread(_timed_mask, constraint)
        return mask

    def _num_continuation_steps(self) -> int:
        """Steps the executor may decode on by itself now; 0: one step, here. The first token comes alone:
        its wait is the time to first token, which continuation would stretch by every step it adds."""
        context = self._context
        if self._continuation is None or context.window is not None or not self.completion.token_ids:
            return 0
        max_tokens, _ = self._continuation
        num_steps = min(self._max_continuation_steps, context.model.max_continuation_steps)
        if max_tokens is not None:
            num_steps = min(num_steps, max_tokens - len(self.completion.token_ids) - 1)
        return max(num_steps, 0)

    def _accept(self, token_id: int, logprob: float, forced: bool = False,
                top_logprobs: tuple[tuple[int, float], ...] = ()) -> Token:
        completion = self.completion
        completion.token_ids.append(token_id)
        completion.logprobs.append(logprob)
        if self._with_top_logprobs:
            completion.top_logprobs.append(top_logprobs)
        if self._is_text_lazy:
            stop = self._stop.check(completion.token_ids, "")
            stop = self._check_constraint(token_id, stop)
            if stop is not None:
                completion.stop = stop
            return Token._lazy(token_id, logprob, forced, self, len(completion.token_ids) - 1, top_logprobs)
        text = self._push_text(token_id)
        stop = self._check_constraint(token_id, self._stop.check(completion.token_ids, text))
        if stop is not None:
            completion.stop = stop
        return Token(token_id, logprob, self._emit(text, stop), forced, top_logprobs)

    def _check_constraint(self, token_id: int, stop: Stop | None) -> Stop | None:
        if stop is None and self._constraint is not None:
            self._constraint.consume(token_id)  # raises ConstraintError on a token the grammar refuses
            if self._constraint.is_finished():
                return Stop("constraint")
        return stop

    def _push_text(self, token_id: int) -> str:
        if self._decoder is None:
            self._decoder = StreamDecoder(self._context.model.tokenizer)
        self._decoder.push(token_id)
        return self._decoder.text

    def _emit(self, text: str, stop: Stop | None) -> str:
        """Cut the visible text after a token; the part of it not emitted yet."""
        if stop is not None:
            visible_end = len(text) if stop.text_end is None else stop.text_end
        else:
            visible_end = len(text) - self._stop.holdback(text)
        visible = text[:visible_end] if visible_end < len(text) else text
        if self._is_text_lazy:
            self._visible_text = visible
        else:
            self.completion.text = visible
        delta = visible[self._num_emitted_chars:]
        self._num_emitted_chars = max(self._num_emitted_chars, len(visible))
        return delta

    def _decode_up_to(self, num_tokens: int) -> None:
        """Lazy text: decode the tokens before `num_tokens` not decoded yet, as `_accept` would have."""
        token_ids = self.completion.token_ids
        while self._num_decoded < num_tokens:
            index = self._num_decoded
            text = self._push_text(token_ids[index])
            # Only the last token stopped; a lazy stop never cuts text (no text_end, no holdback).
            stop = self.completion.stop if index == len(token_ids) - 1 else None
            self._deltas.append(self._emit(text, stop))
            self._num_decoded += 1

    def _delta_of(self, index: int) -> str:
        self._decode_up_to(index + 1)
        return self._deltas[index]

    def _visible_text_of(self, num_tokens: int) -> str:
        self._decode_up_to(num_tokens)
        return self._visible_text
