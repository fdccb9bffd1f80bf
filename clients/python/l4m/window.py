"""Window math: which KV slots a token sees under a sliding window with attention sinks (StreamingLLM).

Pure functions of plain ints; the `Context` decides what to send and which pages to give back. A slot
is visible to the token written at `slot` when it is one of the first `num_sink_tokens` slots or one
of the last `num_window_tokens` slots up to and including `slot`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Window:
    """Keep the first `num_sink_tokens` slots and the last `num_window_tokens` visible (StreamingLLM)."""

    num_window_tokens: int
    num_sink_tokens: int = 0


def window_row(slot: int, num_window_tokens: int, num_sink_tokens: int) -> list[int]:
    """Attention row of the token written at `slot`, as BRLE run lengths: the sinks visible, the slots
    between them and the window hidden, the window visible."""
    num_visible_from = max(slot + 1 - num_window_tokens, 0)
    num_sink = min(num_sink_tokens, num_visible_from)
    return [num_sink, num_visible_from - num_sink, slot + 1 - num_visible_from]


def page_visibilities(num_pages: int, page_size: int, num_slots: int, num_window_tokens: int,
                      num_sink_tokens: int) -> Iterator[tuple[int, np.ndarray]]:
    """For every page that holds a slot the next token (written at `num_slots`) no longer sees past the
    sinks: its index and its visibility, a [page_size] bool array. Pages after those are all visible."""
    import numpy as np  # lazily: a controller without a window does not pay numpy's import

    hide_below = num_slots + 1 - num_window_tokens  # the next token's view starts here
    for index in range(num_pages):
        first_slot = index * page_size
        if first_slot >= hide_below:
            return
        slots = np.arange(first_slot, first_slot + page_size)
        yield index, (slots < num_sink_tokens) | (slots >= hide_below)


def kept_slots(num_slots: int, page_size: int, dropped_page_indices: list[int]) -> np.ndarray:
    """A [num_slots] bool array: True for the slots outside the pages dropped."""
    import numpy as np

    keep = np.ones(num_slots, dtype=bool)
    for index in dropped_page_indices:
        keep[index * page_size:(index + 1) * page_size] = False
    return keep
