"""Stored programs as OpenAI models (`"model": "l4m/<tag>"`) against `l4m up`'s gateway, with the official
`openai` package: programs stored with `l4m store`, run by the spawner in its bubblewrap sandbox as the
caller's user. The answer streamed and not, a failing program's error, an unknown program's 404, a
client that leaves mid-stream ends the instance, and one user cannot run another's private program."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from pathlib import Path

import openai
import pytest

from l4m.client import Client
from l4m.v1 import spawner_pb2
from tests.integration.examples.test_examples import example
from tests.integration.harness import L4M_CLI, REPO, UpCluster, service_env

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
FAILS = "async def main(ctx):\n    await ctx.receive(30)\n    raise RuntimeError('no answer today')\n"
FOREVER = ("import asyncio\n\nasync def main(ctx):\n    await ctx.receive(30)\n    while True:\n"
           "        await ctx.send('tick ')\n        await asyncio.sleep(0.05)\n")


def _store(up: UpCluster, path: Path, tag: str, key_file: Path | None = None) -> str:
    argv = [str(L4M_CLI), "store", str(path), "--tag", tag, "--spawner", up.spawner_address,
            "--api-key-file", str(key_file or up.admin_key_path)]
    proc = subprocess.run(argv, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def tags(l4m_up: UpCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder, suffix = tmp_path_factory.mktemp("programs"), uuid.uuid4().hex[:8]
    (folder / "fails.py").write_text(FAILS)
    (folder / "forever.py").write_text(FOREVER)
    tags = {"answer": f"answer-{suffix}", "fails": f"fails-{suffix}", "forever": f"forever-{suffix}"}
    _store(l4m_up, example("openai_program"), tags["answer"])
    _store(l4m_up, folder / "fails.py", tags["fails"])
    _store(l4m_up, folder / "forever.py", tags["forever"])
    return tags


@pytest.fixture(scope="module")
def client(l4m_up: UpCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=l4m_up.gateway_url, api_key=l4m_up.admin_key, max_retries=0, timeout=120)


def _alive(up: UpCluster) -> list[str]:
    async def listed() -> list[str]:
        async with Client(up.spawner_address, api_key=up.admin_key) as spawner:
            return [i.instance_id for i in await spawner.list_instances()
                    if i.state != spawner_pb2.INSTANCE_STATE_EXITED]
    return asyncio.run(listed())


def test_a_program_answers_as_the_built_in_handler_streamed_and_not(client, tags) -> None:  # type: ignore[no-untyped-def]
    model = f"l4m/{tags['answer']}"
    built_in = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES,
                                              temperature=0, max_tokens=24)
    answer = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content == built_in.choices[0].message.content
    assert answer.choices[0].finish_reason == built_in.choices[0].finish_reason
    assert answer.usage.completion_tokens == built_in.usage.completion_tokens
    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=24,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == built_in.choices[0].message.content
    assert f"{model}:latest" in [m.id for m in client.models.list().data]


def test_a_failing_and_an_unknown_program_are_openai_errors(client, tags, l4m_up: UpCluster) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.InternalServerError, match="no answer today") as raised:
        client.chat.completions.create(model=f"l4m/{tags['fails']}", messages=MESSAGES)
    assert raised.value.body["code"] == "program_crashed"
    with pytest.raises(openai.NotFoundError, match="l4m/no-such-program"):
        client.completions.create(model="l4m/no-such-program", prompt="hi")
    assert not _alive(l4m_up)


def test_a_client_that_leaves_mid_stream_ends_the_instance(client, tags, l4m_up: UpCluster) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(model=f"l4m/{tags['forever']}", messages=MESSAGES, stream=True)
    pieces = 0
    for chunk in stream:
        pieces += 1 if chunk.choices and chunk.choices[0].delta.content else 0
        if pieces >= 3:
            break
    assert len(_alive(l4m_up)) == 1
    stream.close()
    deadline = time.monotonic() + 20
    while _alive(l4m_up) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(l4m_up)


def test_a_user_cannot_run_another_users_private_program(l4m_up: UpCluster, tags) -> None:  # type: ignore[no-untyped-def]
    suffix = uuid.uuid4().hex[:8]
    alice_key, mallory_key = l4m_up.add_user_key(f"alice-{suffix}"), l4m_up.add_user_key(f"mallory-{suffix}")
    tag = f"private-{suffix}"
    _store(l4m_up, example("openai_program"), tag, l4m_up.write_key_file(f"alice-{suffix}", alice_key))
    alice = openai.OpenAI(base_url=l4m_up.gateway_url, api_key=alice_key, max_retries=0, timeout=120)
    mallory = openai.OpenAI(base_url=l4m_up.gateway_url, api_key=mallory_key, max_retries=0, timeout=120)
    answer = alice.chat.completions.create(model=f"l4m/{tag}", messages=MESSAGES, temperature=0, max_tokens=4)
    assert answer.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as raised:
        mallory.chat.completions.create(model=f"l4m/{tag}", messages=MESSAGES, max_tokens=4)
    assert "alice" not in raised.value.body["message"]
    assert f"l4m/{tag}:latest" not in [m.id for m in mallory.models.list().data]
    assert f"l4m/{tags['answer']}:latest" not in [m.id for m in mallory.models.list().data]  # nor the admin's
