"""OpenAI's logit_bias, presence / frequency penalties and top_logprobs through the gateway (the official
`openai` package over an ASGI transport, no socket), against the SDK's own answers on the same fake model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from l4m.model import Model
from l4m.sampler import Greedy
from l4m.session import Session
from l4m.stop import max_tokens, on_tokens
from tests.unit.gateway.test_gateway import MESSAGES, MODEL, Gateway


@pytest.fixture(name="gateway")
def _gateway(tmp_path: Path) -> Gateway:
    return Gateway(tmp_path)


async def _reference(gateway: Gateway, sampler: Greedy, num_tokens: int):  # type: ignore[no-untyped-def]
    """The SDK's completion of MESSAGES with `sampler`: what the gateway must answer."""
    session = Session(gateway.fake.stub(), blocking_get_info=gateway.fake.get_info_blocking)
    model = Model(session, gateway.fake.info())
    try:
        async with model.new_context() as context:
            context.fill_chat(MESSAGES)
            stop = on_tokens(model.stop_token_ids) | max_tokens(num_tokens)
            return await context.generate(sampler, stop=stop)
    finally:
        await session.close()


async def test_logit_bias_moves_the_greedy_answer(gateway: Gateway) -> None:
    plain = await _reference(gateway, Greedy(), 6)
    first = plain.token_ids[0]
    answer = await gateway.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=6, logit_bias={str(first): -100},
        extra_body={"return_token_ids": True})
    reference = await _reference(gateway, Greedy(logit_bias={first: -100.0}), 6)
    assert answer.choices[0].model_extra["token_ids"] == reference.token_ids and reference.token_ids[0] != first
    gateway.assert_freed()


async def test_penalties_are_the_sdks_and_change_a_repetitive_answer(gateway: Gateway) -> None:
    client = gateway.client()
    options = {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 20,
               "extra_body": {"return_token_ids": True}}
    plain = await client.chat.completions.create(**options)
    penalized = await client.chat.completions.create(**options, presence_penalty=2, frequency_penalty=2)
    reference = await _reference(gateway, Greedy(presence_penalty=2.0, frequency_penalty=2.0), 20)
    assert penalized.choices[0].model_extra["token_ids"] == reference.token_ids
    assert penalized.choices[0].model_extra["token_ids"] != plain.choices[0].model_extra["token_ids"]
    gateway.assert_freed()


async def test_top_logprobs_whole_and_streamed_in_openais_chat_shape(gateway: Gateway) -> None:
    client = gateway.client()
    reference = await _reference(gateway, Greedy(top_logprobs=3), 8)
    answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
                                                  logprobs=True, top_logprobs=3)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == len(reference.token_ids)
    for entry, lp, tops in zip(entries, reference.logprobs, reference.top_logprobs, strict=True):
        assert entry.logprob == pytest.approx(lp) and len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in tops])
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the sampled is the top
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8,
                                                  logprobs=True, top_logprobs=3, stream=True)
    streamed = [[t.logprob for t in e.top_logprobs] async for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == [pytest.approx([v for _, v in tops]) for tops in reference.top_logprobs]
    gateway.assert_freed()


async def test_a_completions_logprobs_k_gives_the_legacy_top_logprobs(gateway: Gateway) -> None:
    client = gateway.client()
    answer = await client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=5,
                                             logprobs=2)
    shaped = answer.choices[0].logprobs
    assert len(shaped.top_logprobs) == len(shaped.tokens) == answer.usage.completion_tokens
    for token, logprob, alternatives in zip(shaped.tokens, shaped.token_logprobs, shaped.top_logprobs,
                                            strict=True):
        assert 1 <= len(alternatives) <= 2 and max(alternatives.values()) == pytest.approx(logprob)
        assert alternatives.get(token, logprob) == pytest.approx(logprob)
    stream = await client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=5,
                                             logprobs=2, stream=True)
    streamed = [a async for c in stream if c.choices and c.choices[0].logprobs
                for a in c.choices[0].logprobs.top_logprobs]
    assert streamed == shaped.top_logprobs
    gateway.assert_freed()


CHAT = {"model": MODEL, "messages": MESSAGES}


@pytest.mark.parametrize(
    ("route", "body", "param", "words"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "an integer in [0, 20], got 21"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "an integer in [0, 20], got -1"),
        ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        ("chat", {"logprobs": 3}, "logprobs", "a boolean, got 3"),
        ("completions", {"logprobs": 6}, "logprobs", "an integer in [0, 5] for completions, got 6"),
        ("completions", {"logprobs": True}, "logprobs", "an integer in [0, 5] for completions, got True"),
        ("completions", {"top_logprobs": 2}, "top_logprobs", "not a completions option"),
        ("chat", {"presence_penalty": -2.5}, "presence_penalty", "[-2, 2], got -2.5"),
        ("chat", {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2], got 3"),
        ("completions", {"presence_penalty": 2.01}, "presence_penalty", "[-2, 2], got 2.01"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias", "the bias of token 5 is 101.0, not in [-100, 100]"),
        ("chat", {"logit_bias": {"5": -100.5}}, "logit_bias", "not in [-100, 100]"),
        ("chat", {"logit_bias": {"99999": 1}}, "logit_bias", "key '99999' is not a token id in [0, 259)"),
        ("chat", {"logit_bias": {"-1": 1}}, "logit_bias", "key '-1' is not a token id"),
        ("completions", {"logit_bias": {"hello": 1}}, "logit_bias", "key 'hello' is not a token id"),
        ("chat", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300 entries, got 301"),
    ],
)
async def test_out_of_range_options_are_400s_naming_the_param(gateway: Gateway, route, body, param, words) -> None:  # type: ignore[no-untyped-def]
    request = {**CHAT, **body} if route == "chat" else {"model": MODEL, "prompt": "x", **body}
    response = await gateway.raw(f"/v1/{'chat/' if route == 'chat' else ''}completions", request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    gateway.assert_freed()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
async def test_non_finite_numbers_are_400s(gateway: Gateway, value: float) -> None:
    """JSON has no NaN or Infinity, but Python's json (and starlette's) reads them: refused, not sampled."""
    for body, param in (({"logit_bias": {"5": value}}, "logit_bias"), ({"presence_penalty": value}, "presence_penalty"),
                        ({"frequency_penalty": value}, "frequency_penalty")):
        response = await gateway.raw("/v1/chat/completions", {**CHAT, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    gateway.assert_freed()
