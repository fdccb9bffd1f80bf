"""The chat template, its bos/eos variables and the stop ids, read from a checkpoint as transformers writes
it and from GGUF metadata; and what GetInfo sends of them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

from l4m.executor.convert import info_to_pb
from l4m.executor.gguf_file import read_gguf
from l4m.executor.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir
from l4m.executor.weights import LoadedModel

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
TEMPLATE = (Path(__file__).parents[1] / "sdk" / "chat_templates" / "llama-3.2-instruct.jinja").read_text()


def _bpe(special_tokens: tuple[str, ...]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["hello world", "the weather today"], trainer=trainer)
    return tokenizer


def test_a_checkpoint_saved_by_transformers_5(tmp_path: Path) -> None:
    """Llama 3 instruct's layout: the template in chat_template.jinja, eos <|eot_id|> in tokenizer_config,
    three eos ids in generation_config.json and <|end_of_text|> in config.json."""
    bpe = _bpe(LLAMA3_SPECIAL)
    ids = {t: bpe.token_to_id(t) for t in LLAMA3_SPECIAL}
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    eos_ids = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    GenerationConfig(bos_token_id=ids["<|begin_of_text|>"], eos_token_id=eos_ids).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": ids["<|end_of_text|>"]}))

    bundle = tokenizer_from_hf_dir(tmp_path)
    assert bundle.chat_template == TEMPLATE
    assert bundle.chat_template_variables() == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert bundle.eos_token_ids == tuple(sorted(eos_ids))


@pytest.mark.parametrize(
    "tokenizer_config",
    [
        # transformers 4: the template in tokenizer_config, tokens as AddedToken dicts
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>", "special": True}, "eos_token": {"content": "</s>"}},
        # named templates: the "default" one is used
        {"chat_template": [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": TEMPLATE}],
         "bos_token": "<s>", "eos_token": "</s>"},
    ],
    ids=["string template, AddedToken dicts", "named templates"],
)
def test_tokenizer_config_templates_and_tokens(tmp_path: Path, tokenizer_config: dict) -> None:
    bpe = _bpe(("<s>", "</s>", "[INST]"))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": bpe.token_to_id("[INST]")}))
    bundle = tokenizer_from_hf_dir(tmp_path)
    assert bundle.chat_template == TEMPLATE
    assert (bundle.bos_token, bundle.eos_token) == ("<s>", "</s>")
    assert bundle.eos_token_ids == tuple(sorted([bpe.token_to_id("</s>"), bpe.token_to_id("[INST]")]))


def test_a_gguf_with_end_of_turn_and_end_of_message_ids(tmp_path: Path) -> None:
    tokens = [*LLAMA3_SPECIAL, *pre_tokenizers.ByteLevel.alphabet()]
    control = gguf.TokenType.CONTROL
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([control] * len(LLAMA3_SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 4))
    writer.add_token_merges([])
    writer.add_bos_token_id(0)  # <|begin_of_text|>
    writer.add_eos_token_id(1)  # <|end_of_text|>
    writer.add_eom_token_id(2)  # <|eom_id|>
    writer.add_eot_token_id(3)  # <|eot_id|>
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    bundle = tokenizer_from_gguf(read_gguf(tmp_path / "tiny.gguf").fields)
    assert bundle.chat_template == TEMPLATE
    assert bundle.chat_template_variables() == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    assert bundle.eos_token_ids == (1, 2, 3)


def test_the_default_model_keeps_its_stop_token_and_sends_its_variables(loaded: LoadedModel, make_engine) -> None:
    bundle = loaded.tokenizer
    assert bundle.eos_token_ids == (2,)  # <|im_end|>, SmolLM2's eos
    assert bundle.chat_template_variables() == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    model = info_to_pb(make_engine().get_info()).model
    assert dict(model.chat_template_variables) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
