"""The official `openai` package against `l4m up`'s gateway, over real HTTP: the same greedy text as
the SDK's `text_completion.py`, streamed and not; `n` choices; OpenAI's errors; a client that goes
away mid-stream frees its pages."""

from __future__ import annotations

import time

import grpc
import openai
import pytest

from l4m.v1 import l4m_pb2, l4m_pb2_grpc
from tests.integration.examples.test_examples import example
from tests.integration.harness import UpCluster

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(l4m_up: UpCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=l4m_up.gateway_url, api_key=l4m_up.admin_key, max_retries=0, timeout=120)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _free_pages(up: UpCluster) -> int:
    with grpc.insecure_channel(up.scheduler_address) as channel:
        info = l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(omit_tokenizer_json=True), timeout=30)
    return info.num_free_kv_pages


def test_chat_greedy_equals_the_sdks_text_completion_streamed_and_not(client, l4m_run) -> None:  # type: ignore[no-untyped-def]
    run = l4m_run(example("text_completion"), "--no-stream", PROMPT, "32")
    assert run.returncode == 0, run.stderr
    reference = run.summary()["text"]
    model = _model(client)
    messages = [{"role": "user", "content": PROMPT}]
    answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32)
    assert answer.choices[0].message.content == reference
    assert answer.usage.completion_tokens == len(run.summary()["token_ids"])
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=32, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == reference


def test_n_choices_and_text_completions(client) -> None:  # type: ignore[no-untyped-def]
    model = _model(client)
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Name a color."}],
                                            temperature=0.8, seed=3, max_tokens=8, n=3)
    assert [c.index for c in answer.choices] == [0, 1, 2] and all(c.message.content for c in answer.choices)
    text = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=5)
    assert text.choices[0].text and text.usage.completion_tokens <= 5


def test_errors_are_openais(client, l4m_up: UpCluster) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_logprobs is not supported"):
        client.chat.completions.create(model=_model(client), messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=3)
    stranger = openai.OpenAI(base_url=l4m_up.gateway_url, api_key="l4m_unknown", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_a_client_that_leaves_mid_stream_frees_its_pages(client, l4m_up: UpCluster) -> None:  # type: ignore[no-untyped-def]
    before = _free_pages(l4m_up)
    # Counting goes on for as long as it is let: the request is still generating when the client leaves.
    stream = client.completions.create(model=_model(client), temperature=0, max_tokens=1500, stream=True,
                                       prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,")
    received = 0
    for chunk in stream:
        received += 1 if chunk.choices and chunk.choices[0].text else 0
        if received >= 3:
            break
    assert _free_pages(l4m_up) < before  # the request holds pages while it runs
    stream.close()  # the client goes away
    deadline = time.monotonic() + 20
    while _free_pages(l4m_up) < before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _free_pages(l4m_up) == before


def test_response_format_json_schema_validates(client) -> None:  # type: ignore[no-untyped-def]
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=_model(client), temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Name the capital of France as JSON with city and country."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
