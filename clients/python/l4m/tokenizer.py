"""The model's tokenizer as a controller uses it: encode/decode, streaming decode, chat template.

Built from `ModelInfo.tokenizer_json` with `tokenizers`. The chat template is rendered as transformers'
`apply_chat_template` renders it (`l4m.chat_template`, jinja2, imported on first use), with the model's
`chat_template_variables` (bos_token, eos_token). Without jinja2 a ChatML renderer is used, which
produces the same text as SmolLM2's template (the default model) and any other plain ChatML template.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

Message = Mapping[str, object]  # {"role": ..., "content": ...}, and whatever else the template reads

# SmolLM2's template adds this system turn when the conversation has none.
SMOLLM_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str = "",
        special_token_ids: Mapping[str, int] | None = None,
        chat_template_variables: Mapping[str, str] | None = None,
    ) -> None:
        from tokenizers import Tokenizer as HfTokenizer  # lazily: ~10 ms a controller pays only when it loads

        self._tokenizer = HfTokenizer.from_str(tokenizer_json)
        self.tokenizer_json = tokenizer_json
        self.chat_template = chat_template
        self.special_token_ids = dict(special_token_ids or {})
        self.chat_template_variables = dict(chat_template_variables or {})  # e.g. {"bos_token": "<s>"}
        self._jinja_template: object | None = None  # compiled on first use: jinja2's import is ~20 ms
        self._is_jinja_compiled = False
        # llguidance's views of this tokenizer, by vocabulary size and stop tokens (`l4m.constraint.ll_tokenizer`).
        self.ll_tokenizers: dict[tuple[int, tuple[int, ...]], object] = {}
        # Byte-level decoding is concatenative at character boundaries: decode(a + b) == decode(a) +
        # decode(b) whenever a's bytes end with a whole character (StreamDecoder relies on it).
        from tokenizers import decoders

        self.is_byte_level = isinstance(self._tokenizer.decoder, decoders.ByteLevel)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) become their ids."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_str(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: Iterable[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
        **template_variables: object,
    ) -> str:
        """The prompt text for a conversation, as the model was trained to read it: the text transformers'
        `apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False, **kwargs)`
        gives. `template_variables` reach the template as they do there (e.g. Llama 3's `date_string`)
        and win over the model's own (`bos_token`, `eos_token`).

        Raises ChatTemplateError when the template does not compile or refuses the conversation.
        """
        messages = [dict(m) for m in messages]
        if not self._is_jinja_compiled:
            self._jinja_template = _compile_jinja(self.chat_template)
            self._is_jinja_compiled = True
        if self._jinja_template is not None:
            from l4m import chat_template as jinja_chat_template

            variables = {**self.chat_template_variables, **template_variables}
            return jinja_chat_template.render(self._jinja_template, messages, add_generation_prompt, tools, variables)
        return render_chatml(messages, add_generation_prompt, self._default_system())

    def _default_system(self) -> str | None:
        return SMOLLM_DEFAULT_SYSTEM if SMOLLM_DEFAULT_SYSTEM in self.chat_template else None


class StreamDecoder:
    """Decodes a growing list of tokens into text deltas without splitting a UTF-8 character.

    With a byte-level tokenizer each push decodes only the tokens since the last character boundary
    (O(1) per token); otherwise the whole list is decoded again. Both give `decode(token_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._is_incremental = getattr(tokenizer, "is_byte_level", False)
        self._num_committed = 0  # token_ids[:_num_committed] decode to `text` and end on a character boundary

    def push(self, token_id: int) -> str:
        """Add a token; returns the new text it completes (possibly empty)."""
        self.token_ids.append(token_id)
        if self._is_incremental:
            tail = self._tokenizer.decode(self.token_ids[self._num_committed:])
            if tail.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
                return ""
            self._num_committed = len(self.token_ids)
            self.text += tail
            return tail
        text = self._tokenizer.decode(self.token_ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def render_chatml(messages: Sequence[Message], add_generation_prompt: bool, default_system: str | None) -> str:
    """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then the assistant header."""
    parts = []
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    parts.extend(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _compile_jinja(chat_template: str) -> object | None:
    """The compiled template; None when there is none or jinja2 is not installed (ChatML then)."""
    if not chat_template:
        return None
    try:
        from l4m import chat_template as jinja_chat_template
    except ImportError:  # jinja2 is missing
        return None
    return jinja_chat_template.compile_template(chat_template)
