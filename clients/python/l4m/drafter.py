"""Speculative decoding with an n-gram drafter, verified by the model in one forward pass per round.

`NgramDrafter` remembers, for every `n - 1` consecutive tokens seen (prompt and output), the token that
followed them last time; a draft follows that chain. `generate_speculative` sends the pending token
plus the draft in ONE forward_text with an output at every position (`Context.verify`), keeps the
prefix the model agrees with plus the model's own next token, and rolls the rest back. With greedy
verification the output equals plain greedy decoding, in fewer forward passes when drafts hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from l4m.context import Context
from l4m.generation import Completion
from l4m.stop import Stop


class NgramDrafter:
    """Drafts by looking up the last `n - 1` tokens in the sequence's own history."""

    def __init__(self, n: int = 3, max_draft_tokens: int = 6) -> None:
        if n < 2:
            raise ValueError("an n-gram drafter needs n >= 2")
        self.n = n
        self.max_draft_tokens = max_draft_tokens
        self._next: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0

    def update(self, token_ids: Sequence[int]) -> None:
        """Index the tokens not seen yet (call with the whole, growing, sequence)."""
        start = max(self._num_indexed - self.n + 1, 0)
        for i in range(start, len(token_ids) - self.n + 1):
            self._next[tuple(token_ids[i:i + self.n - 1])] = token_ids[i + self.n - 1]
        self._num_indexed = len(token_ids)

    def draft(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        limit = self.max_draft_tokens if max_tokens is None else min(max_tokens, self.max_draft_tokens)
        history = list(token_ids[-(self.n - 1):])
        drafted: list[int] = []
        while len(drafted) < limit:
            token = self._next.get(tuple(history[-(self.n - 1):]))
            if token is None:
                break
            drafted.append(token)
            history.append(token)
        return drafted


async def generate_speculative(
    context: Context,
    drafter: NgramDrafter,
    max_tokens: int,
    stop_token_ids: Iterable[int] | None = None,
) -> Completion:
    """Greedy generation of up to `max_tokens` tokens, drafted by `drafter` and verified by the model."""
    stop = frozenset(context.model.stop_token_ids if stop_token_ids is None else stop_token_ids)
    completion = Completion()
    drafter.update(context.token_ids)
    while completion.stop is None:
        room = max_tokens - len(completion.token_ids)
        draft = drafter.draft(context.token_ids, max_tokens=room - 1)
        accepted = await context.verify(draft)
        keep = _num_to_keep(accepted, stop, room)
        context.rollback(len(accepted) - keep)
        completion.token_ids.extend(accepted[:keep])
        if completion.token_ids[-1] in stop:
            completion.stop = Stop("token")
        elif len(completion.token_ids) >= max_tokens:
            completion.stop = Stop("length")
        drafter.update(context.token_ids)
    completion.text = context.model.tokenizer.decode(completion.token_ids)
    return completion


def _num_to_keep(accepted: list[int], stop: frozenset[int], room: int) -> int:
    for i, token in enumerate(accepted[:room]):
        if token in stop:
            return i + 1
    return min(len(accepted), room)
