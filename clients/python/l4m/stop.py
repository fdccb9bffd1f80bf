"""Stop conditions for `Context.generate`: token ids, strings, length, and any-of them.

A condition looks at the generated token ids and the decoded text after every token and returns a
`Stop` (why, and where the text ends) or None to go on. Stop strings are cut from the returned text;
the tokens that spelled them stay in the context.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stop:
    """Why generation ended. `text_end` is where the visible text ends (a stop string is cut off)."""

    reason: str  # "token", "string", "length", "constraint"
    text_end: int | None = None


class StopCondition:
    """Base: `check` is called after each generated token."""

    def check(self, token_ids: Sequence[int], text: str) -> Stop | None:
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """How many trailing characters of `text` might still become a stop string (not streamed yet)."""
        return 0

    def __or__(self, other: StopCondition) -> StopCondition:
        return AnyOf([self, other])


@dataclass(frozen=True)
class StopOnTokens(StopCondition):
    token_ids: frozenset[int]

    def check(self, token_ids: Sequence[int], text: str) -> Stop | None:
        return Stop("token") if token_ids and token_ids[-1] in self.token_ids else None


@dataclass(frozen=True)
class StopOnStrings(StopCondition):
    strings: tuple[str, ...]

    def check(self, token_ids: Sequence[int], text: str) -> Stop | None:
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return Stop("string", min(hits)) if hits else None

    def holdback(self, text: str) -> int:
        longest = 0
        for s in self.strings:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    longest = max(longest, n)
                    break
        return longest


@dataclass(frozen=True)
class MaxTokens(StopCondition):
    max_tokens: int

    def check(self, token_ids: Sequence[int], text: str) -> Stop | None:
        return Stop("length") if len(token_ids) >= self.max_tokens else None


@dataclass(frozen=True)
class AnyOf(StopCondition):
    conditions: Sequence[StopCondition]

    def check(self, token_ids: Sequence[int], text: str) -> Stop | None:
        for condition in self.conditions:
            stop = condition.check(token_ids, text)
            if stop is not None:
                return stop
        return None

    def holdback(self, text: str) -> int:
        return max((c.holdback(text) for c in self.conditions), default=0)


def on_tokens(token_ids: Iterable[int]) -> StopOnTokens:
    return StopOnTokens(frozenset(token_ids))


def on_strings(*strings: str) -> StopOnStrings:
    if not strings or any(not s for s in strings):
        raise ValueError("stop strings must be non-empty")
    return StopOnStrings(tuple(strings))


def max_tokens(n: int) -> MaxTokens:
    if n <= 0:
        raise ValueError(f"max_tokens must be > 0 (got {n})")
    return MaxTokens(n)


def any_of(*conditions: StopCondition) -> AnyOf:
    return AnyOf(tuple(conditions))


def token_bounds(condition: StopCondition) -> tuple[int | None, frozenset[int]] | None:
    """For a condition that looks at token ids only: (the most tokens it lets through, or None for no
    bound; the token ids that stop it). None when it may read text or is of a type not known here:
    then only the SDK's own step-by-step loop can check it."""
    if type(condition) is MaxTokens:
        return condition.max_tokens, frozenset()
    if type(condition) is StopOnTokens:
        return None, condition.token_ids
    if type(condition) is AnyOf:
        bound: int | None = None
        token_ids: frozenset[int] = frozenset()
        for part in condition.conditions:
            found = token_bounds(part)
            if found is None:
                return None
            if found[0] is not None:
                bound = found[0] if bound is None else min(bound, found[0])
            token_ids |= found[1]
        return bound, token_ids
    return None


def needs_text(condition: StopCondition) -> bool:
    """Whether `condition` reads the decoded text; a condition of a type not known here is assumed to."""
    if type(condition) is AnyOf:
        return any(needs_text(c) for c in condition.conditions)
    return type(condition) not in (StopOnTokens, MaxTokens)
