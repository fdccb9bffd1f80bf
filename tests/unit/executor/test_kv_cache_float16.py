"""A float16 KV cache (`EngineConfig.kv_cache_dtype = "float16"`, the executor's `--kv-cache-dtype`; CPU, dtype
float32).

The kernels' contract is exact: attention over a float16 cache is the float32 kernel over the same values
widened (decode_attention, group_attention, and so decode_layers and mixed_layers), and a new K/V row is
stored as float16's rounding of its float32 value, clamped to +-65504 (NaN stays NaN), by the kernels and the
torch path alike. The engine's logits then move from the float32 reference by what rounding K and V costs,
held to a margin rule. The mode is refused, naming why, wherever it cannot run.
"""

from __future__ import annotations

import pytest
import torch

from l4m.executor import engine as engine_module
from l4m.executor.config import EngineConfig, EngineConfigError, resolve_kv_cache_dtype
from l4m.executor.kv_cache import KvCache
from l4m.executor.model import FLOAT16_MAX, _kv_values
from l4m.executor.quant import kernels_available
from tests.unit.executor.conftest import PageTables, cpu_only, engine_stats
from tests.unit.executor.margins import RecordedRun, margin_rule_failures
from tests.unit.executor.test_bf16_activations import X_BF16_MARGIN, X_BF16_MAX_DIFF
from tests.unit.executor.test_group_attention_kernel import _group_case
from tests.unit.executor.test_q4_gemm import needs_bf16

pytestmark = [
    cpu_only,
    pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler"),
]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_over_float16_is_the_float32_kernel_over_its_values(head_dim, threads) -> None:
    """Items of 1-70 slots over shuffled pages, some slots hidden, one item that sees nothing."""
    g = torch.Generator().manual_seed(head_dim)
    page, kv_heads, heads, contexts = 16, 3, 9, [1, 17, 70, 33, 5]
    width = max(contexts)
    table_width = -(-width // page)
    num_pages = len(contexts) * table_width
    cache = torch.randn(num_pages, 2, page, kv_heads, head_dim, generator=g).half()
    table = torch.randperm(num_pages, generator=g).view(len(contexts), table_width)
    visible = (torch.rand(len(contexts), width, generator=g) < 0.85).to(torch.uint8)
    visible[3] = 0  # item 3 sees nothing: output 0
    ctx = torch.tensor(contexts)
    q = torch.randn(len(contexts), heads * head_dim, generator=g)

    got = torch.ops.l4m_cpu.decode_attention(q, cache, table, ctx, visible, heads)
    widened = torch.ops.l4m_cpu.decode_attention(q, cache.float(), table, ctx, visible, heads)
    assert torch.equal(got, widened)
    assert not got[3].any() and got[[0, 1, 2, 4]].abs().amax(-1).gt(0).all()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_group_attention_over_float16_is_the_float32_kernel_over_its_values(head_dim, threads) -> None:
    """A chunk of three items (shuffled pages, hidden slots) as mixed_layers' group attention reads it."""
    plan, cache = _group_case([37, 150, 5], 7, {}, 3, head_dim, seed=head_dim)
    (group,) = plan.groups
    half = cache.half()
    q = torch.randn(group.num_items * group.max_new, 9 * head_dim, generator=torch.Generator().manual_seed(1))

    got = torch.ops.l4m_cpu.group_attention(q, half, group.kv_index, group.mask, 9)
    widened = torch.ops.l4m_cpu.group_attention(q, half.float(), group.kv_index, group.mask, 9)
    assert torch.equal(got, widened)
    exact = torch.ops.l4m_cpu.group_attention(q, cache, group.kv_index, group.mask, 9)
    assert 0 < float((got - exact).abs().max()) < 1e-2  # the rounding is applied, and only it


def test_new_values_are_rounded_clamped_and_nan_kept_on_every_path(make_engine, prompts) -> None:
    """Layer 0's K/V depend only on the tokens and positions: fed the same tokens, a float16 engine stores
    exactly float16's rounding of what a float32 engine stores, through the torch path (a prefill alone),
    mixed_layers (a decode step beside a prefill) and decode_layers (decode steps alone)."""
    exact = make_engine(weights="quantized", page_size=16)
    half = make_engine(weights="quantized", page_size=16, kv_cache_dtype="float16")
    assert half.cache.layers[0].dtype == torch.float16 and half.cache.swap_layers[0].dtype == torch.float16
    assert exact.cache.layers[0].dtype == torch.float32
    tables = {e: PageTables(e) for e in (exact, half)}

    def run(items: list[tuple[str, list[int]]]) -> list[int]:
        tokens = []
        for e in (exact, half):
            results = e.forward_text([tables[e].item(name, feed) for name, feed in items])
            tokens.append([r.outputs[-1].token_id for r in results])
        return tokens[0]  # the float32 engine's: both are fed them

    before = engine_stats(half)
    first = run([("a", prompts[0])])
    second = run([("a", first), ("b", prompts[1])])
    third = run([("a", [second[0]]), ("b", [second[1]])])
    run([("a", [third[0]]), ("b", [third[1]])])
    after = engine_stats(half)
    assert after["num_mixed_kernel_batches"] == before["num_mixed_kernel_batches"] + 1
    assert after["num_decode_kernel_batches"] == before["num_decode_kernel_batches"] + 2
    pages = torch.tensor(tables[exact].pages["a"] + tables[exact].pages["b"])
    assert tables[half].pages["a"] + tables[half].pages["b"] == pages.tolist()
    stored, want = half.cache.layers[0][pages], exact.cache.layers[0][pages]
    assert want.abs().max() < FLOAT16_MAX
    assert torch.equal(stored, want.half())
    assert stored.any()

    # The torch path's writes: beyond float16's range clamped, NaN kept.
    values = torch.tensor([1e6, -1e6, float("nan"), 65519.0, 1.0 / 3])
    assert _kv_values(values, torch.float32) is values  # a float32 cache stores them as they are
    rounded = _kv_values(values, torch.float16)
    assert rounded.dtype == torch.float16
    assert rounded[[0, 1, 3]].tolist() == [65504.0, -65504.0, 65504.0] and rounded[2].isnan()
    assert rounded[4] == torch.tensor(1.0 / 3).half()


def test_the_kernels_clamp_what_float16_cannot_hold_and_keep_nan(make_engine) -> None:
    """decode_layers on one layer whose input norm is scaled by 1e6 (K/V far beyond 65504) and one row of
    NaN: the float16 cache holds the clamped float32 values, the NaN row's NaN."""
    engine = make_engine(weights="quantized", page_size=16)
    weights = list(engine.model._decode_weights[:14])  # layer 0: in_norm, qkv (qs, d, m), ...
    weights[0] = weights[0] * 1e6
    cfg = engine.model.config
    shape = (2, 2, 16, cfg.num_kv_heads, cfg.head_dim)
    hidden = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden[1] = float("nan")
    positions = torch.tensor([3, 5])
    caches = {}
    for dtype in (torch.float32, torch.float16):
        kv = torch.zeros(shape, dtype=dtype)
        torch.ops.l4m_cpu.decode_layers(
            hidden, engine.model.rope_cos[positions], engine.model.rope_sin[positions], weights, [kv],
            torch.tensor([[0], [1]]), positions + 1, torch.ones(2, 16, dtype=torch.uint8), cfg.num_heads,
            cfg.rms_norm_eps, None, False,
        )
        caches[dtype] = kv
    wide, half = caches[torch.float32], caches[torch.float16]
    row0 = wide[0, :, 3]  # item 0's K and V at slot 3 of page 0
    assert row0.abs().max() > 10 * FLOAT16_MAX
    assert torch.equal(half[0, :, 3], row0.clamp(-FLOAT16_MAX, FLOAT16_MAX).half())
    assert half[1, :, 5].isnan().all() and wide[1, :, 5].isnan().all()
    assert not half[0, :, 3].isnan().any()


# K and V rounded to float16 (11 significant bits) as they are stored, attention and everything else in float32:
# measured max |Δlogit| 0.011-0.025 from the float32 reference on these prompts (printed), against under 1e-3
# for the exact path and 0.27-0.65 for x in bf16, with no greedy flip. Bounds, teacher-forced on the engine's
# own tokens: every step where the float32 top-2 margin is at least KV16_MARGIN picks the float32 argmax, and
# max |Δlogit| < KV16_MAX_DIFF (4x the largest measured).
KV16_MARGIN = 0.1
KV16_MAX_DIFF = 0.1


@pytest.mark.parametrize("weights", ["quantized", "dequantized"])
def test_greedy_keeps_the_float32_argmax_wherever_its_margin_is_clear(make_engine, loaded, prompts, weights) -> None:
    """Quantized: five prompts prefilled together and decoded together (decode_layers), a sixth prefilled
    beside their first step (mixed_layers), then one stream alone. Dense weights: the torch path (its gathers
    widen the cache), three prompts."""
    engine = make_engine(weights=weights, page_size=16, max_quantized_rows=0, kv_cache_dtype="float16")
    assert engine_stats(engine)["kv_cache_dtype"] == "float16"
    run = RecordedRun(engine)
    quantized = weights == "quantized"
    names = [f"p{i}" for i in range(5 if quantized else 2)]
    last = f"p{len(names)}"

    run.run([(name, prompts[i]) for i, name in enumerate(names)])
    stats = engine_stats(engine)
    run.run([(name, run.last(name)) for name in names] + [(last, prompts[len(names)])])
    for _ in range(14 if quantized else 6):
        run.run([(name, run.last(name)) for name in [*names, last]])
    for _ in range(16 if quantized else 4):
        run.run([("p0", run.last("p0"))])
    if quantized:
        assert engine_stats(engine)["num_mixed_kernel_batches"] == stats["num_mixed_kernel_batches"] + 1
        assert engine_stats(engine)["num_decode_kernel_batches"] >= stats["num_decode_kernel_batches"] + 30
    failures = margin_rule_failures(run, loaded, prompts, [*names, last], KV16_MARGIN, KV16_MAX_DIFF,
                                    f"float16 KV ({weights})")
    assert not failures, f"a float16 KV cache outside its bounds on prompts {failures}"


@needs_bf16
def test_with_x_in_bf16_too_the_logits_keep_x_in_bf16s_bounds(make_engine, loaded, prompts, avx512) -> None:
    """Both opt-ins at once (the benchmarks' fastest engine): the roundings add up within x in bf16's own
    bounds, which are 10x the float16 cache's."""
    engine = make_engine(weights="quantized", page_size=16, max_quantized_rows=0, kv_cache_dtype="float16",
                         quantized_activations="bfloat16")
    assert engine.bf16_x and engine.cache.layers[0].dtype == torch.float16
    run = RecordedRun(engine)
    names = ["p0", "p1", "p2"]
    run.run([(name, prompts[i]) for i, name in enumerate(names)])
    for _ in range(12):
        run.run([(name, run.last(name)) for name in names])
    failures = margin_rule_failures(run, loaded, prompts, names, X_BF16_MARGIN, X_BF16_MAX_DIFF,
                                    "float16 KV and x in bf16")
    assert not failures, f"both opt-ins outside x in bf16's bounds on prompts {failures}"


def test_a_page_holds_half_the_bytes_so_the_same_memory_holds_twice_the_pages(loaded, monkeypatch) -> None:
    cfg = loaded.config
    wide = KvCache.bytes_per_page(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    assert KvCache.bytes_per_page(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.float16) * 2 == wide
    monkeypatch.setattr(engine_module, "_free_memory_bytes", lambda device: 400 * wide)  # sized from "free memory"
    sizes = {}
    for dtype in ("auto", "float16"):
        config = EngineConfig(page_size=16, num_pages=0, num_embed_slots=0, memory_fraction=0.25, kv_cache_dtype=dtype,
                              swap_space_pages=0)
        sizes[dtype] = engine_module.Engine(loaded, config).get_info().num_kv_pages
    assert sizes == {"auto": 100, "float16": 200}


def test_swap_out_and_in_of_a_float16_cache_is_bit_exact(make_engine, prompts) -> None:
    from l4m.executor.commands import Allocate, ResourceKind
    from tests.unit.executor.test_swap import _prefill, _swap

    engine = make_engine(page_size=4, num_pages=16, kv_cache_dtype="float16")
    engine.allocate([Allocate(ResourceKind.KV_PAGE, (0, 1, 2))])
    _prefill(engine, (0, 1, 2), prompts[2][:9])
    before = [layer[[0, 1, 2]].clone() for layer in engine.cache.layers]
    engine.execute(_swap("swap_out", [0, 1, 2], [5, 3, 9]))
    engine.execute(_swap("swap_in", [7, 11, 12], [5, 3, 9]))
    for layer, old in zip(engine.cache.layers, before, strict=True):
        assert layer.dtype == torch.float16 and torch.equal(layer[[7, 11, 12]], old) and old.any()


def test_the_setting_is_refused_where_it_cannot_run(make_engine) -> None:
    half = EngineConfig(kv_cache_dtype="float16")
    assert resolve_kv_cache_dtype(half, torch.float32) == torch.float16
    assert resolve_kv_cache_dtype(EngineConfig(), torch.float32) == torch.float32  # auto: the dtype's
    assert resolve_kv_cache_dtype(EngineConfig(device="cuda:0", dtype="bfloat16"), torch.bfloat16) == torch.bfloat16
    with pytest.raises(EngineConfigError, match="implemented for device cpu with dtype float32; this engine's are "
                       "cuda:0 and float32"):
        resolve_kv_cache_dtype(EngineConfig(device="cuda:0", kv_cache_dtype="float16"), torch.float32)
    with pytest.raises(EngineConfigError, match="this engine's are cpu and bfloat16"):
        make_engine(dtype="bfloat16", kv_cache_dtype="float16")
    with pytest.raises(EngineConfigError, match=r"kv_cache_dtype must be one of \('auto', 'float16'\), got 'fp8'"):
        make_engine(kv_cache_dtype="fp8")


def test_only_the_operator_sets_it_no_command_or_batch_names_it(make_engine) -> None:
    """Who may choose the cache's element type: whoever starts the executor (its flag). No L4M command,
    executor batch or debug query names it, so neither a controller nor the scheduler can switch it."""
    from l4m.executor.commands import DebugQuery
    from l4m.v1 import executor_pb2, l4m_pb2
    from tests.unit.executor.test_bf16_activations import _field_names

    engine = make_engine(weights="quantized")
    answer = engine.debug_query([DebugQuery("kv_cache_dtype:float16")])[0]
    assert answer.startswith("unknown query") and engine.cache.layers[0].dtype == torch.float32
    assert engine_stats(engine)["kv_cache_dtype"] == "float32"
    fields = _field_names([*l4m_pb2.DESCRIPTOR.message_types_by_name.values(),
                           *executor_pb2.DESCRIPTOR.message_types_by_name.values()])
    assert "kv_page_ids" in fields  # the walk reads the protocol's fields
    assert not [f for f in fields if "kv_cache" in f or "float16" in f or "kv_dtype" in f]


def test_the_kernels_refuse_a_cache_of_another_type_or_layers_that_differ() -> None:
    """Only the engine calls the ops, with caches it built; a bfloat16 cache, or layers of two types, is refused
    with the reason before anything is written."""
    q = torch.zeros(1, 9 * 64)
    table, ctx, visible = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), torch.ones(1, 16, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="kv: a cache of float32 or float16, got BFloat16"):
        torch.ops.l4m_cpu.decode_attention(q, torch.zeros(1, 2, 16, 3, 64, dtype=torch.bfloat16), table, ctx, visible, 9)
    float16, float32 = torch.zeros(1, 2, 16, 3, 64, dtype=torch.float16), torch.zeros(1, 2, 16, 3, 64)
    weights = [torch.zeros(1)] * 28  # never read: the caches are checked first
    with pytest.raises(RuntimeError, match="kv caches must be contiguous float32 or float16 alike"):
        torch.ops.l4m_cpu.decode_layers(torch.zeros(1, 576), torch.zeros(1, 64), torch.zeros(1, 64), weights,
                                        [float16, float32], table, ctx, visible, 9, 1e-5, None, False)
    assert not float16.any() and not float32.any()
