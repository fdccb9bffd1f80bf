"""Every supported architecture against HF transformers on the same weights, from safetensors and GGUF,
and a refusal naming whatever the executor does not implement.

Each model is random-initialised and saved by transformers itself (`tiny_models.py`). The checks:
fp32 logits within 1e-4 of transformers' on a mixed batch (a long prompt past the sliding window, a
prompt with a custom BRLE mask, a decode step on an earlier prefill), and 32 greedy tokens identical,
one decode step per forward as a controller drives them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from l4m.executor.architectures import UnsupportedModel
from l4m.executor.commands import ForwardText, SamplerKind, SamplerSpec
from l4m.executor.decode_ops import TorchOps
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.weights import LoadedModel, load_model
from l4m.wire.brle import encode
from tests.unit.executor.conftest import ON_CPU, TEST_DEVICE, LogitsRecorder, PageTables
from tests.unit.executor.tiny_models import ARCHITECTURES, VOCAB, WINDOW, build_hf, write_gguf

TOLERANCE = 1e-4
GREEDY_STEPS = 32


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (HF directory, transformers model), built once per module (~1 s each)."""
    out = {}
    for name in ARCHITECTURES:
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, build_hf(name, path))
    return out


def _load(built, name: str, fmt: str, tmp_path: Path) -> LoadedModel:
    path, model = built[name]
    if fmt == "safetensors":
        return load_model(path)
    gguf_path = tmp_path / f"{name}.gguf"
    write_gguf(name, model, gguf_path, quant=fmt.removeprefix("gguf-").upper())
    return load_model(gguf_path)


def _engine(loaded: LoadedModel, **overrides) -> Engine:
    config = dict(device=TEST_DEVICE, page_size=4, num_pages=128, num_embed_slots=0, weights="dequantized")
    config.update(overrides)
    static_ops = config.pop("static_ops", None)
    return Engine(loaded, EngineConfig(**config), static_ops=static_ops)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {name: torch.randint(3, VOCAB, (n,), generator=g).tolist() for name, n in (("a", 40), ("b", 20), ("c", 9))}


def _custom_mask(n: int) -> tuple[list[bool], ...]:
    """Causal, except rows 10.. do not see slots 3..7 (a tree-search style hole)."""
    return tuple([j <= i and not (i >= 10 and 3 <= j < 8) for j in range(n)] for i in range(n))


def _hf_logits(model, tokens: list[int], allow: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' logits `[T, V]`; `allow` `[T, T]` replaces its mask (the window ANDed in by us)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        if allow is None:
            return model(ids).logits[0]
        window = getattr(model.config, "sliding_window", None)
        if window:
            i = torch.arange(len(tokens))
            allow = allow & (i[None, :] > i[:, None] - window)
        mask = torch.zeros(1, 1, *allow.shape).masked_fill(~allow, float("-inf"))
        return model(ids, attention_mask=mask).logits[0]


def _mixed_batch(engine: Engine, prompts: dict[str, list[int]]) -> list[torch.Tensor]:
    """Prefill c; then one batch: a (long), b (custom mask), c's next token. The logits of each item."""
    recorder = LogitsRecorder(engine)
    tables = PageTables(engine)
    engine.forward_text([tables.item("c", prompts["c"][:-1])])
    mask = tuple(encode(row[: i + 1]) for i, row in enumerate(_custom_mask(len(prompts["b"]))))
    engine.forward_text([
        tables.item("a", prompts["a"]),
        tables.item("b", prompts["b"], mask=mask),
        tables.item("c", prompts["c"][-1:]),
    ])
    out = recorder.calls[-1]
    na, nb = len(prompts["a"]), len(prompts["b"])
    return [out[:na], out[na : na + nb], out[na + nb :]]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf-f32"])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_logits_match_transformers_on_a_mixed_masked_batch(built, name, fmt, tmp_path) -> None:
    loaded = _load(built, name, fmt, tmp_path)
    family = {"llama3": "llama", "llama-bias": "llama", "qwen2-tied": "qwen2"}.get(name, name)
    # llama.cpp converts Mistral as a `llama` model (its window in `llama.attention.sliding_window`)
    assert loaded.config.architecture == ("llama" if (name, fmt) == ("mistral", "gguf-f32") else family)
    assert loaded.config.sliding_window == (WINDOW if name in ("mistral", "phi3") else 0)
    model = built[name][1]
    prompts = _prompts()
    got = _mixed_batch(_engine(loaded), prompts)
    nb = len(prompts["b"])
    want = [
        _hf_logits(model, prompts["a"]),
        _hf_logits(model, prompts["b"], torch.tensor(_custom_mask(nb))),
        _hf_logits(model, prompts["c"])[-1:],
    ]
    for item, (g, w) in zip("abc", zip(got, want, strict=True), strict=True):
        err = float((g - w).abs().max())
        assert err < TOLERANCE, f"{name} {fmt} item {item}: max |logit diff| {err:.2e}"


def _greedy(engine: Engine, prompt: list[int], steps: int) -> list[int]:
    tables, tokens = PageTables(engine), []
    feed = prompt
    for _ in range(steps):
        item = tables.item("s", feed, outputs=(len(feed) - 1,), sampler=SamplerSpec(SamplerKind.GREEDY))
        token = engine.forward_text([item])[0].outputs[0].token_id
        tokens.append(token)
        feed = [token]
    return tokens


def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_tokens_match_transformers(built, name) -> None:
    """32 decode steps, far past the window: the decode paths (and their window) against generate."""
    path, model = built[name]
    prompt = _prompts()["b"]
    want = _hf_greedy(model, prompt, GREEDY_STEPS)
    assert len(set(want)) > 4, "the random model should not repeat one token"
    assert _greedy(_engine(load_model(path)), prompt, GREEDY_STEPS) == want


@pytest.mark.skipif(not ON_CPU, reason="the static step on the CPU (TorchOps); on CUDA it is the default")
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_static_decode_step_honours_window_and_biases(built, name) -> None:
    """The CUDA-graph step's code (run eagerly with TorchOps) against transformers: the window moves
    with the on-device continuation loop, biases ride on the fused qkv."""
    path, model = built[name]
    prompt = _prompts()["b"]
    engine = _engine(load_model(path), static_ops=TorchOps, num_pages=64)
    assert engine.static_decoder is not None
    tables = PageTables(engine)
    pages, last = tables.grow("s", len(prompt) + GREEDY_STEPS - 1)  # room for the continuation too
    item = ForwardText(pages, last, tuple(prompt), tuple(range(len(prompt))), (), (len(prompt) - 1,),
                       (SamplerSpec(SamplerKind.GREEDY),), num_continuation_steps=GREEDY_STEPS - 1)
    outputs = engine.forward_text([item])[0].outputs
    assert [o.token_id for o in outputs] == _hf_greedy(model, prompt, GREEDY_STEPS)


@pytest.mark.skipif(not ON_CPU, reason="the GGUF-block kernels are CPU-only")
@pytest.mark.parametrize("name", ["mistral", "qwen2", "phi3"])
def test_quantized_paths_honour_window_and_biases(built, name, tmp_path) -> None:
    """Q8_0 blocks: the one-call C++ decode step (taken where the model has no biases) and the torch
    path over the same blocks give the same greedy tokens and close logits."""
    loaded = _load(built, name, "gguf-q8_0", tmp_path)
    assert loaded.quantized, "the Q8_0 weights should be kept as blocks"
    prompt = _prompts()["b"]
    runs = []
    for decode_kernel in (True, False):
        engine = _engine(loaded, weights="quantized", decode_kernel=decode_kernel)
        assert engine.model.has_decode_kernel == (name != "qwen2")  # the kernel has no bias terms
        recorder = LogitsRecorder(engine)
        runs.append((_greedy(engine, prompt, GREEDY_STEPS), torch.cat(recorder.calls[1:])))
    assert runs[0][0] == runs[1][0]
    assert float((runs[0][1] - runs[1][1]).abs().max()) < 1e-3


# Relative RMS error of a random Gaussian weight quantized to each type (a few times what it measures).
QUANT_ERROR = {"Q8_0": 0.01, "Q5_0": 0.06, "Q5_1": 0.06, "Q4_0": 0.12, "Q4_1": 0.12}


@pytest.mark.parametrize("quant", sorted(QUANT_ERROR))
def test_gguf_quantized_types_load_as_the_weights_they_quantize(built, quant, tmp_path) -> None:
    """Block types gguf-py can write load (dequantized; Q4_1 / Q8_0 also kept as blocks), every weight
    within its type's error of the float32 original, in HF row order (the llama Q/K permutation undone)."""
    name = "mistral"  # a `llama` GGUF: its Q/K rows come permuted
    loaded = _load(built, name, f"gguf-{quant.lower()}", tmp_path)
    originals = built[name][1].state_dict()
    for tensor_name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight"):
        full = f"model.layers.1.{tensor_name}"
        want, got = originals[full].float(), loaded.tensors[full]
        error = float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())
        assert error < QUANT_ERROR[quant], f"{quant} {tensor_name}: relative RMS error {error:.4f}"
    assert bool(loaded.quantized) == (quant in ("Q4_1", "Q8_0"))


# ---- refusals ------------------------------------------------------------------------------------


def _edit_config(path: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    for file in path.iterdir():
        (out / file.name).write_bytes(file.read_bytes())
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize(
    ("name", "changes", "named"),
    [
        ("llama", {"architectures": ["Gemma2ForCausalLM"]}, "'Gemma2ForCausalLM' is not implemented"),
        ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn'"),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1]}},
         "'mrope_section'"),
        ("llama", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1e4},
         "rope type 'dynamic'"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("llama", {"quantization_config": {"quant_method": "awq"}}, "'quantization_config'"),
        ("llama", {"sliding_window": 8}, "'sliding_window'"),
        ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
         "partial_rotary_factor 0.75"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
        ("qwen2", {"use_mrope": True}, "use_mrope"),
        ("qwen2", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "layer_types"),
        ("qwen2", {"layer_types": None, "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ("llama", {"tie_word_embeddings": False}, "no 'lm_head.weight'"),
    ],
)
def test_hf_config_fields_not_implemented_are_refused(built, tmp_path, name, changes, named) -> None:
    edited = _edit_config(built[name][0], tmp_path, **changes)
    with pytest.raises(UnsupportedModel, match=named.replace("(", r"\(").replace("[", r"\[")):
        load_model(edited)


def test_transformers4_qwen2_window_that_is_off_stays_off(built, tmp_path) -> None:
    """Qwen2.5's configs carry sliding_window with use_sliding_window false: no window."""
    edited = _edit_config(built["qwen2"][0], tmp_path, layer_types=None, use_sliding_window=False, sliding_window=8)
    assert load_model(edited).config.sliding_window == 0


def test_unknown_and_missing_tensors_are_refused(built, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = built["qwen2"][0]
    tensors = load_file(str(path / "model.safetensors"))
    extra = _edit_config(path, tmp_path)
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(64)}, str(extra / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="'model.layers.0.self_attn.q_norm.weight' is not implemented"):
        load_model(extra)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(missing, str(extra / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(extra)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"arch": "gemma2"}, "GGUF architecture 'gemma2' is not implemented"),
        ({"extra_keys": {"qwen2.expert_count": 8}}, "'qwen2.expert_count'"),
        ({"extra_keys": {"qwen2.attention.q_lora_rank": 4}}, "'qwen2.attention.q_lora_rank'"),
        ({"int8_tensors": ("blk.0.attn_v.weight",)}, "'blk.0.attn_v.weight' has type I8"),
        ({"tokenizer_model": "llama"}, "GGUF tokenizer model 'llama' is not implemented"),
    ],
)
def test_gguf_not_implemented_is_refused(built, tmp_path, edit, named) -> None:
    out = tmp_path / "edited.gguf"
    write_gguf("qwen2", built["qwen2"][1], out, **edit)
    with pytest.raises(UnsupportedModel, match=named):
        load_model(out)


# What llama.cpp itself (llama-cpp-python 0.3.36, `Llama(path, vocab_only=True).tokenize`) makes of
# PRE_TOKENIZED_TEXT with the tiny tokenizer under each `tokenizer.ggml.pre`, recorded once: the split
# decides which merges apply (digits alone, in threes, in runs), so a wrong pre-tokenizer differs here.
PRE_TOKENIZED_TEXT = "in 2024 it's 12345, x = 31415926\n\n\tdone"
LLAMA_CPP_TOKENS = {
    "qwen2": ["in", "Ġ", "2", "0", "2", "4", "Ġit", "'s", "Ġ", "1", "2", "3", "4", "5", ",", "Ġ", "x", "Ġ=", "Ġ", "3",
              "1", "4", "1", "5", "9", "2", "6", "ĊĊ", "ĉ", "done"],
    "llama-bpe": ["in", "Ġ", "2", "02", "4", "Ġit", "'s", "Ġ", "1", "23", "45", ",", "Ġ", "x", "Ġ=", "Ġ", "314", "15",
                  "9", "26", "ĊĊ", "ĉ", "done"],
    "smollm": ["in", "Ġ", "2", "0", "2", "4", "Ġit", "'s", "Ġ", "1", "2", "3", "4", "5", ",", "Ġ", "x", "Ġ=", "Ġ", "3",
               "1", "4", "1", "5", "9", "2", "6", "ĊĊ", "ĉ", "done"],
    "gpt-2": ["in", "Ġ2024", "Ġit", "'s", "Ġ12345", ",", "Ġ", "x", "Ġ=", "Ġ31415926", "ĊĊ", "ĉ", "done"],
}


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_TOKENS))
def test_gguf_pre_tokenizers_split_text_as_llama_cpp_does(built, pre, tmp_path) -> None:
    path = tmp_path / "model.gguf"
    write_gguf("qwen2", built["qwen2"][1], path, pre=pre)
    tokenizer = load_model(path).tokenizer.tokenizer
    assert tokenizer.encode(PRE_TOKENIZED_TEXT).tokens == LLAMA_CPP_TOKENS[pre]


@pytest.mark.parametrize(("pre", "named"), [("default", "pre-tokenizer 'default'"), ("deepseek-llm", "'deepseek-llm'")])
def test_gguf_pre_tokenizers_not_implemented_are_refused(built, pre, named, tmp_path) -> None:
    """llama.cpp's "default" (a GGUF naming none) splits otherwise than any implemented here."""
    path = tmp_path / "model.gguf"
    write_gguf("qwen2", built["qwen2"][1], path, pre=pre)
    with pytest.raises(UnsupportedModel, match=named):
        load_model(path)
