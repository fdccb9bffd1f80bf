"""GGUF blocks kept quantized: they decode to the dense weights, the kernel matches a dense matmul,
and the engine picks its weight mode as documented."""

from __future__ import annotations

import pytest
import torch

from l4m.executor.config import EngineConfig, resolve_weights
from l4m.executor.quant import BLOCK_SIZE, QuantizedTensor, kernels_available
from tests.unit.executor.conftest import cpu_only

pytestmark = cpu_only  # the GGUF-block kernels are a CPU path


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    rows, cols = q.shape
    d = q.d.repeat_interleave(BLOCK_SIZE, dim=1)
    if q.kind == "q8_0":
        return q.qs.float() * d
    nibbles = q.qs.view(rows, cols // BLOCK_SIZE, BLOCK_SIZE // 2)
    values = torch.cat((nibbles & 15, nibbles >> 4), dim=-1).reshape(rows, cols).float()
    return d * values + q.m.repeat_interleave(BLOCK_SIZE, dim=1)  # type: ignore[union-attr]


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


def test_weight_mode_resolution(loaded) -> None:
    quantized = "quantized" if kernels_available() else "dequantized"
    assert resolve_weights(EngineConfig(), loaded) == quantized
    assert resolve_weights(EngineConfig(dtype="bfloat16"), loaded) == "dequantized"
    assert resolve_weights(EngineConfig(weights="dequantized"), loaded) == "dequantized"
    with pytest.raises(ValueError, match="float32"):
        resolve_weights(EngineConfig(dtype="bfloat16", weights="quantized"), loaded)
    with pytest.raises(ValueError, match="weights must be"):
        resolve_weights(EngineConfig(weights="int3"), loaded)
