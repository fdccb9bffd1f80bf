"""x rounded to bf16 in the products with the GGUF blocks (`EngineConfig.quantized_activations =
"bfloat16"`, the executor's `--quantized-activations`; AVX-512 BF16 only).

The kernel's contract is exact: `linear(x, ..., bf16_x=True)` is bf16(x) times the blocks' values, to
float32's rounding of the sums, at every row count (the one-term dot products up to 4 rows of Q4_1 / 8 of
Q8_0, the 16-row panels of bf16 pairs above, blocks of 512 rows past that). The engine's logits then
move from the float32 reference by what rounding x costs, held to a margin rule as the bf16 dtype is.
The mode is refused, naming why, wherever it cannot run.
"""

from __future__ import annotations

import pytest
import torch

from l4m.executor.config import EngineConfig, EngineConfigError, resolve_bf16_x
from l4m.executor.quant import kernels_available
from tests.unit.executor.conftest import cpu_only, engine_stats
from tests.unit.executor.margins import RecordedRun, margin_rule_failures
from tests.unit.executor.test_q4_gemm import before_a_guard_page, dense, needs_bf16, random_blocks

pytestmark = [
    cpu_only,
    pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler"),
]

# The tiles (1-8 rows), the panels (5-512: one, two and odd numbers of 16-row panels, short last ones),
# and past 512 rows the blocks of rows (600: one block and a tail of 88).
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 600]


@needs_bf16
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n, k", [(37, 96), (24, 160), (61, 1184)])  # tile and chunk tails; odd block counts
def test_every_row_count_is_the_product_of_x_rounded_to_bf16(kind, n, k, threads, avx512) -> None:
    w = random_blocks(kind, n, k, seed=n + k)
    want_w = dense(*w)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = torch.ops.l4m_cpu.linear(x, *w, True).double()
        want = x.bfloat16().double() @ want_w.T
        exact = x.double() @ want_w.T
        assert got.shape == (m, n)
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), f"M = {m}: max error {err:.3g} from bf16(x) times the blocks"
        # ... and x really was rounded: float32's product is ~1e-3 away, where the exact path is 1e-7.
        assert (got - exact).abs().max().item() >= 1e-4 * exact.abs().max().item(), f"M = {m}: not rounded"


@needs_bf16
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [2, 3, 8, 16, 17, 40])
def test_a_non_finite_row_spoils_only_its_own_outputs(kind, m, threads, avx512) -> None:
    """A panel holds 16 rows of x in one register, and their block sums: a NaN / inf row stays in its lanes."""
    w = random_blocks(kind, 29, 96, seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(0))
    x[m // 2, 5] = float("nan")
    x[m - 1, 0] = float("inf")
    got = torch.ops.l4m_cpu.linear(x, *w, True)
    assert got[m // 2].isnan().all()
    assert not got[m - 1].isfinite().any()
    clean = [i for i in range(m) if i not in {m // 2, m - 1}]
    want = x[clean].bfloat16().double() @ dense(*w).T
    assert got[clean].isfinite().all()
    assert (got[clean].double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_bf16
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_reading_ahead_and_masked_scale_loads_stop_at_the_weights_end(kind, threads, avx512) -> None:
    """Both paths ask for weight rows ahead of use, and the panels load a row's float16 scales 16 at a time
    with the lanes past its end masked off: past the last row those must stay prefetches and masked lanes,
    which never fault. Each array here ends where an unreadable page starts."""
    keep: list = []
    w = tuple(None if t is None else before_a_guard_page(t, keep) for t in random_blocks(kind, 40, 576, seed=3))
    for m in (1, 2, 5, 16, 33):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        want = x.bfloat16().double() @ dense(*w).T
        assert (torch.ops.l4m_cpu.linear(x, *w, True).double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_kernel_refuses_x_in_bf16_on_the_avx2_code() -> None:
    """On any CPU: under avx2 the op says what it needs, for every row count, none computed."""
    w = random_blocks("q4_1", 24, 64, seed=0)
    before = torch.ops.l4m_cpu.isa()
    torch.ops.l4m_cpu.set_isa("avx2")
    try:
        for m in (0, 1, 16):
            with pytest.raises(RuntimeError, match="needs the CPU kernels' avx512_bf16 instruction set; they run avx2"):
                torch.ops.l4m_cpu.linear(torch.randn(m, 64), *w, True)
        assert torch.ops.l4m_cpu.linear(torch.randn(2, 64), *w).shape == (2, 24)  # the default still runs
    finally:
        torch.ops.l4m_cpu.set_isa(before)


def test_the_setting_is_refused_where_it_cannot_run() -> None:
    bf16 = EngineConfig(quantized_activations="bfloat16")
    assert resolve_bf16_x(bf16, "quantized", "avx512_bf16") is True
    assert resolve_bf16_x(EngineConfig(), "dequantized", "") is False  # the default asks for nothing
    with pytest.raises(EngineConfigError, match="needs quantized weights .* this engine's weights are dequantized"):
        resolve_bf16_x(bf16, "dequantized", "")
    with pytest.raises(EngineConfigError, match="needs the CPU kernels' avx512_bf16 instruction set; they run avx2"):
        resolve_bf16_x(bf16, "quantized", "avx2")
    with pytest.raises(EngineConfigError, match=r"quantized_activations must be one of \('float32', 'bfloat16'\), "
                       "got 'int8'"):
        resolve_bf16_x(EngineConfig(quantized_activations="int8"), "quantized", "avx512_bf16")


def test_an_engine_on_dense_weights_refuses_it(make_engine) -> None:
    with pytest.raises(EngineConfigError, match="needs quantized weights"):
        make_engine(weights="dequantized", quantized_activations="bfloat16")


def test_an_engine_on_the_avx2_code_refuses_it(make_engine) -> None:
    before = torch.ops.l4m_cpu.isa()
    torch.ops.l4m_cpu.set_isa("avx2")
    try:
        with pytest.raises(EngineConfigError, match="they run avx2"):
            make_engine(weights="quantized", quantized_activations="bfloat16")
    finally:
        torch.ops.l4m_cpu.set_isa(before)


# Rounding x to bf16 before each of the 4-bit products (the residual stream, norms, attention and KV stay
# float32) moved the logits by 0.27-0.65 from the float32 reference on these prompts (printed; the exact
# path: under 1e-3), about what the bf16 dtype costs (~0.5), with no greedy flip. The bounds are the bf16
# dtype's (test_forward.py): teacher-forced on the engine's own tokens, every step where the float32 top-2
# margin is at least X_BF16_MARGIN must pick the float32 argmax.
X_BF16_MARGIN = 0.25
X_BF16_MAX_DIFF = 1.0


@needs_bf16
def test_greedy_keeps_the_float32_argmax_wherever_its_margin_is_clear(make_engine, loaded, prompts, avx512) -> None:
    """Five prompts prefilled in one batch and decoded together (the 16-row panels), a sixth prefilled beside
    their first step (the mixed kernel), then one stream alone (the one-term tiles)."""
    engine = make_engine(weights="quantized", quantized_activations="bfloat16", page_size=16, max_quantized_rows=0)
    assert engine.bf16_x and engine_stats(engine)["quantized_activations"] == "bfloat16"
    run = RecordedRun(engine)
    names = [f"p{i}" for i in range(5)]

    run.run([(name, prompts[i]) for i, name in enumerate(names)])
    stats = engine_stats(engine)
    run.run([(name, run.last(name)) for name in names] + [("p5", prompts[5])])
    assert engine_stats(engine)["num_mixed_kernel_batches"] == stats["num_mixed_kernel_batches"] + 1
    for _ in range(14):
        run.run([(name, run.last(name)) for name in [*names, "p5"]])
    for _ in range(16):
        run.run([("p0", run.last("p0"))])
    assert engine_stats(engine)["num_decode_kernel_batches"] >= stats["num_decode_kernel_batches"] + 30
    failures = margin_rule_failures(run, loaded, prompts, [*names, "p5"], X_BF16_MARGIN, X_BF16_MAX_DIFF, "x in bf16")
    assert not failures, f"x in bf16 outside its bounds on prompts {failures}"


def _field_names(messages) -> set[str]:  # type: ignore[no-untyped-def]
    names: set[str] = set()
    for message in messages:
        names |= set(message.fields_by_name) | _field_names(message.nested_types)
    return names


def test_only_the_operator_sets_it_no_command_or_batch_names_it(make_engine) -> None:
    """Who may choose the precision: whoever starts the executor (its flag). No L4M command, executor
    batch or debug query names it, so neither a controller nor the scheduler can switch an engine."""
    from l4m.executor.commands import DebugQuery
    from l4m.v1 import executor_pb2, l4m_pb2

    engine = make_engine(weights="quantized")
    answer = engine.debug_query([DebugQuery("quantized_activations:bfloat16")])[0]
    assert answer.startswith("unknown query") and not engine.bf16_x and not engine.model.bf16_x
    assert engine_stats(engine)["quantized_activations"] == "float32"
    fields = _field_names([*l4m_pb2.DESCRIPTOR.message_types_by_name.values(),
                           *executor_pb2.DESCRIPTOR.message_types_by_name.values()])
    assert "kv_page_ids" in fields  # the walk reads the protocol's fields
    assert not [f for f in fields if "activation" in f or "bf16" in f or "precision" in f]
