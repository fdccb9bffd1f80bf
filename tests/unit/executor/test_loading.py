"""Tokenizer, chat template, the safetensors loader and llama3 RoPE scaling."""

from __future__ import annotations

import json
import math

import jinja2
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from l4m.executor.commands import SamplerKind, SamplerSpec
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import llama3_freq_factors, load_model
from tests.unit.executor.conftest import TEST_DEVICE, LogitsRecorder, PageTables

# SmolLM2's vocabulary lacks the byte tokens of control characters and of UTF-8 lead bytes past
# plane 3 (as does its HF tokenizer), so those bytes cannot round-trip through any faithful build.
_TEXT = st.text(
    st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc")) | st.sampled_from(" \n\t\r"),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(text=_TEXT)
def test_tokenizer_round_trips_text(loaded, text: str) -> None:
    tok = loaded.tokenizer.tokenizer
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_known_ids_and_chat_template(loaded) -> None:
    tok = loaded.tokenizer.tokenizer
    assert tok.encode("12345").ids == [33, 34, 35, 36, 37]  # individual digits
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [1, 4093, 198, 6004, 2]
    text = jinja2.Template(loaded.tokenizer.chat_template).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(text).ids[:1] == [1]


def write_hf_dir(loaded, path) -> None:
    cfg = loaded.config
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_context,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": True,
        "_name_or_path": "smollm2-from-gguf",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(loaded.tokenizer.to_json())
    (path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": loaded.tokenizer.chat_template, "eos_token": "<|im_end|>"})
    )
    tensors = {k: v.contiguous() for k, v in loaded.tensors.items()}
    names = sorted(tensors)
    save_file(
        {k: tensors[k] for k in names[: len(names) // 2]}, str(path / "model-00001-of-00002.safetensors")
    )
    save_file(
        {k: tensors[k] for k in names[len(names) // 2 :]}, str(path / "model-00002-of-00002.safetensors")
    )


def test_safetensors_loader_matches_gguf_loader(loaded, prompts, tmp_path) -> None:
    write_hf_dir(loaded, tmp_path)
    from_hf = load_model(tmp_path)
    assert from_hf.config.num_layers == loaded.config.num_layers and from_hf.config.tie_word_embeddings
    assert from_hf.tokenizer.eos_token_ids == (2,) and from_hf.tokenizer.special_tokens["<|im_start|>"] == 1
    logits = []
    for model in (loaded, from_hf):
        config = EngineConfig(
            device=TEST_DEVICE, page_size=4, num_pages=16, num_embed_slots=0, weights="dequantized"
        )
        engine = Engine(model, config)  # dense for both: the loaders must agree bit for bit
        recorder = LogitsRecorder(engine)
        engine.forward_text(
            [PageTables(engine).item("a", prompts[0], sampler=SamplerSpec(SamplerKind.GREEDY))]
        )
        logits.append(recorder.calls[0])
    assert torch.equal(logits[0], logits[1])


def test_llama3_rope_scaling_factors() -> None:
    """Against the published llama3 rule, written out per frequency."""
    d, theta, factor, low, high, orig = 128, 500000.0, 8.0, 1.0, 4.0, 8192
    got = llama3_freq_factors(d, theta, factor, low, high, orig)
    for i in range(d // 2):
        freq = 1.0 / theta ** (2 * i / d)
        wavelen = 2 * math.pi / freq
        if wavelen < orig / high:
            new = freq
        elif wavelen > orig / low:
            new = freq / factor
        else:
            smooth = (orig / wavelen - low) / (high - low)
            new = (1 - smooth) * freq / factor + smooth * freq
        assert math.isclose(float(got[i]), freq / new, rel_tol=1e-5)
    assert float(got[0]) == 1.0 and float(got[-1]) == factor
