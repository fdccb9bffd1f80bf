"""GGUF blocks kept quantized: they decode to the dense weights, the kernel matches a dense matmul,
and the engine picks its weight mode as documented."""

from __future__ import annotations

import pytest
import torch

from l4m.executor.engine import EngineConfig, resolve_weights
from l4m.executor.quant import BLOCK_SIZE, QuantizedTensor, kernels_available


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
@pytest.mark.parametrize("num_rows", [1, 3, 16, 65])
def test_kernel_matches_dense_matmul(loaded, num_rows) -> None:
    torch.manual_seed(num_rows)
    for name in ("model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight"):
        q, dense = loaded.quantized[name], loaded.tensors[name]
        x = torch.randn(num_rows, dense.shape[1])
        if q.kind == "q4_1":
            got = torch.ops.l4m_quant.q4_1_linear(x, q.qs, q.d, q.m)
        else:
            got = torch.ops.l4m_quant.q8_0_linear(x, q.qs, q.d)
        want = x.double() @ dense.double().T
        assert (got.double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_weight_mode_resolution(loaded) -> None:
    quantized = "quantized" if kernels_available() else "dequantized"
    assert resolve_weights(EngineConfig(), loaded) == quantized
    assert resolve_weights(EngineConfig(dtype="bfloat16"), loaded) == "dequantized"
    assert resolve_weights(EngineConfig(weights="dequantized"), loaded) == "dequantized"
    with pytest.raises(ValueError, match="float32"):
        resolve_weights(EngineConfig(dtype="bfloat16", weights="quantized"), loaded)
    with pytest.raises(ValueError, match="weights must be"):
        resolve_weights(EngineConfig(weights="int3"), loaded)
