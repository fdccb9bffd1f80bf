"""Small random-initialised models of each supported architecture, built and saved by HF transformers
itself (its config and model classes), and their GGUF twins written with the `gguf` package as
llama.cpp's converter lays them out. Nothing is downloaded: the tests build what they load.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 2048
# A realistic head layout at a small width: GQA 2:1, head_dim 64 (the CPU decode kernel's size).
COMMON = dict(
    vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
    # Wider than HF's 0.02 so that random logits have clear winners: greedy tokens compare meaningfully.
    initializer_range=0.15,
)
WINDOW = 16


def hf_config(name: str):
    """transformers' own config object for architecture variant `name`."""
    import transformers as T

    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    if name == "llama":
        return T.LlamaConfig(**COMMON, **special, tie_word_embeddings=True)
    if name == "llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return T.LlamaConfig(**COMMON, **special, rope_parameters=scaling)
    if name == "llama-bias":
        return T.LlamaConfig(**COMMON, **special, attention_bias=True, mlp_bias=True)
    if name == "qwen2":
        return T.Qwen2Config(**COMMON, **special, tie_word_embeddings=False)
    if name == "qwen2-tied":
        return T.Qwen2Config(**COMMON, **special, tie_word_embeddings=True)
    if name == "mistral":
        return T.MistralConfig(**COMMON, **special, sliding_window=WINDOW)
    if name == "phi3":
        return T.Phi3Config(**COMMON, **special, sliding_window=WINDOW)
    raise ValueError(name)


ARCHITECTURES = ("llama", "llama3", "llama-bias", "qwen2", "qwen2-tied", "mistral", "phi3")


def tiny_tokenizer():
    """A byte-level BPE over VOCAB ids, trained on a few lines (ids above what it learns stay unused)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    # Numbers and contractions, so that merges cross what each pre-tokenizer splits (digits one by one,
    # in threes, or in runs; "'s" apart or not): a wrong pre-tokenizer then encodes differently.
    lines = ["the quick brown fox jumps over the lazy dog", "def fibonacci(n): return n", "hello world",
             "in 2024 it's 12345 and 678, it'll be 1000000 don't", "x = 31415926 + 27182818\n\n\tdone"] * 20
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def build_hf(name: str, path: Path, seed: int = 0):
    """Saves a random-initialised model of variant `name` to `path`; returns the model (eager, eval)."""
    import transformers as T

    torch.manual_seed(seed)
    config = hf_config(name)
    config._attn_implementation = "eager"
    model = T.AutoModelForCausalLM.from_config(config).eval()
    if "bias" in name or name.startswith("qwen2"):
        with torch.no_grad():  # HF initialises biases to zero: make them count
            for param_name, param in model.named_parameters():
                if param_name.endswith(".bias"):
                    param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer()
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return model


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for `llama` models (pairs interleaved within each head)."""
    rest = w.shape[1:]
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def write_gguf(
    name: str,
    model,
    path: Path,
    quant: str = "F32",
    arch: str | None = None,
    extra_keys: dict[str, int] | None = None,
    int8_tensors: tuple[str, ...] = (),
    pre: str = "gpt-2",
    tokenizer_model: str = "gpt2",
) -> None:
    """`model` (from `build_hf`) as llama.cpp lays it out: Mistral as `llama` with its window; 2-D
    weights of the layers in `quant` (F32, Q8_0, Q4_1, Q4_0, Q5_0, ...), the rest F32. For refusal
    tests: another `arch` name, `extra_keys` (uint32 metadata), tensors stored as I8; `pre` is the
    tokenizer's `tokenizer.ggml.pre`, `tokenizer_model` its `tokenizer.ggml.model`."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    cfg = model.config
    arch = arch or {"qwen2": "qwen2", "qwen2-tied": "qwen2", "phi3": "phi3"}.get(name, "llama")
    writer = GGUFWriter(str(path), arch)
    for key, value in (extra_keys or {}).items():
        writer.add_uint32(key, value)
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    tokenizer = json.loads(tiny_tokenizer().to_str())
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<unused{i}>" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if name == "llama3":
        import transformers

        init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
        scaled, _ = init(cfg, "cpu")
        base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    for hf_name, array in state.items():
        if hf_name.startswith("model.layers."):
            _, _, index, *rest = hf_name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            gguf_name = f"blk.{index}.{_GGUF_LAYER[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = _permute(array, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = _permute(array, cfg.num_key_value_heads)
        else:
            gguf_name = _GGUF_GLOBAL[hf_name]
        array = np.ascontiguousarray(array, dtype=np.float32)
        if gguf_name in int8_tensors:
            writer.add_tensor(gguf_name, np.zeros(array.shape, dtype=np.int8))
        elif quant != "F32" and array.ndim == 2 and hf_name.startswith("model.layers."):
            kind = GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name, quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
