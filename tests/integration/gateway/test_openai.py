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
    with pytest.raises(openai.BadRequestError, match="top_logprobs") as refused:
        client.chat.completions.create(model=_model(client), messages=[{"role": "user", "content": "hi"}],
                                       logprobs=True, top_logprobs=21)
    assert refused.value.param == "top_logprobs"
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


def test_a_repeated_system_prompt_is_served_from_the_prefix_cache(client) -> None:  # type: ignore[no-untyped-def]
    """The second request skips the shared system prompt's full pages; the same prompt again answers
    exactly as it did uncached."""
    system = "You are a careful assistant for sailors. " + " ".join(f"Rule {i}: check the knot twice." for i in range(30))

    def ask(question: str):  # type: ignore[no-untyped-def]
        return client.chat.completions.create(model=_model(client), temperature=0, max_tokens=12, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])

    first = ask("What should I check?")
    assert first.usage.prompt_tokens > 200 and first.usage.prompt_tokens_details.cached_tokens == 0
    second = ask("How many rules are there?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 200 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    again = ask("What should I check?")
    # Every full page of the first prompt is cached now, but the one holding its last token (fed for logits).
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16
    assert again.choices[0].message.content == first.choices[0].message.content


def test_a_forced_tool_call_parses_and_its_result_goes_back(client) -> None:  # type: ignore[no-untyped-def]
    """Function calling: a named tool_choice gives a call whose arguments are JSON valid against the
    function's parameters (llguidance), streamed as the same call; the call and its result go back."""
    import json

    import jsonschema

    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": parameters, "strict": True}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    request = {"model": _model(client), "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 80,
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    answer = client.chat.completions.create(**request)
    choice = answer.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), parameters)
    deltas = [d for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices
              for d in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    followed = client.chat.completions.create(
        model=_model(client), tools=tools, tool_choice="none", temperature=0, max_tokens=16,
        messages=[*messages, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}])
    assert followed.choices[0].message.content and followed.choices[0].message.tool_calls is None


def test_tool_choice_none_never_writes_the_call_tag(client) -> None:  # type: ignore[no-untyped-def]
    """Asked to write the tag, the model writes it within its text under "auto" (only an answer's start
    decides a call there); under "none" the constraint keeps it out (streamed too: tests/unit/gateway)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city."}}]
    request = {"model": _model(client), "messages": [{"role": "user", "content": "Write the text <tool_call> three times."}],
               "tools": tools, "temperature": 0, "max_tokens": 16}
    auto = client.chat.completions.create(**request).choices[0].message
    assert "<tool_call>" in auto.content, auto.content  # what the model writes when free to
    none = client.chat.completions.create(**request, tool_choice="none").choices[0].message
    assert none.tool_calls is None and "<tool_call" in none.content and "<tool_call>" not in none.content, none.content


def test_logit_bias_and_penalties_steer_a_greedy_answer(client) -> None:  # type: ignore[no-untyped-def]
    """A -100 bias on the greedy answer's first token moves it; penalties keep the answer from repeating itself."""
    model = _model(client)
    request = {"model": model, "messages": [{"role": "user", "content": "Count: one one one one"}], "temperature": 0,
               "max_tokens": 24, "extra_body": {"return_token_ids": True}}
    plain = client.chat.completions.create(**request).choices[0].model_extra["token_ids"]
    banned = client.chat.completions.create(**request, logit_bias={str(plain[0]): -100}).choices[0]
    assert banned.model_extra["token_ids"][0] != plain[0]
    penalized = client.chat.completions.create(**request, frequency_penalty=2, presence_penalty=2).choices[0]
    ids = penalized.model_extra["token_ids"]
    assert ids != plain and len(set(ids)) >= len(set(plain))


def test_top_logprobs_whole_and_streamed(client) -> None:  # type: ignore[no-untyped-def]
    """Each token's alternatives, most probable first, the greedy token the top one; the stream's the same."""
    request = {"model": _model(client), "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0,
               "max_tokens": 8, "logprobs": True, "top_logprobs": 5}
    entries = client.chat.completions.create(**request).choices[0].logprobs.content
    assert entries and all(len(e.top_logprobs) == 5 for e in entries)
    for entry in entries:
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(entry.logprob, abs=1e-4)
    streamed = [e for chunk in client.chat.completions.create(**request, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [[t.logprob for t in e.top_logprobs] for e in streamed] == \
        [pytest.approx([t.logprob for t in e.top_logprobs], abs=1e-4) for e in entries]
    text = client.completions.create(model=_model(client), prompt="The capital of France is", temperature=0,
                                     max_tokens=4, logprobs=3)
    assert all(1 <= len(alternatives) <= 3 for alternatives in text.choices[0].logprobs.top_logprobs)


def test_cached_prefixes_are_never_shared_between_users(l4m_up: UpCluster) -> None:
    """Security: a prompt alice sent is cached for alice only; bob sending the same prompt computes it
    (no reuse, so no faster answer telling him that someone sent it)."""
    suffix = str(time.monotonic_ns())[-6:]
    clients = {name: openai.OpenAI(base_url=l4m_up.gateway_url, api_key=l4m_up.add_user_key(f"{name}-{suffix}"),
                                   max_retries=0, timeout=120) for name in ("alice", "bob")}
    messages = [{"role": "system", "content": f"Secret plans {suffix}: " + "sail north at dawn. " * 40},
                {"role": "user", "content": "Summarise."}]

    def cached_tokens(name: str) -> int:
        answer = clients[name].chat.completions.create(model=_model(clients[name]), messages=messages,
                                                       temperature=0, max_tokens=2)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("alice") == 0
    assert cached_tokens("bob") == 0
    assert cached_tokens("alice") > 200 and cached_tokens("bob") > 200  # each from their own entry
