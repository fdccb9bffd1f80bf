"""The per-token fast paths give the same text as the plain ones: incremental detokenization, and text
decoded lazily when no stop condition reads it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from l4m import stop
from l4m.fake import FakeL4M
from l4m.generation import Completion, Token
from l4m.sampler import Sample
from l4m.stop import Stop, StopCondition
from l4m.tokenizer import StreamDecoder, Tokenizer

PROMPT = list(range(10, 20))


class _ReadsText(StopCondition):
    """A condition of a type the SDK does not know: it may read the text, so text is decoded eagerly."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def check(self, token_ids: Sequence[int], text: str) -> Stop | None:
        self.texts.append(text)
        return None


def _full_decode_pushes(tokenizer: Tokenizer, token_ids: Sequence[int]) -> tuple[list[str], str]:
    """What StreamDecoder gave before the incremental path: decode everything at every push."""
    decoder = StreamDecoder(tokenizer)
    decoder._is_incremental = False
    return [decoder.push(t) for t in token_ids], decoder.text


def _check_incremental_matches_full(tokenizer: Tokenizer, sequences: list[list[int]]) -> None:
    for token_ids in sequences:
        decoder = StreamDecoder(tokenizer)
        assert decoder._is_incremental
        pieces = [decoder.push(t) for t in token_ids]
        assert (pieces, decoder.text) == _full_decode_pushes(tokenizer, token_ids)
        assert decoder.text == tokenizer.decode(token_ids) or tokenizer.decode(token_ids).endswith("\ufffd")


def test_incremental_decoding_equals_full_decoding_on_the_tiny_tokenizer() -> None:
    tokenizer = Tokenizer(FakeL4M().tokenizer_json)
    rng = random.Random(0)
    # One token per byte: random bytes split UTF-8 characters and make invalid sequences; ids 0-2 are specials.
    sequences = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(300)]
    sequences.append(tokenizer.encode("naïve café 日本語 🙂 done"))
    _check_incremental_matches_full(tokenizer, sequences)


def test_incremental_decoding_equals_full_decoding_on_smollm(smollm_tokenizer_bundle: Any) -> None:
    bundle = smollm_tokenizer_bundle
    tokenizer = Tokenizer(bundle.to_json(), bundle.chat_template, bundle.special_tokens)
    rng = random.Random(1)
    special = list(bundle.special_tokens.values())
    text_ids = tokenizer.encode("naïve café 日本語 🙂 done <|im_end|> ¿qué? Ωμέγα")
    sequences = [[rng.choice(special + text_ids + [rng.randrange(tokenizer.vocab_size)]) for _ in range(30)]
                 for _ in range(200)]
    sequences += [[rng.randrange(tokenizer.vocab_size) for _ in range(50)] for _ in range(100)]
    _check_incremental_matches_full(tokenizer, sequences)


def _generate(run, open_model, fake: FakeL4M, condition: StopCondition) -> tuple[list[Token], Completion, Any]:
    async def body() -> tuple[list[Token], Completion, Any]:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        generation = c.generate(sampler=Sample(temperature=1.5, seed=7), stop=condition)
        tokens = [t async for t in generation]
        return tokens, generation.completion, model

    return run(body())


def test_lazy_text_is_the_eager_text_and_loads_no_tokenizer_until_read(run, open_model, fake: FakeL4M) -> None:
    lazy_tokens, lazy_completion, model = _generate(run, open_model, fake, stop.max_tokens(40))
    assert model._tokenizer is None  # nothing read the text: the tokenizer was never built
    reads_text = _ReadsText()
    eager_tokens, eager_completion, _ = _generate(run, open_model, fake, reads_text | stop.max_tokens(40))
    assert len(reads_text.texts) == 40
    assert [t.token_id for t in lazy_tokens] == [t.token_id for t in eager_tokens]
    # Out of order on purpose: a later token's text first, then the completion, then the rest.
    assert lazy_tokens[20].text == eager_tokens[20].text
    assert lazy_completion.text == eager_completion.text == reads_text.texts[-1]
    assert lazy_tokens == eager_tokens and lazy_completion == eager_completion
    assert "".join(t.text for t in lazy_tokens) == lazy_completion.text
    assert lazy_completion.stop == Stop("length")


def test_lazy_completion_text_follows_a_generation_in_progress(run, open_model, fake: FakeL4M) -> None:
    async def body() -> list[tuple[str, str]]:
        model = await open_model(fake)
        c = model.new_context()
        c.fill(PROMPT)
        generation = c.generate(max_tokens=12, stop=stop.on_tokens([]))
        seen = []
        async for _ in generation:
            completion = generation.completion
            seen.append((completion.text, model.tokenizer.decode(completion.token_ids)))
        return seen

    seen = run(body())
    assert len(seen) == 12
    for text, decoded in seen:
        assert text == decoded or decoded.endswith("\ufffd")


def test_token_and_completion_keep_their_value_semantics() -> None:
    token = Token(5, -0.5, "a")
    assert token == Token(5, -0.5, "a") and token != Token(5, -0.5, "b") and hash(token) == hash(Token(5, -0.5, "a"))
    assert repr(token) == "Token(token_id=5, logprob=-0.5, text='a', forced=False)"
    try:
        token.text = "b"  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("Token must stay immutable")
    completion = Completion()
    completion.token_ids.append(3)
    completion.text = "x"
    assert completion == Completion("x", [3]) and completion.logprob == 0.0
