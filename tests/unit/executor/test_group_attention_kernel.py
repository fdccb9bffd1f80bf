"""The attention of a padded group inside `mixed_layers` (a prefill chunk's rows), reading K/V straight
from the pages: `torch.ops.l4m_cpu.group_attention` against the torch path it replaces (`attention.py`'s
gather + SDPA with the plan's additive mask), on 1 and 2 threads."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from l4m.executor import attention
from l4m.executor.attention import ItemLayout, PaddedGroup
from l4m.executor.quant import kernels_available
from l4m.wire.brle import encode
from tests.unit.executor.conftest import cpu_only

pytestmark = [
    cpu_only,
    pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler"),
]

PAGE = 16


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _group_case(
    contexts: list[int],
    num_new: int,
    masks: dict[int, np.ndarray],
    num_kv_heads: int,
    head_dim: int,
    seed: int,
) -> tuple[attention.AttentionPlan, torch.Tensor]:
    """A plan of equal-length items (one padded group) over shuffled pages of a random cache; `masks`:
    item -> [num_new, ctx + num_new] rows (True = attend). Some slots are hidden by page visibility."""
    g = torch.Generator().manual_seed(seed)
    pages_per_item = [-(-(c + num_new) // PAGE) for c in contexts]
    num_pages = sum(pages_per_item) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    items, first = [], 0
    for b, (ctx, count) in enumerate(zip(contexts, pages_per_item, strict=True)):
        rows = tuple(tuple(encode(row)) for row in masks[b]) if b in masks else ()
        items.append(ItemLayout(tuple(order[first : first + count]), ctx, num_new, rows))
        first += count
    page_visible = torch.rand(num_pages, PAGE, generator=g) < 0.9
    cache = torch.randn(num_pages, 2, PAGE, num_kv_heads, head_dim, generator=g)
    plan = attention.build_plan(items, PAGE, page_visible, torch.float32)
    return plan, cache


def _check(plan: attention.AttentionPlan, cache: torch.Tensor, num_heads: int, seed: int) -> torch.Tensor:
    """The kernel's output against `paged_attention` (gather + SDPA, dead rows zeroed); returns it."""
    (group,) = plan.groups
    assert isinstance(group, PaddedGroup) and group.scatter_index is None
    num_rows = group.num_items * group.max_new
    q = torch.randn(num_rows, num_heads, cache.shape[-1], generator=torch.Generator().manual_seed(seed))
    want = attention.paged_attention(q, cache, plan)
    got = torch.ops.l4m_cpu.group_attention(
        q.reshape(num_rows, -1), cache, group.kv_index, group.mask, num_heads
    )
    if plan.dead_rows is not None:  # the plan lets them see everything; mixed_layers zeroes them after
        got[plan.dead_rows] = 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return got


def test_items_of_a_chunk_with_holes_hidden_slots_and_a_dead_row(threads) -> None:
    """Three items of 7 new tokens over 37, 50 and 5 slots of context (not multiples of the page size),
    pages shuffled, 10 % of slots hidden by page visibility; item 1's mask is not causal (holes, a row
    that sees a later token's slot, a row that sees nothing)."""
    num_new, contexts = 7, [37, 50, 5]
    width = contexts[1] + num_new
    rows = np.tril(np.ones((num_new, width), dtype=bool), k=contexts[1])
    rows[:, 3:20] = False  # a hole, as a tree search leaves
    rows[2, contexts[1] + 4] = True  # a slot written by a later token of the chunk
    rows[5, :] = False  # sees nothing
    plan, cache = _group_case(contexts, num_new, {1: rows}, num_kv_heads=3, head_dim=64, seed=0)
    assert plan.dead_rows is not None and plan.dead_rows.tolist() == [num_new + 5]
    got = _check(plan, cache, num_heads=9, seed=1)
    assert got[num_new + 4].abs().sum() > 0


@pytest.mark.parametrize("context", [0, 3, 600, 2050])
def test_one_chunk_over_contexts_split_across_the_threads(threads, context) -> None:
    """A 16-token chunk (SmolLM2's 9 heads over 3 KV heads): from no context, where the chunk attends
    to itself only, to 2,050 slots, which the kernel cuts into spans merged at the end."""
    plan, cache = _group_case([context], 16, {}, num_kv_heads=3, head_dim=64, seed=context)
    _check(plan, cache, num_heads=9, seed=2)


def test_head_dim_128_and_a_whole_span_hidden(threads) -> None:
    """head_dim 128, 2 query heads per KV head; the first 300 slots of item 0 hidden by its mask, so
    that some spans see nothing and only the others make its output."""
    num_new, contexts = 5, [400, 400]
    rows = np.tril(np.ones((num_new, contexts[0] + num_new), dtype=bool), k=contexts[0])
    rows[:, :300] = False
    plan, cache = _group_case(contexts, num_new, {0: rows}, num_kv_heads=2, head_dim=128, seed=3)
    _check(plan, cache, num_heads=4, seed=4)


def test_a_row_whose_mask_hides_every_slot_gets_zeros(threads) -> None:
    """Given a mask with a row of -inf only (the plan never sends one: it lets such rows see everything
    and zeroes them after), the kernel writes 0 there, not SDPA's NaN; the other rows are SDPA's."""
    plan, cache = _group_case([40], 6, {}, num_kv_heads=3, head_dim=64, seed=5)
    (group,) = plan.groups
    mask = group.mask.clone()
    mask[0, 0, 2] = float("-inf")
    q = torch.randn(6, 9 * 64, generator=torch.Generator().manual_seed(6))
    got = torch.ops.l4m_cpu.group_attention(q, cache, group.kv_index, mask, 9)
    want = torch.ops.l4m_cpu.group_attention(q, cache, group.kv_index, group.mask, 9)
    assert not got[2].any()
    torch.testing.assert_close(got[[0, 1, 3, 4, 5]], want[[0, 1, 3, 4, 5]], atol=0, rtol=0)


def test_group_attention_refuses_what_does_not_fit() -> None:
    """Shapes and K/V rows are checked before anything is read: a clear error naming it."""
    cache = torch.zeros(4, 2, PAGE, 3, 64)
    q = torch.zeros(6, 9 * 64)
    kv_index = torch.stack((torch.arange(PAGE), torch.arange(PAGE) + PAGE))[None]  # [1, 2, PAGE]
    mask = torch.zeros(1, 1, 6, PAGE)
    assert torch.ops.l4m_cpu.group_attention(q, cache, kv_index, mask, 9).shape == (6, 9 * 64)
    assert torch.ops.l4m_cpu.group_attention(q[:0], cache, kv_index, mask[:, :, :0], 9).shape == (0, 9 * 64)
    bad = {
        "group_kv_index out of range": (q, cache, kv_index + 4 * 2 * PAGE, mask, 9),
        "q's rows must be the group's": (q[:5], cache, kv_index, mask, 9),
        "num_heads \\* head_dim": (q, cache, kv_index, mask, 6),
        "group_mask: float32": (q, cache, kv_index, mask.double(), 9),
        "group_kv_index: int64 \\[Bc, 2, Tkv\\]": (q, cache, kv_index[:, :, :8], mask, 9),
        "head_dim 64 or 128": (torch.zeros(6, 9 * 32), torch.zeros(4, 2, PAGE, 3, 32), kv_index, mask, 9),
    }
    for reason, args in bad.items():
        with pytest.raises(RuntimeError, match=reason):
            torch.ops.l4m_cpu.group_attention(*args)
