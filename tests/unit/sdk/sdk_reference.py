"""Reference decoding straight on the fake model's logits: what a correct Context must reproduce."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from l4m.fake import FakeL4M


def greedy_reference(fake: FakeL4M, prompt: Sequence[int], num_tokens: int, window: int | None = None,
                     num_sink: int = 0) -> list[int]:
    """Greedy tokens after `prompt` (positions 0, 1, ...), optionally with a sink + sliding window."""
    tokens = list(prompt)
    out = []
    for _ in range(num_tokens):
        slot = len(tokens) - 1
        visible = [(t, p) for p, t in enumerate(tokens)
                   if window is None or p < num_sink or p >= slot + 1 - window]
        next_token = int(np.argmax(fake.logits(visible)))
        out.append(next_token)
        tokens.append(next_token)
    return out


def logprob_reference(fake: FakeL4M, prefix: Sequence[int], token: int) -> float:
    logits = fake.logits([(t, p) for p, t in enumerate(prefix)])
    return float(logits[token] - np.logaddexp.reduce(logits))

