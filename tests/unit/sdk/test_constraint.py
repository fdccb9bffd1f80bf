"""Constraints with the real llguidance and SmolLM2's real tokenizer, over the fake model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from l4m.constraint import Constraint
from l4m.errors import ConstraintError
from l4m.fake import FakeL4M
from l4m.sampler import Sample

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
        "vip": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "vip"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(run, open_model, smollm_fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(smollm_fake)
        for seed in range(3):
            c = model.new_context()
            c.fill_chat([{"role": "user", "content": f"Describe person {seed} as JSON."}])
            completion = await c.generate(Sample(temperature=1.0, seed=seed), max_tokens=120,
                                          constraint=Constraint.json_schema(model, SCHEMA))
            value = json.loads(completion.text)
            jsonschema.validate(value, SCHEMA)
            assert completion.stop is not None and completion.stop.reason in ("token", "constraint")
            await c.free()

    run(body())


def test_forced_tokens_are_fast_forwarded(run, open_model, smollm_fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(smollm_fake)
        c = model.new_context()
        c.fill("Answer: ")
        tokens = [t async for t in c.generate(max_tokens=40, constraint=Constraint.json_schema(model, SCHEMA))]
        assert any(t.forced for t in tokens)  # '{"name":"' is forced by the schema
        assert model.stats.num_forward_passes < len(tokens) + 2

    run(body())


def test_regex_and_lark(run, open_model, smollm_fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(smollm_fake)
        c = model.new_context()
        c.fill("Code: ")
        text = await c.generate_text(Sample(temperature=1.0, seed=1), max_tokens=30,
                                     constraint=Constraint.regex(model, r"[0-9]{3}-[a-z]{2,4}"))
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
        grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[1-9][0-9]?/'
        d = model.new_context()
        d.fill("Well? ")
        answer = await d.generate_text(Sample(temperature=1.0, seed=2), max_tokens=10,
                                       constraint=Constraint.lark(model, grammar))
        assert re.fullmatch(r"yes|no|maybe [1-9][0-9]?", answer), answer

    run(body())


def test_bad_grammars_say_what_is_wrong(run, open_model, smollm_fake: FakeL4M) -> None:
    async def body() -> None:
        model = await open_model(smollm_fake)
        with pytest.raises(ConstraintError, match="not valid JSON"):
            Constraint.json_schema(model, "{not json")
        with pytest.raises(ConstraintError, match="rejected by llguidance"):
            Constraint.json_schema(model, {"type": "no-such-type"})
        with pytest.raises(ConstraintError, match="regex"):
            Constraint.regex(model, "(unclosed")

    run(body())


def test_one_tokenizer_gives_each_vocabulary_size_its_own_llguidance_view(run, open_model) -> None:
    """Models with one tokenizer share it (`l4m.model.TOKENIZERS`) but may pad their vocabularies to different
    sizes: each size gets its own llguidance tokenizer, so a mask is as long as its model's vocabulary."""
    from l4m.constraint import ll_tokenizer

    async def body() -> None:
        plain, padded = FakeL4M(kv_page_size=4), FakeL4M(kv_page_size=4, vocab_size=320)
        small, large = await open_model(plain), await open_model(padded)
        assert small.tokenizer is large.tokenizer
        assert ll_tokenizer(small).vocab_size == plain.vocab_size != 320
        assert ll_tokenizer(large).vocab_size == 320
        assert ll_tokenizer(large) is ll_tokenizer(large)
        c = large.new_context()
        c.fill("a")
        completion = await c.generate(max_tokens=3, constraint=Constraint.regex(large, "[ab]{3}"))
        assert re.fullmatch("[ab]{3}", completion.text), completion.text

    run(body())
