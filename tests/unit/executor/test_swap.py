"""Host swap (preemption): swap_out copies pages to host slots and frees them, swap_in brings them back onto
other physical pages bit for bit, so a decode resumed there yields exactly the tokens it would have; bad swap
batches are refused whole, naming the item and the id."""

from __future__ import annotations

import pytest
import torch

from l4m.executor.commands import Allocate, ForwardText, MaskKvPage, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.config import EngineConfig
from l4m.executor.convert import batch_from_pb, info_to_pb
from l4m.executor.engine import Engine
from l4m.executor.errors import InvalidCommand
from l4m.v1 import executor_pb2, l4m_pb2
from tests.unit.executor.conftest import TEST_DEVICE

GREEDY = SamplerSpec(SamplerKind.GREEDY)


def _swap(kind: str, pages: list[int], slots: list[int]) -> list[object]:
    """A swap batch as the scheduler sends it, through the executor's protobuf conversion."""
    request = executor_pb2.ExecuteRequest(correlation_id=1)
    getattr(request, kind).items.add(kv_page_ids=pages, swap_slot_ids=slots)
    return batch_from_pb(request)


def _decode(engine: Engine, pages: tuple[int, ...], prompt: list[int], steps: int) -> list[int]:
    """Greedy decode of `steps` tokens after `prompt`, whose K/V already fill `pages` (page size 4)."""
    tokens, length = [], len(prompt)
    last = prompt[-1]
    for _ in range(steps):
        # Re-feed nothing: write the next token at slot `length` and sample after it.
        total = length + 1
        assert total <= 4 * len(pages)
        item = ForwardText(pages, total - 4 * (len(pages) - 1), (last,), (length,), (), (0,), (GREEDY,))
        last = engine.forward_text([item])[0].outputs[0].token_id
        tokens.append(last)
        length = total
    return tokens


def _prefill(engine: Engine, pages: tuple[int, ...], prompt: list[int]) -> int:
    item = ForwardText(pages, len(prompt) - 4 * (len(pages) - 1), tuple(prompt), tuple(range(len(prompt))),
                       (), (len(prompt) - 1,), (GREEDY,))
    return engine.forward_text([item])[0].outputs[0].token_id


def test_swap_out_and_in_is_bit_exact_and_the_decode_goes_on_identically(make_engine, prompts) -> None:  # type: ignore[no-untyped-def]
    prompt = prompts[2][:9]  # 9 tokens: 3 pages of 4, the last partly written; 3 more steps fit
    alone = make_engine(page_size=4, num_pages=16)
    alone.allocate([Allocate(ResourceKind.KV_PAGE, (0, 1, 2))])
    first = _prefill(alone, (0, 1, 2), prompt)
    alone.mask_kv_page([MaskKvPage(1, (2, 1, 1))])  # a hidden slot: visibility travels with the page
    expected = _decode(alone, (0, 1, 2), [*prompt, first], 2)

    engine = make_engine(page_size=4, num_pages=16)
    assert engine.cache.num_swap_slots == 16  # auto: as many as the device cache
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (0, 1, 2))])
    assert _prefill(engine, (0, 1, 2), prompt) == first
    engine.mask_kv_page([MaskKvPage(1, (2, 1, 1))])
    before = [layer[[0, 1, 2]].clone() for layer in engine.cache.layers]
    visible = engine.cache.page_visible[[0, 1, 2]].clone()

    engine.execute(_swap("swap_out", [0, 1, 2], [5, 3, 9]))
    assert not engine.cache.is_page_allocated[[0, 1, 2]].any()
    # Someone else takes the freed pages (zeroed) and writes into them.
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (0, 1, 2))])
    _prefill(engine, (0, 1, 2), prompts[4][:9])
    engine.execute(_swap("swap_in", [7, 11, 12], [5, 3, 9]))

    for layer, old in zip(engine.cache.layers, before, strict=True):
        assert torch.equal(layer[[7, 11, 12]], old)  # bit for bit, every layer, K and V
    assert torch.equal(engine.cache.page_visible[[7, 11, 12]], visible)
    assert engine.cache.is_page_allocated[[7, 11, 12]].all()
    assert _decode(engine, (7, 11, 12), [*prompt, first], 2) == expected


@pytest.mark.parametrize(
    ("kind", "pages", "slots", "message"),
    [
        ("swap_out", [0, 1], [0], "swap_out item 0: 2 kv pages but 1 swap slots"),
        ("swap_out", [99], [0], "swap_out item 0: kv page 99 is out of range (0..7)"),
        ("swap_out", [0], [8], "swap_out item 0: swap slot 8 is out of range (8 swap slots)"),
        ("swap_out", [3], [0], "swap_out item 0: kv page 3 is not allocated"),
        ("swap_out", [0, 1], [2, 2], "swap_out item 0: kv page 1 or swap slot 2 appears twice in the batch"),
        ("swap_in", [0], [0], "swap_in item 0: kv page 0 is allocated"),
        ("swap_in", [5], [9], "swap_in item 0: swap slot 9 is out of range (8 swap slots)"),
    ],
)
def test_a_bad_swap_batch_is_refused_whole_naming_the_id(make_engine, kind, pages, slots, message) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(page_size=4, num_pages=8)
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (0, 1, 2))])
    before = engine.cache.layers[0].clone(), engine.cache.is_page_allocated.copy()
    with pytest.raises(InvalidCommand) as raised:
        engine.execute(_swap(kind, pages, slots))
    assert raised.value.reason.startswith(message) and raised.value.item_index == 0
    assert torch.equal(engine.cache.layers[0], before[0]) and (engine.cache.is_page_allocated == before[1]).all()


def test_swap_space_is_a_knob_advertised_in_get_info(loaded) -> None:  # type: ignore[no-untyped-def]
    off = Engine(loaded, EngineConfig(device=TEST_DEVICE, page_size=4, num_pages=8, swap_space_pages=0))
    assert info_to_pb(off.get_info()).num_swap_slots == 0
    off.allocate([Allocate(ResourceKind.KV_PAGE, (0,))])
    with pytest.raises(InvalidCommand, match="swap slot 0 is out of range"):
        off.execute(_swap("swap_out", [0], [0]))
    sized = Engine(loaded, EngineConfig(device=TEST_DEVICE, page_size=4, num_pages=8, swap_space_pages=3))
    assert info_to_pb(sized.get_info()).num_swap_slots == 3
    with pytest.raises(ValueError, match="swap_space_pages must be -1"):
        Engine(loaded, EngineConfig(device=TEST_DEVICE, page_size=4, num_pages=8, swap_space_pages=-2))


def test_the_swap_space_flag_reaches_the_engine_and_a_bad_value_is_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    from l4m.executor.__main__ import parse_config

    assert parse_config(["--model", "m.gguf"])[0].engine.swap_space_pages == -1
    assert parse_config(["--model", "m.gguf", "--swap-space-pages", "0"])[0].engine.swap_space_pages == 0
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--model", "m.gguf", "--swap-space-pages", "-5"])
    assert exit_.value.code == 2 and "--swap-space-pages must be -1 (auto), 0 (none) or more, got -5" in (
        capsys.readouterr().err)


def test_swap_batches_ride_the_execute_stream_which_only_the_cluster_secret_opens(make_engine) -> None:  # type: ignore[no-untyped-def]
    """Who may swap: the scheduler alone (no L4M command names a swap slot; the Execute stream needs the
    secret). A caller without it moves nothing."""
    from l4m.executor.server import ExecutorServicer
    from l4m.wire.credentials import bearer_metadata
    from tests.unit.executor.test_reset import _LOOP, SECRET, Aborted, FakeContext

    engine = make_engine(page_size=4, num_pages=8)
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (0,))])
    servicer = ExecutorServicer(engine, cluster_secret=SECRET)
    request = executor_pb2.ExecuteRequest(correlation_id=1)
    request.swap_out.items.add(kv_page_ids=[0], swap_slot_ids=[0])

    async def execute(metadata: tuple[tuple[str, str], ...]) -> list[executor_pb2.ExecuteResponse]:
        async def requests():  # type: ignore[no-untyped-def]
            yield request
        return [reply async for reply in servicer.Execute(requests(), FakeContext(metadata))]

    for metadata in ((), bearer_metadata("not-the-secret-but-long-enough")):
        with pytest.raises(Aborted, match="cluster secret"):
            _LOOP.run_until_complete(execute(metadata))
    assert engine.cache.is_page_allocated[0]  # refused: nothing moved
    assert _LOOP.run_until_complete(execute(bearer_metadata(SECRET))) == []  # fire-and-forget: it ran
    assert not engine.cache.is_page_allocated[0]
    servicer.close()
    assert "swap_out" not in l4m_pb2.SessionRequest.DESCRIPTOR.fields_by_name
    assert "swap_in" not in l4m_pb2.SessionRequest.DESCRIPTOR.fields_by_name
