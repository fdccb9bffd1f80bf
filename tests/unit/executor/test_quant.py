"""GGUF blocks kept quantized: they decode to the dense weights, the kernel matches a dense matmul,
and the engine picks its weight mode as documented."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from l4m.executor.commands import Allocate, ForwardText, ResourceKind, SamplerKind, SamplerSpec
from l4m.executor.config import (
    AVX2_MAX_QUANTIZED_ROWS,
    EngineConfig,
    resolve_max_quantized_rows,
    resolve_weights,
)
from l4m.executor.engine import Engine
from l4m.executor.errors import InvalidCommand
from l4m.executor.quant import BLOCK_SIZE, HUGE_PAGE, QuantizedTensor, into_huge_pages, kernels_available
from tests.unit.executor.conftest import cpu_only, smaps_fields

pytestmark = cpu_only  # the GGUF-block kernels are a CPU path


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    rows, cols = q.shape
    d = q.d.float().repeat_interleave(BLOCK_SIZE, dim=1)
    if q.kind == "q8_0":
        return q.qs.float() * d
    nibbles = q.qs.view(rows, cols // BLOCK_SIZE, BLOCK_SIZE // 2)
    values = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(rows, cols).float()
    return d * values + q.m.float().repeat_interleave(BLOCK_SIZE, dim=1)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # rows un-permuted like the dense tensor
        "model.layers.7.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ],
)
def test_blocks_decode_to_the_dense_weights(loaded, name) -> None:
    q = loaded.quantized[name]
    assert q.kind == ("q8_0" if name.startswith("model.embed") else "q4_1")
    assert torch.equal(dequantize(q), loaded.tensors[name])


@pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 16, 65])
def test_kernel_matches_dense_matmul(loaded, num_rows) -> None:
    """Every row-tile shape (fused for <= 4 rows, buffered above), and weight row counts that leave tails."""
    torch.manual_seed(num_rows)
    for name, out_rows in (
        ("model.layers.3.mlp.down_proj.weight", 576),
        ("model.layers.3.mlp.down_proj.weight", 13),
        ("model.embed_tokens.weight", 49152),
        ("model.embed_tokens.weight", 7),
    ):
        q, dense = loaded.quantized[name], loaded.tensors[name][:out_rows]
        x = torch.randn(num_rows, dense.shape[1])
        m = None if q.m is None else q.m[:out_rows]
        got = torch.ops.l4m_cpu.linear(x, q.qs[:out_rows], q.d[:out_rows], m)
        want = x.double() @ dense.double().T
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")
def test_kernel_rejects_mismatched_shapes(loaded) -> None:
    q = loaded.quantized["model.layers.3.mlp.down_proj.weight"]  # Q4_1, K = 1536
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.l4m_cpu.linear(torch.randn(2, 1000), q.qs, q.d, q.m)
    with pytest.raises(RuntimeError, match="Q4_1 needs m"):
        torch.ops.l4m_cpu.linear(torch.randn(2, 1536), q.qs, q.d, None)
    with pytest.raises(RuntimeError, match="d: contiguous float16"):  # scales stay as the GGUF has them
        torch.ops.l4m_cpu.linear(torch.randn(2, 1536), q.qs, q.d.float(), q.m)
    with pytest.raises(RuntimeError, match="Q4_1 needs m shaped like d, float16"):
        torch.ops.l4m_cpu.linear(torch.randn(2, 1536), q.qs, q.d, q.m.float())  # type: ignore[union-attr]


def test_weight_mode_resolution(loaded) -> None:
    quantized = "quantized" if kernels_available() else "dequantized"
    assert resolve_weights(EngineConfig(), loaded) == quantized
    assert resolve_weights(EngineConfig(dtype="bfloat16"), loaded) == "dequantized"
    assert resolve_weights(EngineConfig(weights="dequantized"), loaded) == "dequantized"
    with pytest.raises(ValueError, match="float32"):
        resolve_weights(EngineConfig(dtype="bfloat16", weights="quantized"), loaded)
    with pytest.raises(ValueError, match="weights must be"):
        resolve_weights(EngineConfig(weights="int3"), loaded)


def test_auto_quantized_rows_follow_the_instruction_set() -> None:
    """Where the 4-bit linears have AVX-512 panels they beat dense float32 at any row count (prefill
    included); on AVX2 only up to 64 rows. An explicit count is kept; a negative one is refused."""
    auto = EngineConfig()
    assert auto.max_quantized_rows == 0
    assert resolve_max_quantized_rows(auto, "avx512") == auto.max_batch_tokens
    assert resolve_max_quantized_rows(auto, "avx512_bf16") == auto.max_batch_tokens
    assert resolve_max_quantized_rows(auto, "amx") == auto.max_batch_tokens
    assert resolve_max_quantized_rows(auto, "avx2") == AVX2_MAX_QUANTIZED_ROWS == 64
    assert resolve_max_quantized_rows(EngineConfig(max_quantized_rows=16), "avx512_bf16") == 16
    with pytest.raises(ValueError, match="max_quantized_rows must be 0 \\(auto\\) or more, got -1"):
        resolve_max_quantized_rows(EngineConfig(max_quantized_rows=-1), "avx2")


@pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")
def test_an_engine_resolves_auto_rows_for_the_selected_instruction_set(loaded) -> None:
    config = EngineConfig(num_pages=8, num_embed_slots=0, weights="quantized")
    before = torch.ops.l4m_cpu.isa()
    try:
        torch.ops.l4m_cpu.set_isa("avx2")
        assert Engine(loaded, config).max_quantized_rows == 64
        torch.ops.l4m_cpu.set_isa("auto")
        want = config.max_batch_tokens if torch.ops.l4m_cpu.isa() in ("avx512", "avx512_bf16", "amx") else 64
        engine = Engine(loaded, config)
        assert engine.max_quantized_rows == want
        # Blocks for every batch: the head keeps no dense copy and always multiplies with its blocks.
        assert engine.model.head.max_quantized_rows == (1 << 62 if want == config.max_batch_tokens else want)
        assert Engine(loaded, dataclasses.replace(config, weights="dequantized")).max_quantized_rows == 0
    finally:
        torch.ops.l4m_cpu.set_isa(before)


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address`."""
    return smaps_fields(address, "VmFlags:")


def test_weights_move_into_one_mapping_advised_for_huge_pages(loaded) -> None:
    names = ["model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"]
    weights = [loaded.quantized[n] for n in names]
    moved = into_huge_pages(weights)
    assert moved[0].qs.data_ptr() % HUGE_PAGE == 0  # the first block on a huge-page boundary
    parts = [t for w in moved for t in (w.qs, w.d, w.m) if t is not None]
    assert all(t.data_ptr() % 64 == 0 for t in parts)
    assert "hg" in mapping_flags(parts[0].data_ptr())  # MADV_HUGEPAGE (whether the kernel grants it is its own)
    assert len({tuple(mapping_flags(t.data_ptr())) for t in parts}) == 1
    assert moved[1].m is None and moved[1].kind == "q8_0"
    expected = [dequantize(w) for w in weights]
    del weights
    gc.collect()  # the views alone keep the mapping alive
    for w, want in zip(moved, expected, strict=True):
        assert torch.equal(dequantize(w), want)


@pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")
def test_the_quantized_model_decodes_from_huge_page_weights(make_engine) -> None:
    """Every block a decode step reads (each layer's four linears and the head) is in the one mapping;
    the engine keeps no second copy of the loaded blocks."""
    engine = make_engine(weights="quantized")
    model = engine.model
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    pointers = [t.data_ptr() for lin in [*linears, model.head] for t in (lin.quantized.qs, lin.quantized.d)]
    assert pointers == sorted(pointers) and pointers[-1] - pointers[0] < 512 << 20
    assert "hg" in mapping_flags(pointers[0]) and "hg" in mapping_flags(pointers[-1])
    assert engine.loaded.quantized == {}



@pytest.mark.skipif(not kernels_available(), reason="needs an AVX2 CPU and a C++ compiler")
def test_linears_keep_no_dense_copy_where_the_blocks_serve_every_batch(loaded, prompts) -> None:
    """With `max_quantized_rows` >= `max_batch_tokens` no call reads a linear's float32 weights, so none
    is kept (nor the loaded tensors); a full batch still runs, on the blocks, as an engine with them does."""
    config = EngineConfig(num_pages=64, num_embed_slots=0, weights="quantized", max_batch_tokens=48)
    lean = Engine(loaded, dataclasses.replace(config, max_quantized_rows=48))
    dense = Engine(loaded, dataclasses.replace(config, max_quantized_rows=47))
    assert not lean.dense_linears and dense.dense_linears
    model = lean.model
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(lin.dense is None and lin.quantized is not None for lin in [*linears, model.head])
    assert all(lin.dense is not None for lin in [dense.model.layers[0].qkv, dense.model.head])
    assert lean.loaded.tensors == {} and lean.loaded.config == loaded.config
    tokens = tuple((prompts[0] * 4)[:48])
    greedy = (SamplerSpec(SamplerKind.GREEDY),)
    outputs = []
    for engine in (lean, dense):  # 48 rows: the lean engine on the blocks, the other on dense weights
        engine.allocate([Allocate(ResourceKind.KV_PAGE, (0, 1, 2, 3))])
        item = ForwardText((0, 1, 2), 16, tokens, tuple(range(48)), (), tuple(range(48)), greedy * 48)
        outputs.append([o.token_id for o in engine.forward_text([item])[0].outputs])
    assert outputs[0] == outputs[1]
    with pytest.raises(InvalidCommand, match="more than max_batch_tokens=48"):
        lean.forward_text([ForwardText((0, 1, 2, 3), 1, (1,) * 49, tuple(range(49)), (), (48,), greedy)])
