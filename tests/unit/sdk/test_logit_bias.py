"""The SDK's logit bias, presence / frequency penalties and top logprobs on `Greedy` / `Sample`: what goes on
the wire, what a generation does with the penalties (folded into each step's bias, one step per forward),
and the alternatives on every token, against the fake executor's logits computed by hand."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from l4m import Greedy, Sample, stop
from l4m.fake import FakeL4M
from l4m.wire import rules

PROMPT = list(range(10, 30))


def test_shaping_options_go_on_the_wire() -> None:
    spec = Sample(0.7, logit_bias={9: -1.5, 3: 2.0}, top_logprobs=4).to_pb(step=2)
    assert list(spec.logit_bias_token_ids) == [3, 9] and list(spec.logit_bias_values) == [2.0, -1.5]
    assert spec.top_logprobs == 4 and round(spec.temperature, 3) == 0.7
    plain = Greedy().to_pb()
    assert not plain.logit_bias_token_ids and plain.top_logprobs == 0
    assert hash(Greedy(logit_bias={1: 1.0})) == hash(Greedy(logit_bias=((1, 1.0),)))  # still a value


def test_penalized_folds_counts_into_the_bias() -> None:
    sampler = Greedy(logit_bias={7: 1.0}, presence_penalty=0.5, frequency_penalty=0.25)
    assert sampler.has_penalties and not Greedy(logit_bias={7: 1.0}).has_penalties
    step = sampler.penalized([7, 3, 3, 3])
    assert dict(step.logit_bias) == {7: 1.0 - 0.25 - 0.5, 3: -0.75 - 0.5}  # type: ignore[attr-defined]
    assert not step.has_penalties and step.penalized([1]) is step
    with pytest.raises(ValueError, match="needs the tokens generated so far"):
        sampler.to_pb()


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"logit_bias": {-1: 1.0}}, "logit_bias_token_ids has a negative token id"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias value nan of token 1 is not finite"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias value inf of token 1 is not finite"),
    ({"logit_bias": {i: 0.0 for i in range(rules.MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias has 65537 entries, more than 65536"),
    ({"presence_penalty": float("nan")}, "presence_penalty nan is not finite"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty -inf is not finite"),
    ({"top_logprobs": 21}, "top_logprobs 21 is not in [0, 20]"),
    ({"top_logprobs": -1}, "top_logprobs -1 is not in [0, 20]"),
])
def test_bad_shaping_options_say_what_is_wrong(kwargs: dict, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Greedy: {reason}")):
        Greedy(**kwargs)
    with pytest.raises(ValueError, match=re.escape(f"Sample: {reason}")):
        Sample(**kwargs)


def _generate(run, open_model, fake: FakeL4M, sampler, num_tokens: int) -> Any:  # type: ignore[no-untyped-def]
    async def body() -> Any:
        model = await open_model(fake)
        context = model.new_context()
        context.fill(PROMPT)
        tokens = [t async for t in context.generate(sampler, stop=stop.max_tokens(num_tokens))]
        await context.free()
        return tokens

    return run(body())


def _forward_texts(fake: FakeL4M) -> list[Any]:
    return [c.forward_text for c in fake.commands if c.WhichOneof("command") == "forward_text"]


def test_a_bias_moves_a_greedy_generation_and_keeps_continuation(run, open_model) -> None:  # type: ignore[no-untyped-def]
    plain = _generate(run, open_model, FakeL4M(), Greedy(), 12)
    banned = {plain[1].token_id: -100.0}
    fake = FakeL4M()
    biased = _generate(run, open_model, fake, Greedy(logit_bias=banned), 12)
    assert all(t.token_id not in banned for t in biased) and biased[0].token_id == plain[0].token_id
    assert any(f.num_continuation_steps for f in _forward_texts(fake))  # a static bias still continues


def test_penalties_match_a_hand_computation_step_by_step(run, open_model) -> None:  # type: ignore[no-untyped-def]
    """Each step's token is the argmax of the fake's logits minus frequency * count + presence * (count > 0)
    over the tokens generated before it; the steps go one per forward_text."""
    frequency, presence = 1.5, 0.75
    fake = FakeL4M()
    tokens = _generate(run, open_model, fake, Greedy(presence_penalty=presence, frequency_penalty=frequency,
                                                     top_logprobs=3), 10)
    sequence = list(PROMPT)
    for index, token in enumerate(tokens):
        logits = fake.logits([(t, p) for p, t in enumerate(sequence)]).astype(np.float64)
        generated = [t.token_id for t in tokens[:index]]
        for token_id in set(generated):
            logits[token_id] -= frequency * generated.count(token_id) + presence
        assert token.token_id == int(np.argmax(logits))
        logprobs = logits - np.logaddexp.reduce(logits)
        top = np.argsort(-logprobs, kind="stable")[:3]
        assert [t for t, _ in token.top_logprobs] == top.tolist()
        assert [lp for _, lp in token.top_logprobs] == pytest.approx(logprobs[top].tolist(), abs=1e-5)
        sequence.append(token.token_id)
    assert all(f.num_continuation_steps == 0 for f in _forward_texts(fake))
    assert len(_forward_texts(fake)) == 10


def test_top_logprobs_come_with_continued_tokens_and_on_the_completion(run, open_model) -> None:  # type: ignore[no-untyped-def]
    async def body() -> Any:
        model = await open_model(FakeL4M())
        async with model.new_context() as context:
            context.fill(PROMPT)
            return await context.generate(Sample(seed=4, top_logprobs=2), stop=stop.max_tokens(12))

    completion = run(body())
    assert len(completion.top_logprobs) == len(completion.token_ids) == 12
    assert all(len(top) == 2 and top[0][1] >= top[1][1] for top in completion.top_logprobs)
    assert all(lp <= top[0][1] + 1e-6 for lp, top in zip(completion.logprobs, completion.top_logprobs, strict=True))


def test_top_logprobs_count_against_the_reply_bounds() -> None:
    """Each token's alternatives are distribution entries: its own and one set per continuation step."""
    from l4m.v1 import common_pb2
    from l4m.wire import limits

    spec = common_pb2.SamplerSpec(kind=common_pb2.SAMPLER_KIND_GREEDY, top_logprobs=5)
    item = common_pb2.ForwardTextItem(samplers=[spec], num_continuation_steps=3)
    entries, num_bytes = limits.reply_cost("forward_text", item)
    assert entries == 20
    assert num_bytes == limits.ITEM_BYTES + 4 * limits.OUTPUT_BYTES + 20 * limits.DISTRIBUTION_ENTRY_BYTES
