"""The static decode step (`decode_graphs.py`) and its kernels (`decode_ops.py`).

Without a GPU: the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1) against the torch
reference ops, and the static step with the torch ops runs against the per-op path (`LlamaModel.forward`)
on the same cache: padding rows, page-table padding, BRLE rows, page visibility and fully hidden rows.
With `L4M_TEST_DEVICE=cuda:0` the kernels run natively, the step is captured as CUDA graphs, and the
engine tests in test_forward.py go through it (it is the default on CUDA).
"""

from __future__ import annotations

import dataclasses
import platform
import sys

import numpy as np
import pytest
import torch

from l4m.executor import decode_ops
from l4m.executor.attention import ItemLayout, build_plan
from l4m.executor.commands import ForwardText, SamplerKind, SamplerSpec
from l4m.executor.decode_graphs import StaticDecoder, batch_buckets, bucket_for, capture_keys, page_buckets
from l4m.executor.decode_ops import TorchOps, TritonOps
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.kv_cache import KvCache
from l4m.executor.model import LlamaModel
from tests.unit.executor.conftest import ON_CPU, TEST_DEVICE, PageTables, engine_stats


@pytest.fixture
def triton_ops() -> type:
    """Triton's kernels on this test's device: interpreted on the CPU (conftest sets TRITON_INTERPRET),
    compiled on CUDA."""
    if not decode_ops.triton_available() and (platform.machine(), sys.platform) != ("x86_64", "linux"):
        pytest.skip(f"Triton publishes no wheel for {platform.machine()} {sys.platform} (pyproject [test])")
    assert decode_ops.triton_available(), "Triton is a test dependency (pyproject [test])"
    assert decode_ops.interpreting() == ON_CPU
    return TritonOps


def test_buckets() -> None:
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert batch_buckets(1) == (1,)
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    assert page_buckets(1) == (1,)
    assert page_buckets(512) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert page_buckets(300)[-1] == 512
    assert bucket_for(3, (1, 2, 4)) == 4
    assert bucket_for(4, (1, 2, 4)) == 4
    assert bucket_for(5, (1, 2, 4)) is None


def test_capture_keys_cover_every_bucket_an_item_of_the_cache_can_fall_in() -> None:
    pages = page_buckets(512)
    assert capture_keys((1, 2), pages, 5) == [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4), (1, 8), (2, 8)]
    assert capture_keys((1,), pages, 8)[-1] == (1, 8)  # exactly a bucket: nothing past it
    assert len(capture_keys((1, 2), pages, 100_000)) == 2 * len(pages)  # a cache past the context: every bucket
    with pytest.raises(ValueError, match="max_pages must be >= 1"):
        capture_keys((1,), pages, 0)


def test_supports_names_the_shape_it_refuses() -> None:
    assert decode_ops.supports(16, 64) is None
    assert "page_size 12" in decode_ops.supports(12, 64)
    assert "head_dim 96" in decode_ops.supports(16, 96)


def test_auto_attention_splits_only_where_items_are_few(monkeypatch) -> None:
    """"auto" takes the split kernel where it gives each (item, KV head) more than one split of the
    pages, and the blocked one where items and heads alone fill the GPU."""
    assert decode_ops.split_count(1, 3, 64) == 64  # 264 programs / 3 KV heads, to a power of two, <= pages
    assert decode_ops.split_count(16, 3, 16) == 8
    assert decode_ops.split_count(64, 3, 16) == 2
    assert decode_ops.split_count(96, 3, 16) == 1
    chosen: list[str] = []
    for variant in ("blocked", "split"):
        monkeypatch.setattr(TritonOps, f"decode_attention_{variant}", staticmethod(lambda *_, v=variant: chosen.append(v)))

    def choose(setting: str, batch: int, pages: int) -> str:
        monkeypatch.setattr(decode_ops, "DECODE_ATTENTION", setting)
        q, kv = torch.zeros(batch, 9, 64), torch.zeros(1, 2, 16, 3, 64)  # 9 query heads on 3 KV heads
        TritonOps.decode_attention(q, kv, torch.zeros(batch, pages, dtype=torch.int32), None, None, None, None)
        return chosen.pop()

    assert [choose("auto", b, 16) for b in (1, 16, 64, 96, 128)] == ["split", "split", "split", "blocked", "blocked"]
    assert choose("auto", 16, 1) == "blocked"  # one page: nothing to split
    assert [choose(s, 1, 16) for s in ("blocked", "split")] == ["blocked", "split"]
    assert choose("split", 128, 16) == "split"


# ---- the kernels against the torch reference -----------------------------------------------------


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("attention", ["blocked", "split", "split once"])
@pytest.mark.parametrize("block_slots", [4, 64], ids=["a page per iteration", "every page at once"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scores", ["dot", "broadcast"])
def test_kernels_match_the_torch_reference(triton_ops, scores, dtype, block_slots, attention, monkeypatch) -> None:
    """Every kernel; the attention in both variants ("split": 4 splits of one page here, "split once":
    one split walking every page), its products as tl.dot (where a block has 16 slots: every page at
    once, blocked or split once) or as broadcast sums."""
    monkeypatch.setattr(decode_ops, "DECODE_SCORES", scores)
    monkeypatch.setattr(decode_ops, "DECODE_BLOCK_SLOTS", block_slots)
    monkeypatch.setattr(decode_ops, "DECODE_ATTENTION", attention.split()[0])
    if attention == "split once":
        monkeypatch.setattr(decode_ops, "SPLIT_TARGET_PROGRAMS", 1)
    device = torch.device(TEST_DEVICE)
    gen = torch.Generator().manual_seed(0)
    B, H, KVH, D, S, P, C, F = 3, 9, 3, 64, 4, 10, 40, 24

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    hidden = torch.randn(B, C, generator=gen).to(device)
    delta, weight = randn(B, C), torch.randn(C, generator=gen).to(device)
    for with_delta in (True, False):
        results = []
        for ops in (TorchOps, triton_ops):
            h, out = hidden.clone(), torch.empty(B, C, dtype=dtype, device=device)
            ops.add_rms_norm(h, delta if with_delta else None, weight, 1e-5, out)
            results.append((h, out))
        _close(results[0][0], results[1][0], torch.float32)
        _close(results[0][1], results[1][1], dtype)

    qkv = randn(B, (H + 2 * KVH) * D)
    positions = torch.tensor([5, 0, 17], dtype=torch.int32, device=device)
    angles = torch.randn(32, D // 2, generator=gen).repeat(1, 2).to(device)  # rotate-half layout
    cos, sin = angles.cos(), angles.sin()
    write_page = torch.tensor([2, 7, 9], dtype=torch.int32, device=device)
    write_offset = torch.tensor([1, 0, 3], dtype=torch.int32, device=device)
    results = []
    for ops in (TorchOps, triton_ops):
        kv = torch.zeros(P, 2, S, KVH, D, dtype=dtype, device=device)
        q = torch.empty(B, H, D, dtype=dtype, device=device)
        ops.rope_write_kv(qkv, positions, cos, sin, kv, write_page, write_offset, q)
        results.append((kv, q))
    assert results[1][0].count_nonzero() == B * 2 * KVH * D  # one slot per item, K and V, nothing else
    _close(results[0][0], results[1][0], dtype)
    _close(results[0][1], results[1][1], dtype)

    kv, q = randn(P, 2, S, KVH, D), randn(B, H, D)
    table = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 8]], dtype=torch.int32, device=device)
    ctx_len = torch.tensor([10, 1, 16], dtype=torch.int32, device=device)
    page_visible = (torch.rand(P, S, generator=gen) > 0.2).to(device)
    row_visible = (torch.rand(B, 4 * S, generator=gen) > 0.3).to(torch.uint8).to(device)
    row_visible[1] = 0  # item 1 sees nothing: zeros
    results = []
    for ops in (TorchOps, triton_ops):
        out = torch.full((B, H * D), float("nan"), dtype=dtype, device=device)
        ops.decode_attention(q, kv, table, ctx_len, page_visible, row_visible, out)
        results.append(out)
    _close(results[0], results[1], dtype)
    assert not results[1][1].any()
    assert results[1][0].abs().sum() > 0

    gate_up = randn(B, 2 * F)
    results = []
    for ops in (TorchOps, triton_ops):
        out = torch.empty(B, F, dtype=dtype, device=device)
        ops.silu_mul(gate_up, out)
        results.append(out)
    _close(results[0], results[1], dtype)


# ---- the static step against the per-op path ------------------------------------------------------


PAGE = 4


def _pair(loaded, device: torch.device, dtype: torch.dtype) -> tuple[LlamaModel, KvCache, KvCache]:
    model = LlamaModel(loaded, dtype, device)
    cfg = loaded.config

    def cache(scratch: int) -> KvCache:
        return KvCache(cfg.num_layers, 24, PAGE, cfg.num_kv_heads, cfg.head_dim, 0, cfg.hidden_size,
                       dtype, device, scratch_pages=scratch)

    return model, cache(0), cache(1)


def _prefill(model: LlamaModel, cache: KvCache, prompts: list[list[int]], pages: list[list[int]]) -> None:
    layouts = [ItemLayout(p, 0, len(t), ()) for t, p in zip(prompts, pages, strict=True)]
    plan = build_plan(layouts, PAGE, cache.page_visible, model.dtype)
    tokens = torch.tensor([t for ts in prompts for t in ts], device=model.device)
    positions = torch.tensor([i for ts in prompts for i in range(len(ts))], device=model.device)
    with torch.inference_mode():
        model.forward(model.embed_tokens(tokens), positions, plan, cache, torch.arange(1, device=model.device))


def test_static_step_matches_the_per_op_path(loaded, prompts) -> None:
    """Three items (bucket 4: one padding row) of different lengths, one with a BRLE row, one reading a
    page whose slot is hidden, and a fourth step where one item sees nothing."""
    device = torch.device(TEST_DEVICE)
    ops = TorchOps if ON_CPU else TritonOps
    model, reference, cache = _pair(loaded, device, torch.float32)
    texts = [prompts[1][:9], prompts[2][:5], prompts[4][:3]]
    pages = [[0, 1, 2, 3], [5, 6, 7], [9, 10]]
    for c in (reference, cache):
        _prefill(model, c, texts, pages)
        c.page_visible[5, 2] = False  # item 1 cannot see its slot 2
    decoder = StaticDecoder(model, cache, ops, max_batch=8, graphs=not ON_CPU)
    lengths = [len(t) for t in texts]
    next_tokens = [t[-1] for t in texts]
    for step in range(4):
        masks = [(), (), ()]
        if step == 1:  # item 0 hides slots 2..5 of its context
            masks[0] = ((2, 4, lengths[0] + 1 - 6),)
        if step == 3:  # item 2 sees nothing
            masks[2] = ((0, lengths[2] + 1),)
        layouts = [ItemLayout(p[: -(-(n + 1) // PAGE)], n, 1, m) for p, n, m in zip(pages, lengths, masks, strict=True)]
        tokens = torch.tensor(next_tokens, device=device)
        positions = torch.tensor(lengths)
        rows = torch.arange(3, device=device)
        with torch.inference_mode():
            hidden = model.embed_tokens(tokens)
            plan = build_plan(layouts, PAGE, reference.page_visible, model.dtype)
            want = model.forward(hidden, positions.to(device), plan, reference, rows)
            got = decoder.run(layouts, hidden, positions, rows)
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=2e-4, rtol=2e-4)
        for layer_ref, layer in zip(reference.layers, cache.layers, strict=True):
            torch.testing.assert_close(layer[:24].cpu(), layer_ref.cpu(), atol=2e-5, rtol=2e-5)
        with torch.inference_mode():
            logits = model.logits(got)
        next_tokens = logits.argmax(-1).tolist()
        assert next_tokens == model.logits(want).argmax(-1).tolist()
        lengths = [n + 1 for n in lengths]
    assert decoder.bucket(layouts) == (4, 4)
    assert decoder.num_graphs == (0 if ON_CPU else 1)
    assert set(decoder.decode_graphs(3)) == (set() if ON_CPU else {4})


def test_padding_rows_touch_only_the_scratch_page(loaded, prompts) -> None:
    """Three items in bucket 4: the padding row writes the scratch page, each item its next slot."""
    device = torch.device(TEST_DEVICE)
    ops = TorchOps if ON_CPU else TritonOps
    model, _, cache = _pair(loaded, device, torch.float32)
    texts, pages = [prompts[0][:6], prompts[1][:2], prompts[2][:3]], [[3, 4], [6], [8]]
    _prefill(model, cache, texts, pages)
    before = [layer.clone() for layer in cache.layers]
    decoder = StaticDecoder(model, cache, ops, max_batch=4, graphs=not ON_CPU)
    layouts = [ItemLayout(p, len(t), 1, ()) for p, t in zip(pages, texts, strict=True)]
    with torch.inference_mode():
        hidden = model.embed_tokens(torch.tensor([t[-1] for t in texts], device=device))
        decoder.run(layouts, hidden, torch.tensor([len(t) for t in texts]), torch.arange(3, device=device))
    assert decoder.bucket(layouts) == (4, 2)
    scratch = cache.num_pages
    for old, new in zip(before, cache.layers, strict=True):
        changed = {page for page, _ in (old != new).flatten(2).any(-1).nonzero().tolist()}
        assert changed - {scratch} == {4, 6, 8}  # (the padding row's zeros may leave scratch as it was)
        assert torch.equal(old[3], new[3])  # the first item's full first page is untouched
        for page, slot in ((4, 2), (6, 2), (8, 3)):
            assert new[page, :, slot].count_nonzero() > 0
            assert torch.equal(torch.cat([old[page, :, :slot], old[page, :, slot + 1 :]], 1),
                               torch.cat([new[page, :, :slot], new[page, :, slot + 1 :]], 1))


def test_static_decoder_needs_a_scratch_page(loaded) -> None:
    model, cache, _ = _pair(loaded, torch.device(TEST_DEVICE), torch.float32)
    with pytest.raises(ValueError, match="scratch page"):
        StaticDecoder(model, cache, TorchOps)


def test_a_batch_past_the_buckets_is_refused_by_name(loaded) -> None:
    model, _, cache = _pair(loaded, torch.device(TEST_DEVICE), torch.float32)
    decoder = StaticDecoder(model, cache, TorchOps, max_batch=2, graphs=False)
    layouts = [ItemLayout([0], 0, 1, ())] * 3
    assert decoder.bucket(layouts) is None
    with pytest.raises(ValueError, match="3 items is bigger than every bucket"):
        decoder.run(layouts, torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), torch.arange(3))
    np.testing.assert_array_equal(decoder.batch_buckets, (1, 2))


# ---- the engine: decode batches and greedy continuation through the static step -------------------


def _engine(loaded, static: bool) -> Engine:
    config = EngineConfig(device=TEST_DEVICE, dtype="float32", page_size=PAGE, num_pages=64,
                          num_embed_slots=0, weights="dequantized", decode_graphs=static)
    if ON_CPU:
        return Engine(loaded, config, static_ops=TorchOps if static else None)
    return Engine(loaded, config)


def _continuation_batch(engine: Engine, prompts: list[list[int]], steps: list[int], stops: list[frozenset[int]],
                        sampler: SamplerSpec) -> list[ForwardText]:
    tables = PageTables(engine)
    items = []
    for n, (prompt, k, stop) in enumerate(zip(prompts, steps, stops, strict=True)):
        item = tables.item(f"s{n}", prompt, outputs=(len(prompt) - 1,), sampler=sampler)
        pages, last = tables.grow(f"s{n}", k)
        items.append(dataclasses.replace(item, kv_page_ids=pages, kv_last_page_length=last,
                                         num_continuation_steps=k, continuation_stop_token_ids=stop))
    return items


def test_graphs_captured_at_start_serve_every_later_batch_without_a_capture(loaded, prompts) -> None:
    """EngineConfig.capture_graphs_at_start: on CUDA every bucket's decode and continuation graphs exist
    once the engine is built, and a continuation batch captures nothing more and gives the tokens of an
    engine that captures on first use; off CUDA there is nothing to capture."""
    config = EngineConfig(device=TEST_DEVICE, dtype="float32", page_size=PAGE, num_pages=64, num_embed_slots=0,
                          weights="dequantized", graph_max_batch=2)
    eager = Engine(loaded, dataclasses.replace(config, capture_graphs_at_start=True))
    lazy = Engine(loaded, config)
    if ON_CPU:
        assert eager.captured_at_start == (0, 0.0) and eager.capture_decode_graphs() == (0, 0.0)
        return
    decoder = eager.static_decoder
    keys = capture_keys(decoder.batch_buckets, decoder.page_buckets, eager.cache.num_pages)
    assert eager.captured_at_start[0] == decoder.num_graphs == 2 * len(keys) == 2 * 2 * 7
    greedy = SamplerSpec(SamplerKind.GREEDY)
    batches = [_continuation_batch(engine, [prompts[0], prompts[1]], [5, 3], [frozenset(), frozenset()], greedy)
               for engine in (eager, lazy)]
    got = [[[o.token_id for o in r.outputs] for r in engine.forward_text(items)]
           for engine, items in zip((eager, lazy), batches, strict=True)]
    assert decoder.num_graphs == 2 * len(keys)  # nothing captured on the way
    assert got[0] == got[1] and [len(tokens) for tokens in got[0]] == [6, 4]


def test_greedy_continuation_on_the_device_matches_the_host_loop(loaded, prompts) -> None:
    """Items of different step counts, one with no steps, one that stops on a token it samples: the
    same tokens (and logprobs) as the host's loop of forward_text steps, and the same K/V."""
    texts = [prompts[0], prompts[1][:7], prompts[3], prompts[5]]
    host, device = _engine(loaded, static=False), _engine(loaded, static=True)
    assert host.static_decoder is None and device.static_decoder is not None
    greedy = SamplerSpec(SamplerKind.GREEDY)
    probe = host.forward_text(_continuation_batch(host, texts[3:], [6], [frozenset()], greedy))[0]
    stop_at = probe.outputs[3].token_id  # item 3 will sample it at its step 3 and stop there
    host.reset()
    steps = [9, 5, 0, 6]
    stops = [frozenset({2}), frozenset(), frozenset(), frozenset({stop_at, 7})]
    want = host.forward_text(_continuation_batch(host, texts, steps, stops, greedy))
    got = device.forward_text(_continuation_batch(device, texts, steps, stops, greedy))
    assert [len(r.outputs) for r in got] == [len(r.outputs) for r in want]
    assert len(got[3].outputs) == 4 and len(got[2].outputs) == 1  # stopped at step 3; no steps
    for w, g in zip(want, got, strict=True):
        assert [o.token_id for o in g.outputs] == [o.token_id for o in w.outputs]
        np.testing.assert_allclose([o.logprob for o in g.outputs], [o.logprob for o in w.outputs], atol=1e-3)
    stats = engine_stats(device)
    assert stats["num_device_continuation_steps"] == sum(len(r.outputs) - 1 for r in got)
    assert engine_stats(host)["num_device_continuation_steps"] == 0
    for a, b in zip(host.cache.layers, device.cache.layers, strict=True):
        torch.testing.assert_close(b[: host.cache.num_pages].cpu(), a.cpu(), atol=1e-4, rtol=1e-4)


def test_sampled_continuation_stays_on_the_host_loop(loaded, prompts) -> None:
    engine = _engine(loaded, static=True)
    seeded = SamplerSpec(SamplerKind.SAMPLE, temperature=0.8, seed=5)
    results = engine.forward_text(_continuation_batch(engine, [prompts[0]], [4], [frozenset()], seeded))
    assert len(results[0].outputs) == 5
    stats = engine_stats(engine)
    assert stats["num_device_continuation_steps"] == 0
    assert stats["num_graph_batches"] == 4  # its steps still take the static step, one batch each


def test_decode_batches_take_the_static_step_and_match(loaded, prompts) -> None:
    """Stepwise greedy decoding through the engine: the static step's tokens are the per-op path's."""
    host, device = _engine(loaded, static=False), _engine(loaded, static=True)
    outs = []
    for engine in (host, device):
        tables = PageTables(engine)
        tokens = [r.outputs[-1].token_id for r in engine.forward_text(
            [tables.item(f"s{n}", p, outputs=(len(p) - 1,)) for n, p in enumerate(prompts[:3])])]
        seq = [tokens]
        for _ in range(5):
            tokens = [r.outputs[0].token_id for r in engine.forward_text(
                [tables.item(f"s{n}", [t]) for n, t in enumerate(tokens)])]
            seq.append(tokens)
        outs.append(seq)
    assert outs[0] == outs[1]
    assert engine_stats(device)["num_graph_batches"] == 5
    assert engine_stats(host)["num_graph_batches"] == 0
