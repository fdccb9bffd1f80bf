"""Ragged attention (`attention.py`): a batch that mixes a prefill chunk with decode steps attends in
groups, so that no item is padded to another's rows or context. Every item of such a batch gets the
float32 logits and greedy token it gets alone and the dense reference's, masks and sliding windows
included, on the torch path and with the decode steps on the CPU kernel."""

from __future__ import annotations

import pytest
import torch

from l4m.executor import attention
from l4m.executor import engine as engine_module
from l4m.executor.attention import DecodePlan, ItemLayout, PaddedGroup, group_items
from l4m.executor.commands import ForwardText
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.quant import kernels_available
from l4m.executor.weights import load_model
from l4m.wire.brle import encode
from tests.unit.executor.conftest import TEST_DEVICE, LogitsRecorder, PageTables, cpu_only, engine_stats
from tests.unit.executor.reference import reference_logits
from tests.unit.executor.test_forward import TOL_FP32, causal, rows_of
from tests.unit.executor.tiny_models import WINDOW, build_hf, write_gguf

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")


# ---- the grouping rule --------------------------------------------------------------------------


def _layout(num_ctx: int, num_new: int, page_size: int = 16) -> ItemLayout:
    num_pages = -(-(num_ctx + num_new) // page_size)
    return ItemLayout(tuple(range(num_pages)), num_ctx, num_new, ())


def test_a_chunk_beside_decode_steps_attends_apart_from_them() -> None:
    items = [_layout(100 + 25 * b, 1) for b in range(8)] + [_layout(2048, 2048)] + [_layout(450, 1)]
    assert group_items(items, 16) == [[8], [0, 1, 2, 3, 4, 5, 6, 7, 9]]


def test_alike_items_stay_one_call_in_batch_order() -> None:
    prompts = [_layout(0, 100), _layout(0, 96), _layout(0, 90)]
    assert group_items(prompts, 16) == [[0, 1, 2]]
    steps = [_layout(10, 1), _layout(5000, 1), _layout(300, 1)]  # decode steps read no padding: one call
    assert group_items(steps, 16) == [[0, 1, 2]]


def test_decode_apart_keeps_decode_steps_out_of_a_chunk_of_about_their_pages() -> None:
    """A 22-token chunk at 60 slots (6 pages) beside steps at 132 (9 pages): padding them into the chunk's
    call costs less than an SDPA call of their own, so they join it; apart (the CPU kernels' rule) they
    form the decode group that `mixed_layers` takes with the chunk."""
    items = [_layout(60, 22), *(_layout(132 + b, 1) for b in range(4))]
    assert group_items(items, 16) == [[0, 1, 2, 3, 4]]
    assert group_items(items, 16, decode_apart=True) == [[0], [1, 2, 3, 4]]
    prompts = [_layout(0, 100), _layout(0, 96), _layout(30, 2)]  # no single-token item: the same groups
    assert group_items(prompts, 16, decode_apart=True) == group_items(prompts, 16)


def test_items_far_apart_in_size_split_and_an_infinite_call_cost_keeps_one_padded_call(monkeypatch) -> None:
    items = [_layout(0, 8), _layout(0, 1000), _layout(30, 2)]
    assert group_items(items, 16) == [[1], [0, 2]]
    monkeypatch.setattr(attention, "CALL_COST_PAIRS", float("inf"))
    assert group_items(items, 16) == [[0, 1, 2]]


# ---- the real model: a mixed batch against each item alone and the dense reference ----------------

PAGE = 16
DECODE_CONTEXTS = [7, 30, 63, 64, 100, 129]  # the new token mid-page, on a page's last slot, on a fresh one


def _sequences(prompts: list[list[int]]) -> dict[str, list[int]]:
    """name -> the tokens it holds after the mixed batch (context, then the batch's new tokens)."""
    pool = [t for p in prompts for t in p] * 12
    seqs = {"chunk": pool[3:193], "masked": pool[50:90], "dead": pool[11:20]}
    for n, length in enumerate(DECODE_CONTEXTS):
        seqs[f"d{n}"] = pool[n * 5 : n * 5 + length + 1]
    return seqs


CONTEXT = {"chunk": 40, "masked": 12, "dead": 4}  # context of the multi-token items; decode items: all but one


def _masks(seqs: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Dense masks `[T, T]` (True = attend) of the masked items; the rest are causal."""
    masks = {}
    m = causal(len(seqs["masked"]))
    m[20:, 3:9] = False  # a hole, as a tree search leaves
    m[-1, :-1] = False
    masks["masked"] = m
    for name, hidden in (("d1", [0, 5, 17]), ("d4", list(range(40, 80)))):
        m = causal(len(seqs[name]))
        m[-1, hidden] = False
        masks[name] = m
    m = causal(len(seqs["dead"]))
    m[-3, :] = False  # a row of the batch that sees nothing: attention output 0
    masks["dead"] = m
    return masks


def _batch(tables: PageTables, seqs: dict[str, list[int]], masks: dict[str, torch.Tensor]) -> list[ForwardText]:
    items = []
    for name, tokens in seqs.items():
        start = CONTEXT.get(name, len(tokens) - 1)
        mask = rows_of(masks[name], start, len(tokens)) if name in masks else ()
        items.append(tables.item(name, tokens[start:], mask=mask))
    return items


def _setup(engine: Engine, seqs: dict[str, list[int]]) -> PageTables:
    tables = PageTables(engine)
    engine.forward_text([tables.item(n, s[: CONTEXT.get(n, len(s) - 1)], outputs=()) for n, s in seqs.items()])
    return tables


def _record_plans(monkeypatch) -> list[attention.AttentionPlan]:
    plans = []

    def recording(*args, **kwargs) -> attention.AttentionPlan:
        plans.append(attention.build_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(engine_module, "build_plan", recording)
    return plans


@pytest.mark.parametrize(
    ("weights", "call_cost", "against_reference"),
    [
        ("dequantized", attention.CALL_COST_PAIRS, True),
        ("dequantized", 0, False),
        pytest.param("quantized", 0, False, marks=[cpu_only, needs_kernels]),
    ],
)
def test_mixed_batch_gives_each_item_its_logits_alone(
    make_engine, loaded, prompts, monkeypatch, weights, call_cost, against_reference
) -> None:
    """A 150-token chunk, a masked 28-token prefill, a 5-token item with a row that sees nothing and six
    decode steps (two masked) in one batch. Quantized: the decode steps attend on the CPU kernel (`decode_attention`)
    in the batch and run through `decode_layers` alone. A call cost of 0 gives every multi-token
    item a call of its own. The dense reference (seconds per item) is checked once: the paths alone
    are held to it by test_forward and test_decode_kernel."""
    monkeypatch.setattr(attention, "CALL_COST_PAIRS", call_cost)
    seqs, masks = _sequences(prompts), _masks(_sequences(prompts))
    mixed, alone = (make_engine(page_size=PAGE, weights=weights, max_quantized_rows=1 << 20) for _ in range(2))
    plans = _record_plans(monkeypatch)
    tables = _setup(mixed, seqs)
    recorder = LogitsRecorder(mixed)
    results = mixed.forward_text(_batch(tables, seqs, masks))
    kinds = [type(g) for g in plans[-1].groups]
    assert kinds.count(DecodePlan) == 1, "the decode steps attend together"
    assert kinds.count(PaddedGroup) == (3 if call_cost == 0 else 2), kinds  # by default the two small share
    assert plans[-1].dead_rows is not None and len(plans[-1].dead_rows) == 1
    got = torch.split(recorder.calls[-1], [len(s) - CONTEXT.get(n, len(s) - 1) for n, s in seqs.items()])

    tables = _setup(alone, seqs)
    recorder = LogitsRecorder(alone)
    alone_tokens = []
    for item in _batch(tables, seqs, masks):
        alone_tokens.append([o.token_id for o in alone.forward_text([item])[0].outputs])
    assert len(recorder.calls) == len(seqs)
    for n, (name, tokens) in enumerate(seqs.items()):
        diff = float((got[n] - recorder.calls[n]).abs().max())
        assert diff <= TOL_FP32, f"{name}: max |Δlogit| {diff:.2e} against the item alone"
        assert [o.token_id for o in results[n].outputs] == alone_tokens[n], name
        if name == "dead" or not against_reference:
            continue  # the reference's softmax over nothing is NaN: the item alone is the yardstick
        start = CONTEXT.get(name, len(tokens) - 1)
        expected = reference_logits(loaded, tokens, mask=masks.get(name))[start:]
        diff = float((got[n] - expected).abs().max())
        assert diff <= TOL_FP32, f"{name}: max |Δlogit| {diff:.2e} against the reference"
    if against_reference:
        hole = reference_logits(loaded, seqs["d4"])[-1]
        assert float((hole - got[list(seqs).index("d4")][-1]).abs().max()) > 0.1, "the hidden slots must matter"


# ---- a sliding window (a tiny Mistral) ------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral")
    return path, build_hf("mistral", path)


@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("gguf-q8_0", marks=[cpu_only, needs_kernels])])
def test_mixed_batch_honours_the_sliding_window(mistral, tmp_path, monkeypatch, fmt) -> None:
    """Items past the window (16 slots): a 40-token chunk over 30 slots, decode steps over 5-60 slots,
    one with a mask; each gets its logits alone, which the architecture tests hold to transformers'."""
    path, model = mistral
    if fmt != "safetensors":
        path = tmp_path / "mistral.gguf"
        write_gguf("mistral", model, path, quant="Q8_0")
    loaded = load_model(path)
    assert loaded.config.sliding_window == WINDOW
    monkeypatch.setattr(attention, "CALL_COST_PAIRS", 0)
    weights = "dequantized" if fmt == "safetensors" else "quantized"
    g = torch.Generator().manual_seed(3)
    seqs = {"chunk": torch.randint(3, 2000, (70,), generator=g).tolist()}
    for n, length in enumerate([5, 17, 33, 60]):
        seqs[f"d{n}"] = torch.randint(3, 2000, (length + 1,), generator=g).tolist()
    context = {"chunk": 30}
    hide = (0, 1, 2, 3, 4, 5, 6, 7, 40, 50, 55)  # d3's last row: only some of these fall in its window
    runs = []
    for _ in range(2):
        engine = Engine(loaded, EngineConfig(device=TEST_DEVICE, page_size=4, num_pages=128, num_embed_slots=0,
                                             weights=weights, max_quantized_rows=1 << 20))
        tables = PageTables(engine)
        engine.forward_text([tables.item(n, s[: context.get(n, len(s) - 1)], outputs=()) for n, s in seqs.items()])
        items = []
        for name, tokens in seqs.items():
            start = context.get(name, len(tokens) - 1)
            row = [j not in hide for j in range(len(tokens))] if name == "d3" else None
            items.append(tables.item(name, tokens[start:], mask=(tuple(encode(row)),) if row else ()))
        recorder = LogitsRecorder(engine)
        if runs:
            for item in items:
                engine.forward_text([item])
        else:
            engine.forward_text(items)
        runs.append(torch.cat(recorder.calls))
    diff = float((runs[0] - runs[1]).abs().max())
    # The architecture tests' bounds: 1e-4 to transformers; the quantized paths' row counts differ here.
    assert diff <= (1e-4 if fmt == "safetensors" else TOL_FP32), f"mixed against alone: max |Δlogit| {diff:.2e}"


# ---- the kernel's own checks ----------------------------------------------------------------------


@cpu_only
@needs_kernels
def test_decode_attention_kernel_matches_its_torch_twin() -> None:
    """Random pages in a shuffled table, ragged lengths, random slot visibility, one item that sees
    nothing (zeros, as the padded path gives)."""
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(12, 2, 16, 3, 64, generator=g)
    table = torch.randperm(12, generator=g)[:9].reshape(3, 3)
    ctx_len = torch.tensor([1, 23, 48])
    visible = (torch.rand(3, 48, generator=g) < 0.7).to(torch.uint8)
    visible[1] = 0
    plan = DecodePlan(table, ctx_len, visible)
    q = torch.randn(3, 9, 64, generator=g)
    got = torch.ops.l4m_cpu.decode_attention(q.reshape(3, -1), kv, table, ctx_len, visible, 9)
    want = attention._decode_attention(q, kv, plan)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not got[1].any() and got[2].abs().sum() > 0


@cpu_only
@needs_kernels
def test_decode_attention_kernel_refuses_what_does_not_fit() -> None:
    """Shapes, lengths and page ids are checked before anything is read: a clear error naming it."""
    kv = torch.zeros(4, 2, 16, 3, 64)
    q = torch.zeros(2, 9 * 64)
    table = torch.tensor([[0, 1], [2, 3]])
    ctx_len = torch.tensor([20, 5])
    visible = torch.ones(2, 32, dtype=torch.uint8)
    assert torch.ops.l4m_cpu.decode_attention(q, kv, table, ctx_len, visible, 9).shape == (2, 9 * 64)
    bad = {
        "page id out of range": (q, kv, torch.tensor([[0, 1], [2, 4]]), torch.tensor([20, 20]), visible, 9),
        "num_heads \\* head_dim": (q, kv, table, ctx_len, visible, 6),
        "bad ctx_len": (q, kv, table, torch.tensor([20, 33]), visible, 9),
        "float32": (q.double(), kv, table, ctx_len, visible, 9),
        "visible": (q, kv, table, ctx_len, visible.bool(), 9),
    }
    for reason, args in bad.items():
        with pytest.raises(RuntimeError, match=reason):
            torch.ops.l4m_cpu.decode_attention(*args)


# ---- decode steps beside a chunk keep the C++ stack (`mixed_layers`) ------------------------------


def test_split_mixed_takes_decode_steps_beside_one_group_of_equal_items_only() -> None:
    visible = torch.ones(64, PAGE, dtype=torch.bool)

    def split(items: list[ItemLayout]) -> attention.MixedSplit | None:
        return attention.split_mixed(attention.build_plan(items, PAGE, visible, torch.float32))

    steps = [_layout(700, 1), _layout(900, 1)]  # too long to pad into the chunk's call
    mixed = split([steps[0], _layout(400, 24), steps[1]])
    assert mixed is not None and mixed.order.tolist() == [0, 25, *range(1, 25)], "the decode steps' rows first"
    assert mixed.decode.ctx_len.tolist() == [701, 901] and mixed.group.num_items == 1
    assert split(steps) is None, "decode steps alone are decode_layers' batch"
    assert split([_layout(0, 30), _layout(0, 30)]) is None, "no decode step"
    assert split([_layout(400, 24), _layout(400, 20), *steps]) is None, "a group of unequal items scatters"
    assert split([_layout(40, 24), _layout(7, 1)]) is None, "a decode step padded into the chunk's call"
    assert split([_layout(0, 8), _layout(0, 1000), *steps]) is None, "two padded groups"


@cpu_only
@needs_kernels
def test_decode_steps_beside_a_chunk_keep_the_cpp_stack(make_engine, prompts, monkeypatch) -> None:
    """A 150-token chunk (a hole in its mask, a row that sees nothing) beside six decode steps (two
    masked) runs as one `mixed_layers` call: every item gets the float32 logits and the greedy tokens it
    gets alone (the chunk on the torch path, a step through `decode_layers`)."""
    seqs = {name: s for name, s in _sequences(prompts).items() if name not in ("masked", "dead")}
    masks = {name: m for name, m in _masks(_sequences(prompts)).items() if name in seqs}
    chunk_mask = causal(len(seqs["chunk"]))
    chunk_mask[60:, 10:20] = False
    chunk_mask[100, :] = False  # attention output 0
    masks["chunk"] = chunk_mask
    mixed, alone = (make_engine(page_size=PAGE, weights="quantized", max_quantized_rows=1 << 20) for _ in range(2))
    plans = _record_plans(monkeypatch)
    tables = _setup(mixed, seqs)
    recorder = LogitsRecorder(mixed)
    before = engine_stats(mixed)
    results = mixed.forward_text(_batch(tables, seqs, masks))
    after = engine_stats(mixed)
    assert after["num_mixed_kernel_batches"] == before["num_mixed_kernel_batches"] + 1
    assert attention.split_mixed(plans[-1]) is not None and plans[-1].dead_rows is not None
    got = torch.split(recorder.calls[-1], [len(s) - CONTEXT.get(n, len(s) - 1) for n, s in seqs.items()])

    tables = _setup(alone, seqs)
    recorder = LogitsRecorder(alone)
    for n, (name, item) in enumerate(zip(seqs, _batch(tables, seqs, masks), strict=True)):
        tokens = [o.token_id for o in alone.forward_text([item])[0].outputs]
        diff = float((got[n] - recorder.calls[-1]).abs().max())
        assert diff <= TOL_FP32, f"{name}: max |Δlogit| {diff:.2e} against the item alone"
        assert [o.token_id for o in results[n].outputs] == tokens, name
    assert engine_stats(alone)["num_mixed_kernel_batches"] == 0


@cpu_only
@needs_kernels
def test_a_chunk_of_about_the_decode_steps_pages_still_takes_mixed_layers(make_engine, prompts) -> None:
    """The case the SDPA cost rule pads together (`group_items`): a 22-token chunk whose pages are about
    the decode steps' runs with them as one `mixed_layers` call, with the greedy tokens each gets alone."""
    pool = [t for p in prompts for t in p] * 12
    seqs = {"chunk": pool[7:89], **{f"d{n}": pool[n : n + 133 + n] for n in range(4)}}
    context = {"chunk": 60}
    engine, alone = (make_engine(page_size=PAGE, weights="quantized", max_quantized_rows=1 << 20) for _ in range(2))
    tokens = {}
    for eng, one_by_one in ((engine, False), (alone, True)):
        tables = PageTables(eng)
        eng.forward_text([tables.item(n, s[: context.get(n, len(s) - 1)], outputs=()) for n, s in seqs.items()])
        batch = [tables.item(n, s[context.get(n, len(s) - 1) :], outputs=(len(s) - context.get(n, len(s) - 1) - 1,))
                 for n, s in seqs.items()]
        before = engine_stats(eng)["num_mixed_kernel_batches"]
        results = [eng.forward_text([item])[0] for item in batch] if one_by_one else eng.forward_text(batch)
        tokens[one_by_one] = [r.outputs[0].token_id for r in results]
        assert engine_stats(eng)["num_mixed_kernel_batches"] == before + (0 if one_by_one else 1)
    assert tokens[False] == tokens[True]


@cpu_only
@needs_kernels
def test_mixed_layers_refuses_what_does_not_fit(make_engine) -> None:
    """Two decode steps beside a 3-token chunk on the real weights; every shape, length, slot and page id
    is checked before anything is written: a clear error naming it, the cache untouched."""
    engine = make_engine(page_size=PAGE, num_pages=8, weights="quantized")
    model, layers = engine.model, engine.cache.layers
    positions = torch.tensor([2, 4, 0, 1, 2])
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    table, ctx_len, visible = torch.tensor([[0], [1]]), torch.tensor([3, 5]), torch.ones(2, PAGE, dtype=torch.uint8)
    slots = torch.tensor([2, PAGE + 4, 2 * PAGE, 2 * PAGE + 1, 2 * PAGE + 2])
    k_rows = 2 * 2 * PAGE + torch.arange(PAGE)  # page 2's K slots; its V slots follow
    kv_index = torch.stack((k_rows, k_rows + PAGE))[None]  # [1, 2, PAGE]
    mask = torch.zeros(1, 1, 3, PAGE).masked_fill_(~causal(PAGE)[:3], float("-inf"))
    dead = torch.zeros(0, dtype=torch.long)
    args = dict(hidden=hidden, cos=model.rope_cos[positions], sin=model.rope_sin[positions],
                weights=model._decode_weights, kv=layers, page_table=table, ctx_len=ctx_len, visible=visible,
                write_slots=slots, group_kv_index=kv_index, group_mask=mask, dead_rows=dead,
                num_heads=model.config.num_heads, eps=model.config.rms_norm_eps)
    bad = {
        "write slot out of range": dict(write_slots=slots.clone().index_fill_(0, torch.tensor([3]), 8 * PAGE)),
        "page id out of range": dict(page_table=torch.tensor([[0], [8]])),
        "group_kv_index out of range": dict(group_kv_index=kv_index + 8 * 2 * PAGE),
        "dead row out of range": dict(dead_rows=torch.tensor([5])),
        "bad ctx_len": dict(ctx_len=torch.tensor([3, PAGE + 1])),
        "rows must be the B decode items' then the group's": dict(group_mask=mask[:, :, :2]),
        "group_mask: float32": dict(group_mask=mask.double()),
        "group_kv_index: int64 \\[Bc, 2, Tkv\\]": dict(group_kv_index=kv_index[:, :, :8]),
        "cos/sin": dict(cos=model.rope_cos[positions[:4]]),
    }
    for reason, change in bad.items():
        with pytest.raises(RuntimeError, match=reason):
            torch.ops.l4m_cpu.mixed_layers(**(args | change))
        assert not any(layer.any() for layer in layers), f"{reason}: the cache was written"
    out = torch.ops.l4m_cpu.mixed_layers(**args)
    assert out.shape == hidden.shape and bool(out.isfinite().all())
    assert layers[0][2, 0, :3].abs().sum() > 0, "the chunk's K went into page 2"
