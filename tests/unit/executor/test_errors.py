"""Every bad input is a typed error with a clear message, raised before any state changes;
the engine keeps serving afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from l4m.executor.commands import (
    Allocate,
    CopyKvPage,
    Deallocate,
    EmbedImage,
    EmbedText,
    Forward,
    ForwardText,
    MaskKvPage,
    ResourceKind,
    SamplerKind,
    SamplerSpec,
    SampleTopK,
)
from l4m.executor.errors import CapabilityError, InvalidCommand, UnknownResource
from tests.unit.executor.conftest import TEST_DEVICE

PAGE = ResourceKind.KV_PAGE
SLOT = ResourceKind.EMBED_SLOT
GREEDY = SamplerSpec(SamplerKind.GREEDY)


def good_item(**changes: object) -> ForwardText:
    """Two context tokens already in page 0 (page_size 4) + 3 new ones straddling into page 1."""
    item = ForwardText((0, 1), 1, (10, 11, 12), (2, 3, 4), (), (2,), (GREEDY,))
    return dataclasses.replace(item, **changes)


BAD_BATCHES = [
    ("unknown page", [good_item(kv_page_ids=(0, 7))], UnknownResource, "kv page 7 is not allocated"),
    ("page out of range", [good_item(kv_page_ids=(0, 999))], UnknownResource, "kv page 999 is out of range"),
    ("no pages", [good_item(kv_page_ids=())], InvalidCommand, "kv_page_ids is empty"),
    ("page twice", [good_item(kv_page_ids=(0, 0))], InvalidCommand, "kv_page_ids lists a page twice"),
    ("last len 0", [good_item(kv_last_page_length=0)], InvalidCommand, "kv_last_page_length 0 is not in [1, kv_page_size=4]"),
    (
        "last len > page",
        [good_item(kv_last_page_length=5)],
        InvalidCommand,
        "kv_last_page_length 5 is not in [1, kv_page_size=4]",
    ),
    (
        "too many tokens",
        [good_item(token_ids=(1,) * 6, position_ids=tuple(range(6)), output_indices=(), samplers=())],
        InvalidCommand,
        "do not fit",
    ),
    (
        "no tokens",
        [good_item(token_ids=(), position_ids=(), output_indices=(), samplers=())],
        InvalidCommand,
        "token_ids is empty",
    ),
    (
        "token id >= vocab",
        [good_item(token_ids=(10, 49152, 12))],
        InvalidCommand,
        "token_ids holds token id 49152, not in [0, vocab_size=49152)",
    ),
    ("negative token", [good_item(token_ids=(10, -1, 12))], InvalidCommand, "token_ids holds token id -1"),
    ("positions count", [good_item(position_ids=(2, 3))], InvalidCommand, "position_ids has 2 entries for 3 token_ids"),
    (
        "position overflow",
        [good_item(position_ids=(2, 3, 8192))],
        InvalidCommand,
        "position_ids holds position 8192, not in [0, max_context_tokens=8192)",
    ),
    (
        "mask row count",
        [good_item(attention_mask=((3,), (4,)))],
        InvalidCommand,
        "attention_masks has 2 rows for 3 tokens",
    ),
    (
        "mask row length",
        [good_item(attention_mask=((3,), (4,), (4,)))],
        InvalidCommand,
        "attention_masks[2] decodes to 4 values, expected 5",
    ),
    ("mask negative run", [good_item(attention_mask=((3,), (5, -1), (5,)))], InvalidCommand, "attention_masks[1] has a negative run (-1)"),
    ("output index", [good_item(output_indices=(3,))], InvalidCommand, "output_indices holds 3, not in [0, num_inputs=3)"),
    ("sampler count", [good_item(samplers=(GREEDY, GREEDY))], InvalidCommand, "samplers has 2 entries for 1 output_indices"),
    (
        "distribution k 0",
        [good_item(samplers=(SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=0),))],
        InvalidCommand,
        "samplers[0]: distribution_top_k 0 is not in [1, vocab_size=49152]",
    ),
    (
        "temperature 0",
        [good_item(samplers=(SamplerSpec(SamplerKind.SAMPLE, temperature=0.0),))],
        InvalidCommand,
        "samplers[0]: temperature 0.0 is not a finite number > 0",
    ),
    (
        "temperature nan",
        [good_item(samplers=(SamplerSpec(SamplerKind.SAMPLE, temperature=float("nan")),))],
        InvalidCommand,
        "samplers[0]: temperature nan is not a finite number > 0",
    ),
    (
        "top_p > 1",
        [good_item(samplers=(SamplerSpec(SamplerKind.SAMPLE, top_p=1.5),))],
        InvalidCommand,
        "samplers[0]: top_p 1.5 is not in [0, 1]",
    ),
    (
        "top_k < 0",
        [good_item(samplers=(SamplerSpec(SamplerKind.SAMPLE, top_k=-1),))],
        InvalidCommand,
        "samplers[0]: top_k -1 is not in [0, vocab_size=49152]",
    ),
    (
        "min_p 1",
        [good_item(samplers=(SamplerSpec(SamplerKind.SAMPLE, min_p=1.0),))],
        InvalidCommand,
        "samplers[0]: min_p 1.0 is not in [0, 1)",
    ),
    (
        "negative seed",
        [good_item(samplers=(SamplerSpec(SamplerKind.SAMPLE, seed=-3),))],
        InvalidCommand,
        "samplers[0]: seed -3 is not in [0, 2^64 - 1]",
    ),
    (
        "vocab mask length",
        [good_item(samplers=(SamplerSpec(vocab_mask=(10, 5)),))],
        InvalidCommand,
        "samplers[0]: vocabulary_mask decodes to 15 values, expected 49152",
    ),
    (
        "vocab mask empty",
        [good_item(samplers=(SamplerSpec(vocab_mask=(0, 49152)),))],
        InvalidCommand,
        "allows no token",
    ),
    ("write collision", [good_item(), good_item()], InvalidCommand, "item 1: writes kv page 0 slot 2, the same kv page slot as item 0"),
    ("bad second item", [good_item(), good_item(kv_page_ids=(0, 7))], UnknownResource, "item 1: kv page 7"),
    ("sample_top_k k 0", [SampleTopK(0, 0)], InvalidCommand, "k 0 is not in [1, vocab_size=49152]"),
    ("sample_top_k slot", [SampleTopK(2, 3)], UnknownResource, "embed slot 2 is not allocated"),
    (
        "embed_text slot range",
        [EmbedText((100,), (1,), (0,))],
        UnknownResource,
        "embed slot 100 is out of range",
    ),
    ("embed_text lengths", [EmbedText((0, 1), (1,), (0,))], InvalidCommand, "embed_text has 2 embed_slot_ids, 1 token_ids and 1 position_ids; they must match"),
    ("forward unknown slot", [Forward((0, 1), 1, (3,))], UnknownResource, "embed slot 3 is not allocated"),
    ("forward outputs", [Forward((0, 1), 1, (0,), (0,), ())], InvalidCommand, "output_embed_slot_ids has 0 entries for 1 output_indices"),
    (
        "copy leaves page",
        [CopyKvPage(0, 1, 2, 0, 3)],
        InvalidCommand,
        "source range [2, 5) exceeds kv_page_size 4",
    ),
    ("copy unknown page", [CopyKvPage(0, 9, 0, 0, 1)], UnknownResource, "kv page 9 is not allocated"),
    ("mask_kv_page length", [MaskKvPage(0, (2, 1))], InvalidCommand, "visibility decodes to 3 values, expected 4"),
    ("mask_kv_page page", [MaskKvPage(300, (4,))], UnknownResource, "out of range (0..15)"),
    ("allocate twice", [Allocate(PAGE, (0,))], InvalidCommand, "kv page 0 is already allocated"),
    ("allocate out of range", [Allocate(PAGE, (16,))], UnknownResource, "kv page 16 is out of range (0..15)"),
    ("allocate duplicate", [Allocate(SLOT, (3, 3))], InvalidCommand, "appears twice"),
    ("deallocate unknown", [Deallocate(PAGE, (5,))], InvalidCommand, "kv page 5 is not allocated"),
    ("mixed kinds", [SampleTopK(0, 1), MaskKvPage(0, (4,))], InvalidCommand, "exactly one command kind"),
    ("image", [EmbedImage((0,), b"png")], CapabilityError, "text-only"),
]


@pytest.fixture(scope="module")
def engine(loaded):
    from l4m.executor.engine import Engine, EngineConfig

    engine = Engine(loaded, EngineConfig(device=TEST_DEVICE, page_size=4, num_pages=16, num_embed_slots=4))
    engine.allocate([Allocate(PAGE, (0, 1)), Allocate(SLOT, (0,))])
    engine.forward_text([ForwardText((0,), 2, (1, 2), (0, 1))])  # two context tokens in page 0
    engine.embed_text([EmbedText((0,), (5,), (0,))])
    return engine


def snapshot(engine) -> tuple:
    c = engine.cache
    return (
        c.is_page_allocated.copy(),
        c.is_slot_allocated.copy(),
        [layer.clone() for layer in c.layers[:2]],
        c.page_visible.clone(),
        c.embeds.clone(),
    )


def assert_same(a: tuple, b: tuple) -> None:
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))
    assert torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])


@pytest.mark.parametrize(("case", "batch", "error", "message"), BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_is_rejected_without_state_change(engine, case, batch, error, message) -> None:
    before = snapshot(engine)
    with pytest.raises(error) as info:
        engine.execute(batch)
    assert message in info.value.reason, info.value.reason
    assert_same(before, snapshot(engine))
    # The engine keeps serving: a good batch works (and is repeatable, as no state moved).
    result = engine.execute(
        [good_item(samplers=(SamplerSpec(SamplerKind.DISTRIBUTION, distribution_top_k=2),))]
    )
    assert len(result[0].outputs[0].token_ids) == 2


def test_empty_batch_is_rejected(engine) -> None:
    with pytest.raises(InvalidCommand, match="empty batch"):
        engine.execute([])


def _second_item(sampler: SamplerSpec = GREEDY) -> ForwardText:
    """One token into slot 1 of page 1: writes nothing `good_item` writes."""
    return ForwardText((1,), 2, (10,), (5,), (), (0,), (sampler,))


# The item the error blames (None: the batch as a whole), so the scheduler can trap that item's instance
# alone and send the others again.
BLAMED_ITEMS = [
    ("write collision", [good_item(), _second_item(), good_item()], 2),
    ("continuation collision",
     [_second_item(), dataclasses.replace(good_item(), kv_page_ids=(0, 1), kv_last_page_length=2,
                                          num_continuation_steps=1)], 1),
    ("bad second item", [good_item(), good_item(kv_page_ids=(0, 7))], 1),
    ("vocab mask of item 1", [good_item(), _second_item(SamplerSpec(vocab_mask=(0, 49152)))], 1),
    ("allocate duplicate across items", [Allocate(SLOT, (3,)), Allocate(SLOT, (3,))], 1),
    ("deallocate unknown in item 1", [Deallocate(PAGE, (0,)), Deallocate(PAGE, (5,))], 1),
    ("copy unknown page in item 1", [CopyKvPage(0, 1, 0, 0, 1), CopyKvPage(0, 9, 0, 0, 1)], 1),
    ("mask of item 1", [MaskKvPage(0, (4,)), MaskKvPage(1, (2, 1))], 1),
    ("mixed kinds", [SampleTopK(0, 1), MaskKvPage(0, (4,))], None),
    ("empty", [], None),
]


@pytest.mark.parametrize(("case", "batch", "item_index"), BLAMED_ITEMS, ids=[c[0] for c in BLAMED_ITEMS])
def test_a_rejected_batch_names_the_offending_item(engine, case, batch, item_index) -> None:
    from l4m.executor.convert import error_to_pb

    before = snapshot(engine)
    with pytest.raises(InvalidCommand) as info:
        engine.execute(batch)
    assert info.value.item_index == item_index, info.value.reason
    assert_same(before, snapshot(engine))
    error = error_to_pb(7, info.value, is_unsupported=False).error
    assert error.has_item_index == (item_index is not None) and error.item_index == (item_index or 0)


def test_without_the_blamed_item_the_collision_batch_runs(engine) -> None:
    batch = [good_item(), _second_item(), good_item()]
    with pytest.raises(InvalidCommand) as info:
        engine.execute(batch)
    rest = [item for n, item in enumerate(batch) if n != info.value.item_index]
    assert len(engine.execute(rest)) == 2


def test_reset_frees_every_page_and_slot_and_zeroes_them(loaded) -> None:
    from l4m.executor.engine import Engine, EngineConfig

    engine = Engine(loaded, EngineConfig(device=TEST_DEVICE, page_size=4, num_pages=8, num_embed_slots=4))
    engine.allocate([Allocate(PAGE, (0, 1, 5)), Allocate(SLOT, (2,))])
    engine.forward_text([ForwardText((0, 1), 2, (1, 2, 3, 4, 5, 6), tuple(range(6)))])
    engine.embed_text([EmbedText((2,), (5,), (0,))])
    engine.mask_kv_page([MaskKvPage(0, (1, 3))])
    assert engine.reset() == (3, 1)
    cache = engine.cache
    assert not cache.is_page_allocated.any() and not cache.is_slot_allocated.any()
    assert all(not layer.any() for layer in cache.layers) and cache.page_visible.all()
    assert not cache.embeds.any() and not cache.embed_positions.any()
    assert engine.reset() == (0, 0)
    engine.allocate([Allocate(PAGE, (0, 1))])  # the ids the scheduler hands out again are free here
