"""The SDK renders real models' chat templates to the very text transformers' `apply_chat_template` gives.

The templates in chat_templates/ are the models' own text, byte for byte:
  llama-3.2-instruct.jinja        meta-llama/Llama-3.2-3B-Instruct: llama.cpp's copy of the Hub template,
                                  github.com/ggerganov/llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja
                                  (commit 7b5e0803c844).
  qwen2.5-instruct.jinja          Qwen/Qwen2.5-7B-Instruct: the "qwen2.5-instruct" chat_template of
                                  github.com/xorbitsai/inference xinference/model/llm/llm_family.json (commit
                                  7ecec16b6338), which copies tokenizer_config.json's.
  mistral-7b-instruct-v0.3.jinja  mistralai/Mistral-7B-Instruct-v0.3: "mistral-instruct-v0.3" in the same file, where
                                  xinference wrote the tokens in ('<s>', '</s>') and "\\n\\n" as two newlines; put
                                  back as bos_token / eos_token / "\\n\\n", as llama.cpp's tests/test-chat-template.cpp
                                  ("Mistral-Large-Instruct-2407 (mistralai 'v3' template)") and LM Studio's GGUF have it.
  phi-3-mini-4k-instruct.jinja    microsoft/Phi-3-mini-4k-instruct: "phi-3-mini-4k-instruct" in the same file, its
                                  '<|endoftext|>' put back as eos_token.

The tokenizers are small BPEs trained here with each model's special tokens: the rendered text does not
depend on the vocabulary. transformers is installed wherever the tests run (scripts/setup.sh installs the
`bench` extra), so nothing here is skipped.
"""

from __future__ import annotations

import datetime
import functools
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import l4m
from l4m.errors import ChatTemplateError
from l4m.fake import FakeL4M
from l4m.tokenizer import SMOLLM_DEFAULT_SYSTEM, Tokenizer, render_chatml

TEMPLATES = Path(__file__).parent / "chat_templates"
TRAINING_LINES = ["What is the weather in Paris today?", "Bonjour, ça va? 🙂", "def add(a, b): return a + b"]


@dataclass(frozen=True)
class ModelTemplate:
    file: str
    bos_token: str | None  # as the model's tokenizer_config names them (Qwen2.5 has no bos)
    eos_token: str
    special_tokens: tuple[str, ...]


MODELS = {
    "llama-3.2": ModelTemplate(
        "llama-3.2-instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
         "<|eot_id|>", "<|python_tag|>"),
    ),
    "qwen2.5": ModelTemplate(
        "qwen2.5-instruct.jinja", None, "<|im_end|>",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
    ),
    "mistral-v0.3": ModelTemplate(
        "mistral-7b-instruct-v0.3.jinja", "<s>", "</s>",
        ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"),
    ),
    "phi-3-mini": ModelTemplate(
        "phi-3-mini-4k-instruct.jinja", "<s>", "<|endoftext|>",
        ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
    ),
}


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


SYSTEM = _message("system", "You are terse.\nAnswer in one line.")
USER = _message("user", "  Bonjour, ça va? 🙂  ")  # templates differ on trimming: the texts must not
ASSISTANT = _message("assistant", "Oui, très bien.  ")
USER_2 = _message("user", "What is 2+2?")
CONVERSATIONS = {
    "user": [USER],
    "system, user": [SYSTEM, USER],
    "multi-turn": [SYSTEM, USER, ASSISTANT, USER_2],
    "multi-turn, no system": [USER, ASSISTANT, USER_2],
    "ends with the assistant": [USER, ASSISTANT],
    # OpenAI-style: a None field is left out, as transformers does (Llama's template tests 'tool_calls' in message).
    "None fields": [USER, {"role": "assistant", "content": "Oui.", "tool_calls": None}, USER_2],
}


def _train_bpe(special_tokens: tuple[str, ...]) -> HfTokenizer:
    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_LINES, trainer=trainer)
    return tokenizer


@functools.cache
def _tokenizers(name: str) -> tuple[Tokenizer, PreTrainedTokenizerFast]:
    """l4m's SDK tokenizer and transformers' over the same BPE, template and bos/eos."""
    model = MODELS[name]
    template = (TEMPLATES / model.file).read_text(encoding="utf-8")
    bpe = _train_bpe(model.special_tokens)
    variables = {"eos_token": model.eos_token} | ({"bos_token": model.bos_token} if model.bos_token else {})
    ours = Tokenizer(bpe.to_str(), template, {t: bpe.token_to_id(t) for t in model.special_tokens}, variables)
    theirs = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=model.bos_token, eos_token=model.eos_token)
    theirs.chat_template = template
    return ours, theirs


def _render_both(name: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                 tools: list[dict[str, Any]] | None = None, **variables: Any) -> tuple[str, str]:
    ours, theirs = _tokenizers(name)
    return (
        ours.apply_chat_template(messages, add_generation_prompt, tools, **variables),
        theirs.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **variables
        ),
    )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_conversations_render_as_transformers_renders_them(
    name: str, conversation: str, add_generation_prompt: bool
) -> None:
    # Llama 3's date line is today's unless given; a fixed date_string also checks that variables pass through.
    ours, theirs = _render_both(name, CONVERSATIONS[conversation], add_generation_prompt, date_string="26 Jul 2024")
    assert ours == theirs
    model = MODELS[name]
    if model.bos_token and "bos_token" in (TEMPLATES / model.file).read_text():
        assert ours.startswith(model.bos_token)


def test_the_template_reads_the_date_from_strftime_now() -> None:
    today = datetime.datetime.now().strftime("%d %b %Y")
    ours, theirs = _render_both("llama-3.2", [USER], True)
    if datetime.datetime.now().strftime("%d %b %Y") != today:
        pytest.skip("rendered across midnight")
    assert ours == theirs and f"Today Date: {today}\n" in ours


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Temperature in °C at a place < 100 km away & its sky",  # tojson must not escape these
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
TOOL_CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
TOOL_CONVERSATIONS = {
    "llama-3.2": [
        SYSTEM, USER_2,
        {"role": "assistant", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": '{"celsius": 21}'},
    ],
    "qwen2.5": [
        USER_2,
        {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL, TOOL_CALL]},  # None: dropped, as there
        {"role": "tool", "content": '{"celsius": 21}'},
        {"role": "tool", "content": '{"celsius": 22}'},
    ],
    "mistral-v0.3": [
        SYSTEM, USER_2,
        {"role": "assistant", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call12345", "content": '{"celsius": 21}'},
    ],
}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(TOOL_CONVERSATIONS))
def test_tools_and_tool_calls_render_as_transformers_renders_them(name: str, add_generation_prompt: bool) -> None:
    ours, theirs = _render_both(
        name, TOOL_CONVERSATIONS[name], add_generation_prompt, tools=[WEATHER_TOOL], date_string="26 Jul 2024"
    )
    assert ours == theirs and "get_weather" in ours and "Zürich" in ours and "< 100 km away &" in ours


ENVIRONMENT_TEMPLATES = {
    "loopcontrols": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "tojson": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
    "generation block": "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "variables": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}{{ extra }}",
    "trim and lstrip blocks": "  {% for m in messages %}\n  {{ m.role }}\n  {% endfor %}\n",
}


@pytest.mark.parametrize("template", list(ENVIRONMENT_TEMPLATES))
def test_the_environment_is_transformers(template: str) -> None:
    model = MODELS["mistral-v0.3"]
    bpe = _train_bpe(model.special_tokens)
    ours = Tokenizer(bpe.to_str(), ENVIRONMENT_TEMPLATES[template], None, {"bos_token": "<s>", "eos_token": "</s>"})
    theirs = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    messages = [_message("user", "<b>ça</b> & 'quotes'"), ASSISTANT]
    expected = theirs.apply_chat_template(
        messages, chat_template=ENVIRONMENT_TEMPLATES[template], tokenize=False, extra="!"
    )
    assert ours.apply_chat_template(messages, False, extra="!") == expected


def test_raise_exception_in_the_template_is_a_clear_error() -> None:
    ours, theirs = _tokenizers("mistral-v0.3")
    messages = [USER, _message("user", "again")]  # Mistral's template wants user and assistant to alternate
    with pytest.raises(jinja2.TemplateError, match="conversation roles must alternate"):
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ChatTemplateError, match="refused the conversation: After the optional system message, "
                                                "conversation roles must alternate"):
        ours.apply_chat_template(messages)


def test_a_template_that_does_not_compile_is_a_clear_error() -> None:
    bpe = _train_bpe(MODELS["qwen2.5"].special_tokens)
    tokenizer = Tokenizer(bpe.to_str(), "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"not valid Jinja \(line 2\)"):
        tokenizer.apply_chat_template([USER])


def test_a_controller_renders_with_the_models_variables_and_sees_template_errors(run, open_model) -> None:
    """ModelInfo carries the template and its variables to `ctx`; a refused conversation fails fill_chat."""
    model_template = MODELS["mistral-v0.3"]
    bpe = _train_bpe(model_template.special_tokens)
    fake = FakeL4M(
        tokenizer_json=bpe.to_str(), chat_template=(TEMPLATES / model_template.file).read_text(encoding="utf-8"),
        chat_template_variables={"bos_token": "<s>", "eos_token": "</s>"},
        special_token_ids={t: bpe.token_to_id(t) for t in model_template.special_tokens},
    )

    async def body() -> None:
        model = await open_model(fake)
        assert model.tokenizer.apply_chat_template([USER_2]) == "<s>[INST] What is 2+2?[/INST]"
        context = model.new_context()
        context.fill_chat([USER_2, ASSISTANT, USER_2])
        assert context.token_ids[0] == bpe.token_to_id("<s>")
        with pytest.raises(ChatTemplateError, match="must alternate"):
            context.fill_chat([USER_2, USER_2])

    run(body())


def test_without_jinja2_chatml_is_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)  # `import jinja2` now raises ImportError
    monkeypatch.delitem(sys.modules, "l4m.chat_template", raising=False)
    monkeypatch.delattr(l4m, "chat_template", raising=False)
    fake = FakeL4M()
    tokenizer = Tokenizer(fake.tokenizer_json, fake.chat_template)
    messages = CONVERSATIONS["multi-turn, no system"]
    assert tokenizer.apply_chat_template(messages) == render_chatml(messages, True, SMOLLM_DEFAULT_SYSTEM)


def test_importing_the_sdk_does_not_import_jinja2() -> None:
    # A controller that never renders a chat pays nothing for jinja2 (~20 ms at start-up).
    code = "import sys, l4m, l4m.context, l4m.model, l4m.tokenizer; print('jinja2' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
