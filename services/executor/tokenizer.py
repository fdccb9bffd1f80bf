"""The model's tokenizer, built with `tokenizers` from GGUF metadata or read from an HF directory.

GGUF `gpt2` tokenizers are byte-level BPE: vocabulary + ranked merges, a pre-tokenizer chosen by
`tokenizer.ggml.pre` (SmolLM's `smollm`: individual digits, then the GPT-2 split pattern, no prefix
space), and control tokens (token type 3) as special added tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

_CONTROL_TOKEN_TYPE = 3
# Pre-tokenizers whose first step splits every digit on its own (llama.cpp's names).
_INDIVIDUAL_DIGIT_PRE = {"smollm", "starcoder", "refact", "default"}


@dataclass(frozen=True)
class TokenizerBundle:
    """A ready tokenizer plus what a controller needs to rebuild or drive it."""

    tokenizer: Tokenizer
    special_tokens: dict[str, int]
    chat_template: str
    eos_token_ids: tuple[int, ...]

    def to_json(self) -> str:
        """The full `tokenizers` JSON (vocabulary, merges, pre-tokenizer, special tokens)."""
        return self.tokenizer.to_str()


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def tokenizer_from_gguf(reader: object) -> TokenizerBundle:
    """Byte-level BPE from `tokenizer.ggml.*` fields of an open `gguf.GGUFReader`."""
    fields = reader.fields  # type: ignore[attr-defined]

    def get(key: str, default: object = None) -> object:
        return fields[key].contents() if key in fields else default

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)")
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
    if get("tokenizer.ggml.pre", "default") in _INDIVIDUAL_DIGIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
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
    eos = get("tokenizer.ggml.eos_token_id")
    eos_ids = (
        tuple(sorted({int(eos)} | ({special["<|im_end|>"]} if "<|im_end|>" in special else set())))
        if eos is not None
        else ()
    )
    return TokenizerBundle(tokenizer, special, str(get("tokenizer.chat_template", "")), eos_ids)


def tokenizer_from_hf_dir(path: Path) -> TokenizerBundle:
    """`tokenizer.json` (+ `tokenizer_config.json` for the chat template and eos) of an HF checkpoint."""
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    eos_name = config.get("eos_token")
    eos_name = eos_name.get("content") if isinstance(eos_name, dict) else eos_name
    eos_ids = (special[eos_name],) if eos_name in special else ()
    return TokenizerBundle(tokenizer, special, str(config.get("chat_template") or ""), eos_ids)
