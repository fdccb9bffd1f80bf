"""Memory hygiene (issue #17): a reallocated KV page or embedding slot never shows its previous owner's
data. The attack: instance A fills pages with a prompt and frees them; B gets the same physical pages,
feeds one token after slots it never wrote, and must see what a never-used cache shows."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from l4m.executor.commands import (
    Allocate,
    Deallocate,
    EmbedText,
    Forward,
    ForwardText,
    ResourceKind,
    SamplerKind,
    SamplerSpec,
    SampleTopK,
)
from l4m.executor.engine import Engine
from l4m.executor.kv_cache import KvCache

from .conftest import LogitsRecorder, cpu_only, smaps_fields

PAGE_SIZE = 4
NUM_PAGES = 8  # 26 unwritten slots + 1 new token = 27 slots = 7 pages
SECRET = "The vault code is 4 8 1 5 1 6 2 3 4 2. Remember it: the vault code is"
DIST = SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=20)
# The cache as the dtype keeps it, and as float16 (the operator's --kv-cache-dtype, CPU only): zeroed alike.
KV_CACHE_DTYPES = pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("float16", marks=cpu_only)])


def _pages() -> tuple[int, ...]:
    return tuple(range(NUM_PAGES - 1))


def _victim_writes_secret(engine: Engine, secret_ids: list[int]) -> None:
    """A prompt through every page, then freed (as the scheduler does when A exits)."""
    pages = _pages()
    tokens = (secret_ids * 4)[: PAGE_SIZE * len(pages)]
    engine.allocate([Allocate(ResourceKind.KV_PAGE, pages)])
    engine.forward_text([ForwardText(pages, PAGE_SIZE, tuple(tokens), tuple(range(len(tokens))))])
    assert any(bool(layer[list(pages)].any()) for layer in engine.cache.layers)
    engine.deallocate([Deallocate(ResourceKind.KV_PAGE, pages)])


def _attacker_reads_slot_26(engine: Engine, token: int) -> torch.Tensor:
    """Allocate the same pages, feed one token at slot 26 under plain causal attention over 0..25."""
    pages = _pages()
    engine.allocate([Allocate(ResourceKind.KV_PAGE, pages)])
    recorder = LogitsRecorder(engine)
    num_slots = 27
    last = num_slots - PAGE_SIZE * (len(pages) - 1)
    engine.forward_text([ForwardText(pages, last, (token,), (num_slots - 1,), (), (0,), (DIST,))])
    return recorder.calls[-1]


@KV_CACHE_DTYPES
def test_reallocated_pages_are_zero(make_engine: Callable[..., Engine], prompts: list[list[int]],
                                    kv_cache_dtype: str) -> None:
    engine = make_engine(page_size=PAGE_SIZE, num_pages=NUM_PAGES, kv_cache_dtype=kv_cache_dtype)
    _victim_writes_secret(engine, prompts[0])
    engine.allocate([Allocate(ResourceKind.KV_PAGE, _pages())])
    for layer in engine.cache.layers:
        assert not layer[list(_pages())].any()
    assert bool(engine.cache.page_visible[list(_pages())].all())


@KV_CACHE_DTYPES
def test_attention_over_unwritten_slots_sees_a_never_used_cache(
    make_engine: Callable[..., Engine], loaded, prompts: list[list[int]], kv_cache_dtype: str
) -> None:
    secret_ids = loaded.tokenizer.tokenizer.encode(SECRET).ids
    token = prompts[1][0]
    fresh_engine = make_engine(page_size=PAGE_SIZE, num_pages=NUM_PAGES, kv_cache_dtype=kv_cache_dtype)
    fresh = _attacker_reads_slot_26(fresh_engine, token)
    reused_engine = make_engine(page_size=PAGE_SIZE, num_pages=NUM_PAGES, kv_cache_dtype=kv_cache_dtype)
    _victim_writes_secret(reused_engine, secret_ids)
    reused = _attacker_reads_slot_26(reused_engine, token)
    torch.testing.assert_close(reused, fresh, rtol=0, atol=0)


@KV_CACHE_DTYPES
def test_the_attack_without_zeroing_would_leak(
    make_engine: Callable[..., Engine], loaded, prompts: list[list[int]], kv_cache_dtype: str
) -> None:
    """Guards the test above: with the old flag-only allocation the victim's KV changes the logits."""
    secret_ids = loaded.tokenizer.tokenizer.encode(SECRET).ids
    token = prompts[1][0]
    fresh_engine = make_engine(page_size=PAGE_SIZE, num_pages=NUM_PAGES, kv_cache_dtype=kv_cache_dtype)
    fresh = _attacker_reads_slot_26(fresh_engine, token)
    engine = make_engine(page_size=PAGE_SIZE, num_pages=NUM_PAGES, kv_cache_dtype=kv_cache_dtype)
    _victim_writes_secret(engine, secret_ids)
    engine.cache.is_page_allocated[list(_pages())] = True  # flags only, as before the fix
    recorder = LogitsRecorder(engine)
    pages = _pages()
    engine.forward_text([ForwardText(pages, 27 - PAGE_SIZE * 6, (token,), (26,), (), (0,), (DIST,))])
    assert not torch.equal(recorder.calls[-1], fresh)


def test_reused_embed_slot_gives_no_previous_distribution(
    make_engine: Callable[..., Engine], prompts: list[list[int]]
) -> None:
    engine = make_engine(page_size=PAGE_SIZE, num_pages=NUM_PAGES, num_embed_slots=9)
    engine.allocate([Allocate(ResourceKind.EMBED_SLOT, (8,))])
    never_used = engine.sample_top_k([SampleTopK(slot_id=8, k=10)])[0]

    # Victim: a prompt through the model, its last hidden state kept in slot 0, then freed.
    tokens = prompts[0][:PAGE_SIZE * 2]
    slots = tuple(range(len(tokens)))
    pages = (0, 1)
    engine.allocate([Allocate(ResourceKind.EMBED_SLOT, slots), Allocate(ResourceKind.KV_PAGE, pages)])
    engine.embed_text([EmbedText(slots, tuple(tokens), tuple(range(len(tokens))))])
    engine.forward([Forward(pages, PAGE_SIZE, slots, (len(tokens) - 1,), (0,))])
    victims = engine.sample_top_k([SampleTopK(slot_id=0, k=10)])[0]
    assert victims != never_used
    engine.deallocate([Deallocate(ResourceKind.EMBED_SLOT, slots), Deallocate(ResourceKind.KV_PAGE, pages)])

    engine.allocate([Allocate(ResourceKind.EMBED_SLOT, (0,))])
    assert engine.sample_top_k([SampleTopK(slot_id=0, k=10)])[0] == never_used
    assert not engine.cache.embeds[0].any() and int(engine.cache.embed_positions[0]) == 0


def _resident_kib(address: int) -> int:
    return int(smaps_fields(address, "Rss:")[0])


def test_a_cpu_cache_takes_memory_for_the_pages_it_hands_out() -> None:
    """The CPU cache's K/V are mappings the kernel fills with zeros as they are first written: a cache
    sized for 96 MiB a layer holds nothing until pages are allocated, then about their size (a 2 MB
    huge page or two where transparent huge pages are always on), and those pages read as zeros."""
    cache = KvCache(num_layers=2, num_pages=4096, page_size=16, num_kv_heads=3, head_dim=64, num_embed_slots=0,
                    hidden_size=576, dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    layer = cache.layers[0]
    assert layer.numel() * 4 == 96 << 20
    assert _resident_kib(layer.data_ptr()) <= 4
    cache.allocate_pages(np.arange(8))  # 8 pages of 24 KiB a layer, zeroed
    assert 8 * 24 <= _resident_kib(layer.data_ptr()) <= 5 << 10
    assert not layer[:8].any()
