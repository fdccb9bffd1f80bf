"""The executor's per-item checks on the decode path: a long page list checked in one numpy pass still names the
first bad page, and a decode step's write slot is the one the general layout computes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from l4m.executor import checks
from l4m.executor.errors import UnknownResource

PAGE_SIZE = 16


def cache(num_pages: int = 200, unallocated: tuple[int, ...] = ()) -> SimpleNamespace:
    """What the checks read of a KvCache: its size, page size and allocation flags."""
    allocated = np.ones(num_pages, dtype=bool)
    allocated[list(unallocated)] = False
    return SimpleNamespace(num_pages=num_pages, page_size=PAGE_SIZE, is_page_allocated=allocated)


@pytest.mark.parametrize("num_pages", [3, checks._PAGES_CHECKED_ONE_BY_ONE, checks._PAGES_CHECKED_ONE_BY_ONE + 1, 120])
def test_every_page_of_a_list_of_any_length_is_checked(num_pages: int) -> None:
    pages = tuple(range(10, 10 + num_pages))
    checks.check_pages(cache(), pages, "item 0")  # all allocated: no error
    last = pages[-1]
    with pytest.raises(UnknownResource, match=f"item 0: kv page {last} is not allocated"):
        checks.check_pages(cache(unallocated=(last,)), pages, "item 0")
    with pytest.raises(UnknownResource, match=r"item 0: kv page 500 is out of range \(0\.\.199\)"):
        checks.check_pages(cache(), (*pages[:-1], 500), "item 0")
    with pytest.raises(UnknownResource, match="item 0: kv page -1 is out of range"):
        checks.check_pages(cache(), (-1, *pages[1:]), "item 0")


def test_a_long_list_names_its_first_bad_page() -> None:
    pages = tuple(range(100))
    with pytest.raises(UnknownResource, match="kv page 40 is not allocated"):
        checks.check_pages(cache(unallocated=(70, 40)), pages, "w")


@pytest.mark.parametrize("num_context", [0, 1, 15, 16, 17, 100, 159])
def test_a_decode_steps_write_slot_is_the_general_layouts(num_context: int) -> None:
    pages = (7, 3, 150, 42, 9, 88, 120, 5, 61, 77)[: num_context // PAGE_SIZE + 1]
    step = checks.prepare_layout(cache(), pages, num_context, 1, (), "w")
    two = checks.prepare_layout(cache(), pages + (199,), num_context, 2, (), "w")  # the general path, 2 tokens
    assert step.write_slots.dtype == np.int64 and step.write_slots.tolist() == two.write_slots[:1].tolist()
    page, offset = divmod(num_context, PAGE_SIZE)
    assert step.write_slots.tolist() == [pages[page] * PAGE_SIZE + offset]
    assert (step.layout.num_ctx, step.layout.num_new, step.layout.page_ids) == (num_context, 1, pages)
