from __future__ import annotations

from typing import Any

from l4m.tokenizer import SMOLLM_DEFAULT_SYSTEM, StreamDecoder, Tokenizer, render_chatml

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}],
]


def test_chatml_fallback_matches_the_models_template(smollm_tokenizer_bundle: Any) -> None:
    bundle = smollm_tokenizer_bundle
    tokenizer = Tokenizer(bundle.to_json(), bundle.chat_template, bundle.special_tokens)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt)
            assert rendered == render_chatml(messages, add_generation_prompt, SMOLLM_DEFAULT_SYSTEM)
    prompt = tokenizer.apply_chat_template(CONVERSATIONS[0])
    ids = tokenizer.encode(prompt)
    assert ids[0] == bundle.special_tokens["<|im_start|>"] and tokenizer.decode(ids, skip_special_tokens=False) == prompt


def test_stream_decoder_never_splits_a_character(smollm_tokenizer_bundle: Any) -> None:
    tokenizer = Tokenizer(smollm_tokenizer_bundle.to_json())
    text = "naïve café 日本語 🙂 done"
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(t) for t in tokenizer.encode(text)]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
