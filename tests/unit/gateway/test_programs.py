"""Requests naming a stored program (`"model": "l4m/<tag>"`), through the official `openai` package in
process: the app over `FakeBackend` and a `FakeSpawner` behind the gateway's `Spawner` interface, which
runs each program's `main(ctx)` in this process on `l4m.fake`'s model (no socket, no sandbox). What a
caller sees: the program's messages as the answer, streamed and not; its failure, an unknown or another
user's program as OpenAI errors; a stream left early ends the instance."""

from __future__ import annotations

import asyncio
import json
import runpy
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx2
import openai
import pytest
from starlette.requests import Request

from l4m.common.users import Authenticator, Unauthenticated
from l4m.fake import FakeL4M
from l4m.gateway.backend import FakeBackend, GatewayError
from l4m.gateway.config import GatewayConfig
from l4m.gateway.programs import SpawnerRefused, answer_program
from l4m.gateway.schemas import ChatCompletionRequest
from l4m.gateway.server import _Answer, create_app
from l4m.instance import Instance
from l4m.keys import KeyStore
from l4m.model import Model
from l4m.openai_compat import OpenAIRequest
from l4m.sampler import Greedy, Sample
from l4m.session import Session
from l4m.v1 import spawner_pb2

REPO = Path(__file__).resolve().parents[3]
ANSWER = runpy.run_path(str(REPO / "examples" / "controllers" / "openai_program.py"))["main"]
MESSAGES = [{"role": "user", "content": "Say hi."}]
Main = Callable[[Instance], Awaitable[Any]]


async def _fails(ctx: Instance) -> None:
    await ctx.send("partial ")
    raise RuntimeError("the program gave up")


async def _forever(ctx: Instance) -> None:
    while True:
        await ctx.send("tick ")
        await asyncio.sleep(0.01)


class _Runtime:
    """What an instance's `ctx.send` / `ctx.receive` reach: its inbox and its attach events."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[str] = asyncio.Queue()
        self.events: asyncio.Queue[spawner_pb2.AttachResponse] = asyncio.Queue()

    async def send(self, text: str) -> None:
        self.events.put_nowait(spawner_pb2.AttachResponse(message=spawner_pb2.InstanceMessage(text=text)))

    async def flush(self) -> None:
        return None

    async def receive(self, timeout_s: float | None = None) -> str | None:
        try:
            return await asyncio.wait_for(self.inbox.get(), timeout_s)
        except TimeoutError:
            return None


class FakeSpawner:
    """The spawner's user API in process: programs by tag with their owner, each key's user from the same
    key store as the gateway's, another user's program not found (as the spawner's `resolve_program`)."""

    def __init__(self, fake: FakeL4M, authenticator: Authenticator) -> None:
        self._fake, self._authenticator = fake, authenticator
        self.programs: dict[str, tuple[str, Main]] = {}  # "name:tag" -> (owner, main)
        self.alive: dict[str, asyncio.Task[None]] = {}
        self.terminated: list[str] = []
        self._runtimes: dict[str, _Runtime] = {}
        self._num_launched = 0

    def store(self, tag: str, owner: str, main: Main) -> None:
        self.programs[tag if ":" in tag else f"{tag}:latest"] = (owner, main)

    def _user(self, api_key: str | None):  # type: ignore[no-untyped-def]
        try:
            return self._authenticator.authenticate(api_key)
        except Unauthenticated as error:
            raise SpawnerRefused(grpc.StatusCode.UNAUTHENTICATED, str(error)) from None

    async def launch(self, api_key: str | None, program: str) -> str:
        user, tag = self._user(api_key), program if ":" in program else f"{program}:latest"
        owner, main = self.programs.get(tag, ("", None))
        if main is None or not (user.is_admin or owner == user.name):
            raise SpawnerRefused(grpc.StatusCode.NOT_FOUND, f"no program is tagged {tag!r}")
        self._num_launched += 1
        instance_id, runtime = f"instance-{self._num_launched}", _Runtime()
        self._runtimes[instance_id] = runtime
        self.alive[instance_id] = asyncio.create_task(self._run(instance_id, main, runtime))
        return instance_id

    async def _run(self, instance_id: str, main: Main, runtime: _Runtime) -> None:
        session = Session(self._fake.stub(), blocking_get_info=self._fake.get_info_blocking)
        exit_ = spawner_pb2.InstanceExit(reason=spawner_pb2.EXIT_REASON_EXITED)
        try:
            await main(Instance([], Model(session, self._fake.info()), runtime, instance_id))  # type: ignore[arg-type]
        except Exception as error:
            exit_ = spawner_pb2.InstanceExit(reason=spawner_pb2.EXIT_REASON_CRASHED, exit_code=1,
                                             message=f"{type(error).__name__}: {error}")
        finally:
            await session.close()  # the scheduler frees what the instance held
            self.alive.pop(instance_id, None)
        runtime.events.put_nowait(spawner_pb2.AttachResponse(exit=exit_))

    async def send(self, api_key: str | None, instance_id: str, text: str) -> None:
        self._runtimes[instance_id].inbox.put_nowait(text)

    async def attach(self, api_key: str | None, instance_id: str) -> AsyncIterator[spawner_pb2.AttachResponse]:
        events = self._runtimes[instance_id].events
        while True:
            event = await events.get()
            yield event
            if event.WhichOneof("event") == "exit":
                return

    async def terminate(self, api_key: str | None, instance_id: str) -> None:
        task = self.alive.get(instance_id)
        if task is None:
            raise SpawnerRefused(grpc.StatusCode.NOT_FOUND, f"instance {instance_id!r} has exited")
        self.terminated.append(instance_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def program_tags(self, api_key: str | None) -> list[str]:
        user = self._user(api_key)
        return sorted(tag for tag, (owner, _) in self.programs.items() if user.is_admin or owner == user.name)

    async def close(self) -> None:
        return None


class Gateway:
    def __init__(self, tmp_path: Path) -> None:
        keys = KeyStore.load(tmp_path / "keys.json")
        self.alice, self.bob = keys.add("alice"), keys.add("bob")
        keys.save()
        self.fake = FakeL4M()
        authenticator = Authenticator(tmp_path / "keys.json")
        self.spawner = FakeSpawner(self.fake, authenticator)
        self.spawner.store("answer", "alice", ANSWER)
        self.spawner.store("fails", "alice", _fails)
        self.spawner.store("forever", "alice", _forever)
        self.backend = FakeBackend(self.fake)
        self.app = create_app(GatewayConfig(), self.backend, authenticator, self.spawner)
        self.http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://gateway")

    def client(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(api_key=key or self.alice, base_url="http://gateway/v1", http_client=self.http,
                                  max_retries=0)

    def assert_freed(self) -> None:
        assert not self.spawner.alive and self.fake.num_pages_in_use == 0


@pytest.fixture
def gateway(tmp_path: Path) -> Gateway:
    return Gateway(tmp_path)


async def test_a_program_answers_like_the_built_in_handler(gateway: Gateway) -> None:
    client = gateway.client()
    built_in = await client.chat.completions.create(model="fake-tiny", messages=MESSAGES, temperature=0, max_tokens=12)
    answer = await client.chat.completions.create(model="l4m/answer", messages=MESSAGES, temperature=0, max_tokens=12)
    (choice,) = answer.choices
    assert choice.message.content == built_in.choices[0].message.content
    assert choice.finish_reason == built_in.choices[0].finish_reason
    assert answer.model == "l4m/answer" and answer.object == "chat.completion"
    assert answer.usage.prompt_tokens == built_in.usage.prompt_tokens
    assert answer.usage.completion_tokens == built_in.usage.completion_tokens
    text = await client.completions.create(model="l4m/answer", prompt="Once upon", temperature=0, max_tokens=5)
    assert text.choices[0].text and text.usage.completion_tokens <= 5
    gateway.assert_freed()


async def test_a_streamed_program_sends_each_message_as_a_chunk(gateway: Gateway) -> None:
    client = gateway.client()
    whole = await client.chat.completions.create(model="l4m/answer", messages=MESSAGES, temperature=0, max_tokens=10)
    stream = await client.chat.completions.create(model="l4m/answer", messages=MESSAGES, temperature=0, max_tokens=10,
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    gateway.assert_freed()


async def test_a_failing_program_is_a_500_naming_its_exit(gateway: Gateway) -> None:
    with pytest.raises(openai.InternalServerError, match="the program gave up") as raised:
        await gateway.client().chat.completions.create(model="l4m/fails", messages=MESSAGES)
    assert raised.value.body["code"] == "program_crashed" and "'l4m/fails'" in raised.value.body["message"]
    # Streamed, a failure after the first piece of text ends the stream with OpenAI's error event.
    response = await gateway.http.post("/v1/chat/completions", headers={"authorization": f"Bearer {gateway.alice}"},
                                       json={"model": "l4m/fails", "messages": MESSAGES, "stream": True})
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert events[1]["choices"][0]["delta"]["content"] == "partial "
    assert events[-1]["error"]["code"] == "program_crashed" and response.text.endswith("data: [DONE]\n\n")
    gateway.assert_freed()


async def test_an_unknown_or_another_users_program_is_not_found_alike(gateway: Gateway) -> None:
    errors = []
    for key, model in ((gateway.alice, "l4m/nothing"), (gateway.bob, "l4m/answer")):
        with pytest.raises(openai.NotFoundError) as raised:
            await gateway.client(key).chat.completions.create(model=model, messages=MESSAGES)
        errors.append(raised.value.body)
    assert [e["code"] for e in errors] == ["model_not_found"] * 2
    assert "'l4m/nothing'" in errors[0]["message"] and "'l4m/answer'" in errors[1]["message"]
    # Bob's 404 says what an unknown tag's does: nothing about alice or her program.
    assert errors[1]["message"].replace("answer", "nothing") == errors[0]["message"]
    assert "alice" not in errors[1]["message"] and not gateway.spawner.alive


async def test_models_lists_the_callers_programs_only(gateway: Gateway) -> None:
    alice = [m.id for m in (await gateway.client().models.list()).data]
    bob = [m.id for m in (await gateway.client(gateway.bob).models.list()).data]
    assert alice == ["fake-tiny", "l4m/answer:latest", "l4m/fails:latest", "l4m/forever:latest"]
    assert bob == ["fake-tiny"]


async def test_options_a_programs_text_cannot_answer_are_refused(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError, match="n is not available for a program"):
        await gateway.client().chat.completions.create(model="l4m/answer", messages=MESSAGES, n=2)
    assert not gateway.spawner.alive


async def test_a_stream_left_early_terminates_the_instance(gateway: Gateway) -> None:
    scope = {"type": "http", "headers": [(b"authorization", f"Bearer {gateway.alice}".encode())]}
    body = ChatCompletionRequest(model="l4m/forever", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    response = await answer_program(gateway.spawner, Request(scope), body, _Answer("chat.completion", body.model, 1))
    chunks = response.body_iterator
    for _ in range(3):
        await anext(chunks)  # type: ignore[call-overload]
    assert len(gateway.spawner.alive) == 1
    await chunks.aclose()  # type: ignore[attr-defined]  # what Starlette does when the client goes away
    assert gateway.spawner.terminated == ["instance-1"] and not gateway.spawner.alive
    assert gateway.fake.num_pages_in_use == 0


async def test_without_a_spawner_a_program_is_a_503(tmp_path: Path) -> None:
    gateway = Gateway(tmp_path)
    app = create_app(GatewayConfig(), gateway.backend, Authenticator(tmp_path / "keys.json"))
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gateway")
    response = await http.post("/v1/chat/completions", headers={"authorization": f"Bearer {gateway.alice}"},
                               json={"model": "l4m/answer", "messages": MESSAGES})
    assert response.status_code == 503 and "--spawner" in response.json()["error"]["message"]
    with pytest.raises(GatewayError):
        await answer_program(None, None, ChatCompletionRequest(model="l4m/x", messages=MESSAGES), None)  # type: ignore[arg-type]


def test_the_sdk_reads_the_request_it_is_sent() -> None:
    chat = OpenAIRequest.parse(json.dumps({"endpoint": "chat.completions", "request": {
        "model": "l4m/x", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "temperature": 0, "stop": "\n", "max_completion_tokens": 7}}))
    assert chat.is_chat and chat.messages == [{"role": "user", "content": "hi"}] and chat.max_tokens == 7
    assert isinstance(chat.sampler(), Greedy) and chat.stop_strings == ["\n"]
    text = OpenAIRequest.parse(json.dumps({"endpoint": "completions", "request": {
        "model": "l4m/x", "prompt": ["Once"], "temperature": 0.5, "top_p": 0.9, "seed": 3}}))
    assert not text.is_chat and text.prompt == "Once" and text.max_tokens == 16  # OpenAI's default
    assert text.sampler() == Sample(temperature=0.5, top_p=0.9, seed=3)
    shaped = OpenAIRequest.parse(json.dumps({"endpoint": "completions", "request": {
        "model": "l4m/x", "prompt": "Once", "temperature": 0, "logit_bias": {"7": -100, "3": 2.5},
        "presence_penalty": 0.5, "frequency_penalty": -1}}))
    assert shaped.sampler() == Greedy(logit_bias={3: 2.5, 7: -100.0}, presence_penalty=0.5, frequency_penalty=-1.0)
    with pytest.raises(Exception, match="not an OpenAI request"):
        OpenAIRequest.parse("hello")
