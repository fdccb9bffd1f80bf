"""Binary run-length encoding (BRLE) of boolean vectors, shared by every l4m service.

Polarity, fixed here and in the proto (`l4m.v1.Brle`): runs alternate and the **first run counts
`True` values** -- "visible" for attention-mask rows, "allowed" for vocabulary masks. A vector that
starts with `False` values therefore begins with a zero-length `True` run:

    encode([True, True, False, True])   == [2, 1, 1]
    encode([False, False, True])        == [0, 2, 1]
    encode([])                          == []

The decoded length of a row is the sum of its runs. Zero-length runs in the middle are allowed and
merge their neighbours (`[2, 0, 3]` decodes to five `True`s); `encode` never emits them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class BrleError(ValueError):
    """A BRLE buffer that cannot be decoded as asked (negative run, wrong length, too long)."""


def encode(values: Iterable[bool] | np.ndarray) -> list[int]:
    """Encode booleans as alternating run lengths, the first run counting `True` values."""
    flags = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=bool)
    if flags.size == 0:
        return []
    # Indices where the value changes; runs are the gaps between them.
    change_at = np.flatnonzero(flags[1:] != flags[:-1]) + 1
    bounds = np.concatenate(([0], change_at, [flags.size]))
    runs = np.diff(bounds).tolist()
    if not flags[0]:
        runs.insert(0, 0)
    return runs


def decoded_length(runs: Sequence[int]) -> int:
    """Number of booleans `runs` decodes to."""
    return int(sum(runs))


def decode(runs: Sequence[int]) -> np.ndarray:
    """Decode one BRLE buffer to a boolean vector of length `sum(runs)`."""
    return decode_rows([runs])[0] if runs else np.zeros(0, dtype=bool)


def decode_rows(rows: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """Decode many BRLE rows at once into a `[num_rows, width]` boolean matrix, vectorized.

    Each row is padded with `False` up to `width` (default: the longest row). A row longer than
    `width` is an error, not a truncation: callers validate lengths before decoding.
    """
    num_rows = len(rows)
    lengths = np.fromiter((sum(r) for r in rows), dtype=np.int64, count=num_rows)
    if width is None:
        width = int(lengths.max()) if num_rows else 0
    if num_rows and int(lengths.max()) > width:
        raise BrleError(f"a BRLE row decodes to {int(lengths.max())} values, more than the {width} allowed")
    counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=num_rows)
    flat = np.fromiter((v for r in rows for v in r), dtype=np.int64, count=int(counts.sum()))
    if flat.size and flat.min() < 0:
        raise BrleError("BRLE run lengths must be non-negative")
    out = np.zeros((num_rows, width + 1), dtype=np.int32)
    if flat.size:
        row_of_run = np.repeat(np.arange(num_rows), counts)
        # Position of each run inside its own row: even positions are True runs.
        first_run = np.repeat(np.cumsum(counts) - counts, counts)
        run_index = np.arange(flat.size) - first_run
        ends = np.cumsum(flat)
        ends -= np.repeat(ends[np.cumsum(counts) - 1] - lengths, counts)  # restart the sum per row
        starts = ends - flat
        is_true = (run_index % 2 == 0) & (flat > 0)
        np.add.at(out, (row_of_run[is_true], starts[is_true]), 1)
        np.add.at(out, (row_of_run[is_true], ends[is_true]), -1)
    return np.cumsum(out, axis=1)[:, :width] > 0


def all_true(length: int) -> list[int]:
    """The BRLE of `length` `True` values (a fully visible row, or an all-allowed mask)."""
    return [length] if length else []


def causal_row(num_visible: int, width: int) -> list[int]:
    """A row that sees its first `num_visible` positions of `width` and hides the rest."""
    if not 0 <= num_visible <= width:
        raise BrleError(f"cannot show {num_visible} of {width} positions")
    return [num_visible, width - num_visible] if width > num_visible else all_true(num_visible)
