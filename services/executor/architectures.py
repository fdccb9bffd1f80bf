"""Which models the executor implements, read from their configs, and a refusal for everything else.

One decoder serves four architectures: the Llama block (RMSNorm, RoPE, GQA, SwiGLU, tied or untied
head) and what each one adds to it:

| architecture | HF class             | GGUF arch | adds                                                        |
|--------------|----------------------|-----------|-------------------------------------------------------------|
| llama        | LlamaForCausalLM     | llama     | rope scaling llama3 / linear, optional q/k/v/o and MLP biases |
| qwen2        | Qwen2ForCausalLM     | qwen2     | q/k/v biases                                                |
| mistral      | MistralForCausalLM   | llama     | a sliding attention window on every layer                   |
| phi3         | Phi3ForCausalLM      | phi3      | fused qkv and gate_up weights, a sliding window             |

A model is served only when every field of its config and every tensor of its checkpoint is one the
executor understands: a field that changes the math (an unknown rope type, `use_mrope`, a partial
rotary factor, a window on some layers only, a quantization config) or a tensor it has no use for
(Qwen3's q_norm, a vision tower) raises `UnsupportedModel` naming it, at load. Fields listed in
`_INERT_KEYS` do not change inference (training dropout, dtype of the file, bookkeeping).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# HF `architectures[0]` -> our name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
}
GGUF_ARCHITECTURES = ("llama", "qwen2", "phi3")
ROPE_TYPES = ("default", "linear", "llama3")

# Config fields that do not change what inference computes.
_INERT_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "attention_dropout", "embd_pdrop", "resid_pdrop", "pretraining_tp",
    "bos_token_id", "eos_token_id", "pad_token_id", "auto_map", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "max_position_embeddings",
    # phi3: only its longrope scaling (refused) reads it
    "original_max_position_embeddings",
})
_COMMON_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "tie_word_embeddings",
    # the biases themselves come with the tensors (any of q/k/v/o and the MLP's may have one)
    "attention_bias", "mlp_bias",
})
_KEYS_BY_ARCH = {
    "llama": frozenset(),
    "qwen2": frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "use_mrope"}),
    "mistral": frozenset({"sliding_window", "layer_types"}),
    "phi3": frozenset({"sliding_window"}),
}
_ROPE_KEYS = frozenset({
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "partial_rotary_factor",
})


class UnsupportedModel(ValueError):
    """A model, config field or tensor the executor does not implement (refused at load, never served)."""


@dataclass(frozen=True)
class RopeScaling:
    """How the inverse RoPE frequencies are scaled: `kind` "linear" or "llama3" (with its numbers)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of a model of one of the `architecture`s above."""

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
    architecture: str = "llama"
    # Every layer attends only to the last `sliding_window` KV slots of its item, its own included
    # (HF's `kv_idx > q_idx - sliding_window`, counted in cache slots); 0 = the whole context.
    sliding_window: int = 0


def architecture_from_hf(raw: Mapping[str, object]) -> str:
    names = raw.get("architectures") or []
    if not isinstance(names, list) or len(names) != 1:
        raise UnsupportedModel(f"config.json: architectures {names!r} must name exactly one model class; "
                               f"supported: {', '.join(HF_ARCHITECTURES)}")
    if names[0] not in HF_ARCHITECTURES:
        raise UnsupportedModel(f"architecture {names[0]!r} is not implemented; supported: "
                               f"{', '.join(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[names[0]]


def rope_from_hf(raw: Mapping[str, object]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is None:
        params = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 10000.0)}
    if not isinstance(params, Mapping):
        raise UnsupportedModel(f"rope parameters {params!r} are not a mapping")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise UnsupportedModel(f"rope parameter {unknown[0]!r} is not implemented")
    rotary = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if rotary != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {rotary} is not implemented (only 1.0)")
    theta = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise UnsupportedModel(f"rope type {kind!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    return theta, RopeScaling(
        "llama3",
        float(params["factor"]),
        float(params.get("low_freq_factor", 1.0)),
        float(params.get("high_freq_factor", 4.0)),
        int(params.get("original_max_position_embeddings", 8192)),
    )


def _window_from_hf(arch: str, raw: Mapping[str, object], num_layers: int) -> int:
    """The sliding window every layer uses (0: none); a window on only some layers is refused."""
    window = raw.get("sliding_window")
    if arch == "qwen2" and "layer_types" not in raw and raw.get("use_sliding_window"):
        raise UnsupportedModel("qwen2 use_sliding_window=true is not implemented (a window on some layers)")
    if arch == "qwen2" and "layer_types" not in raw:
        return 0  # transformers 4's Qwen2: sliding_window is ignored unless use_sliding_window
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        kinds = set(layer_types)  # type: ignore[arg-type]
        if len(layer_types) != num_layers or not kinds <= {"full_attention", "sliding_attention"}:  # type: ignore[arg-type]
            raise UnsupportedModel(f"layer_types {layer_types!r} is not implemented")
        if len(kinds) > 1:
            raise UnsupportedModel("layer_types mixing full and sliding attention is not implemented")
        if kinds == {"full_attention"}:
            return 0
    if window is None:
        return 0
    if int(window) < 1:  # type: ignore[call-overload]
        raise UnsupportedModel(f"sliding_window {window!r} must be >= 1")
    return int(window)  # type: ignore[call-overload]


def config_from_hf(raw: Mapping[str, object], name: str) -> tuple[ModelConfig, RopeScaling | None]:
    """The model's config from an HF `config.json`, refusing what the executor does not implement."""
    arch = architecture_from_hf(raw)
    known = _INERT_KEYS | _COMMON_KEYS | _KEYS_BY_ARCH[arch]
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        raise UnsupportedModel(f"{arch} config field {unknown[0]!r} (= {raw[unknown[0]]!r}) is not implemented")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not implemented (only silu)")
    if raw.get("use_mrope"):
        raise UnsupportedModel("use_mrope=true (multimodal RoPE) is not implemented")
    num_heads = int(raw["num_attention_heads"])  # type: ignore[call-overload]
    hidden = int(raw["hidden_size"])  # type: ignore[call-overload]
    num_layers = int(raw["num_hidden_layers"])  # type: ignore[call-overload]
    theta, scaling = rope_from_hf(raw)
    config = ModelConfig(
        name=name,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),  # type: ignore[call-overload]
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),  # type: ignore[call-overload]
        head_dim=int(raw.get("head_dim") or hidden // num_heads),  # type: ignore[call-overload]
        vocab_size=int(raw["vocab_size"]),  # type: ignore[call-overload]
        max_context=int(raw.get("max_position_embeddings") or 4096),  # type: ignore[call-overload]
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),  # type: ignore[arg-type]
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=arch,
        sliding_window=_window_from_hf(arch, raw, num_layers),
    )
    return config, scaling


# GGUF metadata under `<arch>.`: those read, and those that do not change inference.
_GGUF_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "vocab_size", "attention.sliding_window",
})


def check_gguf_keys(arch: str, values: Mapping[str, object]) -> None:
    """Refuses a GGUF whose architecture or `<arch>.*` metadata (`values`: key -> value) the executor does
    not implement."""
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModel(f"GGUF architecture {arch!r} is not implemented; supported: "
                               f"{', '.join(GGUF_ARCHITECTURES)}")
    prefix = arch + "."
    for key in sorted(values):
        if key.startswith(prefix) and key[len(prefix):] not in _GGUF_KEYS:
            if key.endswith(".expert_count") and not values.get(key):
                continue  # an explicit "no experts"
            raise UnsupportedModel(f"GGUF metadata {key!r} (= {values.get(key)!r}) is not implemented")
    scaling = values.get(prefix + "rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise UnsupportedModel(f"GGUF rope scaling {scaling!r} is not implemented (none or linear)")


# Every tensor the decoder reads, in HF names; `{i}` is a layer.
_LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
_LAYER_BIASES = (
    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias",
    "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias",
)
_GLOBAL_TENSORS = ("model.embed_tokens.weight", "model.norm.weight")
_OPTIONAL_GLOBALS = ("lm_head.weight", "rope_freq_factors")
# Buffers some checkpoints carry that the decoder recomputes.
_IGNORED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def check_tensors(config: ModelConfig, names: Iterable[str]) -> list[str]:
    """Refuses a checkpoint with a tensor the decoder does not read or without one it needs; returns
    the names to drop (buffers it recomputes)."""
    names = set(names)
    layer_names = {f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in _LAYER_TENSORS}
    required = layer_names | set(_GLOBAL_TENSORS)
    missing = sorted(required - names)
    if missing:
        raise UnsupportedModel(f"the checkpoint lacks tensor {missing[0]!r} ({len(missing)} missing)")
    allowed = required | set(_OPTIONAL_GLOBALS) | {
        f"model.layers.{i}.{n}" for i in range(config.num_layers) for n in _LAYER_BIASES
    }
    ignored = sorted(n for n in names if _IGNORED_TENSOR.fullmatch(n))
    unknown = sorted(names - allowed - set(ignored))
    if unknown:
        raise UnsupportedModel(f"tensor {unknown[0]!r} is not implemented by the {config.architecture} decoder"
                               + (f" ({len(unknown)} such tensors)" if len(unknown) > 1 else ""))
    return ignored
