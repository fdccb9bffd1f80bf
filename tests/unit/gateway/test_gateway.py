"""The gateway's routes through the official `openai` package, in process: the app over `FakeBackend`
(`l4m.fake`'s model), reached through an ASGI transport (no socket). What a user of the OpenAI API
sees: answers, streams, choices, stops, usage, and OpenAI-shaped errors for every bad request."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx2
import openai
import pytest

from l4m.common.users import Authenticator
from l4m.fake import FakeL4M
from l4m.gateway.backend import FakeBackend
from l4m.gateway.config import GatewayConfig
from l4m.gateway.server import create_app
from l4m.keys import KeyStore
from l4m.model import Model
from l4m.sampler import Greedy
from l4m.session import Session
from l4m.stop import max_tokens, on_tokens

MODEL = "fake-tiny"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


class Gateway:
    def __init__(self, tmp_path: Path, **config: object) -> None:
        keys = KeyStore.load(tmp_path / "keys.json")
        self.key = keys.add("alice")
        keys.save()
        self.fake = FakeL4M()
        self.backend = FakeBackend(self.fake)
        self.config = GatewayConfig(**config)  # type: ignore[arg-type]
        self.app = create_app(self.config, self.backend, Authenticator(tmp_path / "keys.json"))
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://gateway")

    def client(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=key or self.key, base_url="http://gateway/v1", http_client=self.http,
                                  max_retries=0)

    async def raw(self, path: str, body: object, key: str | None = None) -> httpx2.Response:
        headers = {"authorization": f"Bearer {key or self.key}", "content-type": "application/json"}
        return await self.http.post(path, content=json.dumps(body), headers=headers)

    def assert_freed(self) -> None:
        assert self.backend.num_open == 0 and self.fake.num_pages_in_use == 0


@pytest.fixture
def gateway(tmp_path: Path) -> Gateway:
    return Gateway(tmp_path)


async def _sdk_greedy(fake: FakeL4M, messages: list[dict[str, str]], num_tokens: int) -> list[int]:
    """The same completion written as a controller would: the reference for the gateway's answers."""
    session = Session(fake.stub(), blocking_get_info=fake.get_info_blocking)
    model = Model(session, fake.info())
    try:
        async with model.new_context() as context:
            context.fill_chat(messages)
            completion = await context.generate(Greedy(), stop=on_tokens(model.stop_token_ids) | max_tokens(num_tokens))
            return completion.token_ids
    finally:
        await session.close()


async def test_models_lists_the_served_model(gateway: Gateway) -> None:
    models = await gateway.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_a_greedy_chat_completion_is_the_sdks_greedy_completion(gateway: Gateway) -> None:
    answer = await gateway.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                                            max_tokens=12)
    reference = await _sdk_greedy(gateway.fake, MESSAGES, 12)
    tokenizer = Model(Session(gateway.fake.stub(), blocking_get_info=gateway.fake.get_info_blocking),
                      gateway.fake.info()).tokenizer
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(reference)
    assert choice.finish_reason == ("length" if len(reference) == 12 else "stop")
    prompt = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == len(reference)
    assert answer.usage.total_tokens == len(prompt) + len(reference)
    assert answer.object == "chat.completion" and answer.model == MODEL and answer.id.startswith("chatcmpl-")
    gateway.assert_freed()


async def test_a_streamed_chat_spells_the_same_text_then_done(gateway: Gateway) -> None:
    client = gateway.client()
    whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = await gateway.raw("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "stream": True,
                                                      "max_tokens": 3})
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.text.endswith("data: [DONE]\n\n")
    gateway.assert_freed()


async def test_n_choices_fork_one_prompt(gateway: Gateway) -> None:
    client = gateway.client()
    greedy = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1  # greedy: three times the same
    sampled = [await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=8,
                                                    n=3, seed=11) for _ in range(2)]
    texts = [[c.message.content for c in answer.choices] for answer in sampled]
    assert texts[0] == texts[1]  # a seed makes the whole request reproducible
    assert len(set(texts[0])) > 1  # and the choices differ from each other
    assert gateway.fake.stats.num_sessions >= 3
    gateway.assert_freed()


async def test_text_completions_of_several_prompts_stop_strings_and_lengths(gateway: Gateway) -> None:
    client = gateway.client()
    answer = await client.completions.create(model=MODEL, prompt=["Once upon", "In 1492"], max_tokens=6, n=2,
                                             temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.choices[0].text == answer.choices[1].text and answer.choices[2].text == answer.choices[3].text
    assert all(c.finish_reason in ("length", "stop") for c in answer.choices)
    long = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=30, temperature=0)
    text = long.choices[0].text
    cut = text[3:5]  # a stop string that occurs in the greedy text
    stopped = await client.completions.create(model=MODEL, prompt="Once upon", max_tokens=30, temperature=0,
                                              stop=[cut])
    assert stopped.choices[0].text == text[: text.find(cut)] and stopped.choices[0].finish_reason == "stop"
    ids = await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens <= 4
    gateway.assert_freed()


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"model": "gpt-4", "messages": MESSAGES}, 404, "The model 'gpt-4' does not exist; served: fake-tiny"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": MESSAGES, "temperature": 3}, 400, "temperature"),
        ({"model": MODEL, "messages": MESSAGES, "n": 9}, 400, "n: at most 8 choices"),
        ({"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400,
         "top_logprobs: an integer in [0, 20], got 21"),
        ({"model": MODEL, "messages": MESSAGES, "frequency_penalty": 2.5}, 400,
         "frequency_penalty: a number in [-2, 2], got 2.5"),
        ({"model": MODEL, "messages": MESSAGES, "response_format": {"type": "xml"}}, 400,
         "response_format 'xml' is not supported"),
        ({"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
         "a JSON schema object is required"),
        ({"model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wrong"}}}}}}, 400,
         "response_format: the JSON schema was rejected by llguidance"),
        ({"model": MODEL, "messages": MESSAGES, "colour": "blue"}, 400, "colour: unknown field"),
        ({"model": MODEL, "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "content part type 'image_url' is not supported"),
        ({"model": MODEL, "messages": MESSAGES, "max_tokens": 9000}, 400, "maximum context length is 8192"),
    ],
)
async def test_bad_chat_requests_get_openai_shaped_errors(gateway: Gateway, body, status, words) -> None:  # type: ignore[no-untyped-def]
    response = await gateway.raw("/v1/chat/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"] and set(error) == {"message", "type", "param", "code"}
    gateway.assert_freed()


async def test_bad_completion_requests_and_routes(gateway: Gateway) -> None:
    for body, words in (({"model": MODEL, "prompt": [1, 99999]}, "token id 99999 is not in [0, 259)"),
                        ({"model": MODEL, "prompt": "x", "echo": True}, "echo is not supported"),
                        ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of is not supported")):
        response = await gateway.raw("/v1/completions", body)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    missing = await gateway.raw("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    too_big = await gateway.http.post("/v1/completions", content=b"x" * (gateway.config.max_request_bytes + 1),
                                      headers={"authorization": f"Bearer {gateway.key}"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    gateway.assert_freed()


async def test_a_key_is_needed_and_must_be_known(gateway: Gateway) -> None:
    """Who may use the gateway: holders of an API key of the cluster's store (as the spawner's)."""
    with pytest.raises(openai.AuthenticationError, match="not known to this cluster"):
        await gateway.client("l4m_not-a-key").models.list()
    anonymous = await gateway.http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert anonymous.status_code == 401 and "needs an API key" in anonymous.json()["error"]["message"]
    assert gateway.fake.stats.num_sessions == 0  # refused before any session


async def test_insecure_local_lets_requests_without_a_key_in(tmp_path: Path) -> None:
    fake = FakeL4M()
    app = create_app(GatewayConfig(insecure_local=True), FakeBackend(fake), Authenticator(None, insecure_local=True))
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway") as http:
        response = await http.get("/v1/models")
        assert response.status_code == 200 and response.json()["data"][0]["id"] == MODEL


async def test_concurrent_requests_each_get_their_own_session(gateway: Gateway) -> None:
    client = gateway.client()
    answers = await asyncio.gather(*(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], temperature=0, max_tokens=5)
        for i in range(6)))
    assert len({a.id for a in answers}) == 6
    gateway.assert_freed()


async def test_one_user_has_a_bounded_number_of_requests_in_flight(tmp_path: Path) -> None:
    """Past --max-requests-per-user (or the key's max_instances) a user's next request is 429 while its
    others run; another user is not affected, and the slot comes back when a request ends."""
    gateway = Gateway(tmp_path, max_requests_per_user=1)
    keys = KeyStore.load(tmp_path / "keys.json")
    bob = keys.add("bob")
    keys.save()
    client = gateway.client()
    alice = Authenticator(tmp_path / "keys.json").authenticate(gateway.key)
    async with gateway.app.state.backend.open(alice, MODEL):  # one request of alice's in flight
        with pytest.raises(openai.RateLimitError, match="1 requests in flight"):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        answer = await gateway.client(bob).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert answer.choices
    again = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert again.choices
    gateway.assert_freed()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


async def test_response_format_json_schema_and_json_object_are_followed(gateway: Gateway) -> None:
    """The output validates against the schema (llguidance masks every step), for every choice and
    streamed too; `json_object` gives a JSON object."""
    import jsonschema

    client = gateway.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, seed=5, n=2,
                                                  max_tokens=60, response_format=response_format)
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60,
                                                  response_format=response_format, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    jsonschema.validate(json.loads(text), SCHEMA)
    anything = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=400,
                                                    response_format={"type": "json_object"})
    assert anything.choices[0].finish_reason == "stop", anything.choices[0].message.content
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    gateway.assert_freed()


async def test_token_ids_and_ignore_eos_extensions(tmp_path: Path) -> None:
    """`return_token_ids` (whole and per chunk) gives the SDK's greedy ids; `ignore_eos` decodes the full
    max_tokens where the model would have stopped (a fake whose stop token wins early)."""
    gateway = Gateway(tmp_path)
    gateway.fake.stop_bias = 6.0  # the stop token (2) comes after a few tokens
    client = gateway.client()
    extra = {"return_token_ids": True}
    whole = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=40, temperature=0,
                                            extra_body=extra)
    ids = whole.choices[0].model_extra["token_ids"]
    assert whole.choices[0].finish_reason == "stop" and ids[-1] == 2 and len(ids) < 40
    stream = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=40, temperature=0, stream=True,
                                             extra_body=extra)
    streamed = [i async for chunk in stream for c in chunk.choices for i in (c.model_extra or {}).get("token_ids", [])]
    assert streamed == ids
    full = await client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=40, temperature=0,
                                           extra_body={**extra, "ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 40
    assert full.choices[0].model_extra["token_ids"][: len(ids)] == ids
    gateway.assert_freed()


async def test_logprobs_are_the_sampled_tokens_own(gateway: Gateway) -> None:
    """`logprobs: true` gives each generated token's logprob (the SDK's), whole and over the stream's chunks;
    a completion's `logprobs: 0` the same in its own shape."""
    client = gateway.client()
    session = Session(gateway.fake.stub(), blocking_get_info=gateway.fake.get_info_blocking)
    model = Model(session, gateway.fake.info())
    async with model.new_context() as context:
        context.fill_chat(MESSAGES)
        reference = await context.generate(Greedy(), stop=on_tokens(model.stop_token_ids) | max_tokens(10))
    await session.close()
    answer = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10,
                                                  logprobs=True)
    entries = answer.choices[0].logprobs.content
    assert [e.logprob for e in entries] == pytest.approx(reference.logprobs)
    assert all(e.top_logprobs == [] and e.bytes == list(e.token.encode()) for e in entries)
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10,
                                                  logprobs=True, stream=True)
    streamed = [e.logprob async for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == pytest.approx(reference.logprobs)
    text = await client.completions.create(model=MODEL, prompt="Once upon", temperature=0, max_tokens=5, logprobs=0)
    shaped = text.choices[0].logprobs
    assert len(shaped.token_logprobs) == len(shaped.tokens) == text.usage.completion_tokens
    assert shaped.text_offset[0] == 0 and all(lp <= 0 for lp in shaped.token_logprobs)
    refused = await gateway.raw("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6})
    assert refused.status_code == 400 and "logprobs: an integer in [0, 5]" in refused.json()["error"]["message"]
    gateway.assert_freed()
