"""The window arithmetic (`l4m.window`) as pure functions of plain ints."""

from __future__ import annotations

from l4m.window import kept_slots, page_visibilities, window_row


def test_a_row_shows_the_sinks_and_the_window() -> None:
    assert window_row(2, num_window_tokens=4, num_sink_tokens=1) == [0, 0, 3]  # all inside the window
    assert window_row(9, num_window_tokens=4, num_sink_tokens=2) == [2, 4, 4]  # sinks 0-1, window 6-9
    assert window_row(9, num_window_tokens=4, num_sink_tokens=0) == [0, 6, 4]


def test_pages_before_the_next_tokens_view_get_their_visibility() -> None:
    # 10 slots in pages of 4; the next token (slot 10) sees slot 0 (a sink) and slots 7..10.
    pages = [(index, list(map(bool, visible))) for index, visible in page_visibilities(3, 4, 10, 4, 1)]
    assert pages == [(0, [True, False, False, False]), (1, [False, False, False, True])]
    assert list(page_visibilities(3, 4, 3, 8, 0)) == []  # nothing hidden yet


def test_dropped_pages_lose_their_slots() -> None:
    assert list(map(bool, kept_slots(10, 4, [1]))) == [True] * 4 + [False] * 4 + [True] * 2
