"""The model's tokenizer, built with `tokenizers` from GGUF metadata or read from an HF directory.

GGUF `gpt2` tokenizers are byte-level BPE: vocabulary + ranked merges, a pre-tokenizer chosen by
`tokenizer.ggml.pre` (SmolLM's `smollm`: individual digits, then the GPT-2 split pattern, no prefix
space), and control tokens (token type 3) as special added tokens.

Besides the tokenizer, a bundle carries what a controller needs to render prompts as transformers does:
the chat template, the bos/eos token strings the template reads as variables, and the ids that end a
turn (an instruct model often has several: Llama 3's `<|eot_id|>`, `<|eom_id|>` and `<|end_of_text|>`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from l4m.executor.architectures import UnsupportedModel

_CONTROL_TOKEN_TYPE = 3
# Pre-tokenizers whose first step splits every digit on its own (llama.cpp's names). llama.cpp's
# "default" (a GGUF that names none) is another split, not implemented: refused.
_INDIVIDUAL_DIGIT_PRE = {"smollm", "starcoder", "refact"}
# Pre-tokenizers that split with one regex, then map bytes (llama.cpp's names; the patterns are those of
# the models' own tokenizer.json): Llama 3 groups up to 3 digits, Qwen2 splits every digit.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PATTERNS = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}"),
}


@dataclass(frozen=True)
class TokenizerBundle:
    """A ready tokenizer plus what a controller needs to rebuild or drive it."""

    tokenizer: Tokenizer
    special_tokens: dict[str, int]
    chat_template: str
    eos_token_ids: tuple[int, ...]  # every id that ends a turn or the text (the stop tokens)
    bos_token: str = ""  # the token strings the template reads as `bos_token` / `eos_token`; "" = none
    eos_token: str = ""

    def to_json(self) -> str:
        """The full `tokenizers` JSON (vocabulary, merges, pre-tokenizer, special tokens)."""
        return self.tokenizer.to_str()

    def chat_template_variables(self) -> dict[str, str]:
        """The variables transformers passes to the template from its special-token map (those set)."""
        named = (("bos_token", self.bos_token), ("eos_token", self.eos_token))
        return {name: token for name, token in named if token}


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def tokenizer_from_gguf(fields: Mapping[str, object]) -> TokenizerBundle:
    """Byte-level BPE from the `tokenizer.ggml.*` metadata of a GGUF (`gguf_file.read_gguf(path).fields`)."""
    get = fields.get

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not implemented (byte-level BPE 'gpt2' only; a "
                               "SentencePiece model such as Llama 2's or Mistral's loads from its HF directory)")
    pre = str(get("tokenizer.ggml.pre", "default"))
    if pre not in _INDIVIDUAL_DIGIT_PRE | set(_SPLIT_PATTERNS) | {"gpt-2"}:
        raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not implemented; supported: "
                               f"{', '.join(sorted(_INDIVIDUAL_DIGIT_PRE | set(_SPLIT_PATTERNS) | {'gpt-2'}))}")
    tokens: list[str] = list(get("tokenizer.ggml.tokens"))
    token_types: list[int] = list(get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [_merge_pair(m) for m in get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False
    )
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(get("tokenizer.ggml.add_space_prefix", False))
    )
    if pre in _INDIVIDUAL_DIGIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in _SPLIT_PATTERNS:
        split = pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    special = {
        t: i
        for i, (t, kind_) in enumerate(zip(tokens, token_types, strict=True))
        if kind_ == _CONTROL_TOKEN_TYPE
    }
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    ends = (eos, get("tokenizer.ggml.eot_token_id"), get("tokenizer.ggml.eom_token_id"))
    stop_ids = {int(i) for i in ends if i is not None}
    if eos is not None and "<|im_end|>" in special:
        # ChatML models (SmolLM2) end a turn with <|im_end|> even when their GGUF names another eos.
        stop_ids.add(special["<|im_end|>"])
    return TokenizerBundle(
        tokenizer,
        special,
        str(get("tokenizer.chat_template", "")),
        tuple(sorted(stop_ids)),
        bos_token=tokens[int(bos)] if bos is not None else "",
        eos_token=tokens[int(eos)] if eos is not None else "",
    )


def tokenizer_from_hf_dir(path: Path) -> TokenizerBundle:
    """`tokenizer.json` of an HF checkpoint, with its chat template, bos/eos tokens and stop ids.

    The template is `chat_template.jinja` (transformers 5 writes it there) or `tokenizer_config.json`'s
    `chat_template`. The stop ids join every eos the checkpoint names: tokenizer_config's `eos_token`,
    `generation_config.json`'s `eos_token_id` (what `generate` stops on; Llama 3 instruct lists three)
    and config.json's.
    """
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    config = _read_json(path / "tokenizer_config.json")
    bos_token, eos_token = _token_content(config.get("bos_token")), _token_content(config.get("eos_token"))
    stop_ids = _token_ids(_read_json(path / "generation_config.json").get("eos_token_id"))
    stop_ids |= _token_ids(_read_json(path / "config.json").get("eos_token_id"))
    if (eos_id := tokenizer.token_to_id(eos_token) if eos_token else None) is not None:
        stop_ids.add(eos_id)
    return TokenizerBundle(
        tokenizer, special, _chat_template(path, config), tuple(sorted(stop_ids)), bos_token, eos_token
    )


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_content(token: object) -> str:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _token_ids(value: object) -> set[int]:
    """An `eos_token_id` of a config: one id, a list of them, or null."""
    if isinstance(value, int):
        return {value}
    return {int(i) for i in value} if isinstance(value, list) else set()


def _chat_template(path: Path, config: dict) -> str:
    jinja_path = path / "chat_template.jinja"
    if jinja_path.exists():  # transformers 5 moves the template out of tokenizer_config, and reads it first
        return jinja_path.read_text(encoding="utf-8")
    template = config.get("chat_template") or ""
    if isinstance(template, list):  # named: [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t.get("template", "") for t in template if t.get("name") == "default"), "")
    return str(template)
