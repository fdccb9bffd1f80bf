"""BRLE codec: polarity, empty rows, batch decoding, and round trips (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from l4m.wire import brle

bool_lists = st.lists(st.booleans(), max_size=200)


def test_first_run_counts_true_values() -> None:
    assert brle.encode([True, True, False, True]) == [2, 1, 1]
    assert brle.decode([2, 1, 1]).tolist() == [True, True, False, True]


def test_leading_false_starts_with_a_zero_run() -> None:
    assert brle.encode([False, False, True]) == [0, 2, 1]
    assert brle.decode([0, 2, 1]).tolist() == [False, False, True]
    assert brle.decode([0, 3]).tolist() == [False, False, False]


def test_empty_vector_is_an_empty_buffer() -> None:
    assert brle.encode([]) == []
    assert brle.decode([]).tolist() == []
    assert brle.decoded_length([]) == 0


def test_zero_runs_in_the_middle_merge_neighbours() -> None:
    assert brle.decode([2, 0, 3]).tolist() == [True] * 5
    assert brle.decode([1, 2, 0, 1]).tolist() == [True, False, False, False]


def test_decode_rows_pads_with_false_and_keeps_empty_rows() -> None:
    rows = [[2, 1, 1], [], [0, 3], [1, 1, 1, 1]]
    m = brle.decode_rows(rows, width=5)
    assert m.shape == (4, 5)
    assert m.astype(int).tolist() == [
        [1, 1, 0, 1, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0],
    ]


def test_decode_rows_rejects_rows_longer_than_width() -> None:
    with pytest.raises(brle.BrleError, match="more than the 3 allowed"):
        brle.decode_rows([[4]], width=3)


def test_negative_runs_are_rejected() -> None:
    with pytest.raises(brle.BrleError, match="non-negative"):
        brle.decode_rows([[2, -1]], width=4)


def test_helpers() -> None:
    assert brle.all_true(0) == []
    assert brle.decode(brle.all_true(4)).all()
    assert brle.decode(brle.causal_row(3, 5)).tolist() == [True, True, True, False, False]
    assert brle.causal_row(5, 5) == [5]
    with pytest.raises(brle.BrleError):
        brle.causal_row(6, 5)


@given(bool_lists)
def test_round_trip(values: list[bool]) -> None:
    runs = brle.encode(values)
    assert brle.decode(runs).tolist() == values
    assert brle.decoded_length(runs) == len(values)
    # Canonical form: only the first run may be zero.
    assert all(r > 0 for r in runs[1:])


@given(st.lists(bool_lists, max_size=12))
def test_decode_rows_equals_decoding_each_row(rows: list[list[bool]]) -> None:
    width = max((len(r) for r in rows), default=0) + 3
    matrix = brle.decode_rows([brle.encode(r) for r in rows], width=width)
    assert matrix.shape == (len(rows), width)
    for values, row in zip(rows, matrix, strict=True):
        assert row[: len(values)].tolist() == values
        assert not row[len(values) :].any()


@given(st.lists(st.integers(min_value=0, max_value=6), max_size=15))
def test_any_non_negative_runs_decode_by_alternation(runs: list[int]) -> None:
    expected = [i % 2 == 0 for i, n in enumerate(runs) for _ in range(n)]
    assert brle.decode(runs).tolist() == expected
    assert np.array_equal(brle.decode(brle.encode(expected)), brle.decode(runs))
