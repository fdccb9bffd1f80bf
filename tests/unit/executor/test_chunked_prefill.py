"""Chunked prefill on the real model: the scheduler core drives the real engine in process (no sockets)
through an executor link of its own; a prompt longer than the chunk budget gives the float32 logits
and greedy tokens that one unchunked pass gives, on an engine whose batch budget holds the whole prompt."""

from __future__ import annotations

import asyncio
import time

import torch

from l4m.executor.config import EngineConfig
from l4m.executor.convert import batch_from_pb, error_to_pb, info_to_pb, reply_to_pb
from l4m.executor.engine import Engine
from l4m.executor.errors import ExecutorError
from l4m.executor.weights import LoadedModel
from l4m.scheduler import requests as rq
from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.core import Scheduler
from l4m.scheduler.executors import OnConnected, OnLost, OnResponse
from l4m.v1 import executor_pb2, l4m_pb2
from tests.unit.executor.conftest import TEST_DEVICE, LogitsRecorder

# Made at import: a loop's self-pipe is a socketpair, which the unit-test socket guard forbids in a test.
_LOOP = asyncio.new_event_loop()
PAGE_SIZE = 16
NUM_STEPS = 6


class EngineLink:
    """The scheduler's executor link over an in-process `Engine`: a batch runs when it is sent, and its
    reply reaches the scheduler in the next turn of the loop, as from a stream."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.address = "in-process"
        self._on_response: OnResponse | None = None

    def start(self, on_connected: OnConnected, on_response: OnResponse, on_lost: OnLost) -> None:
        self._on_response = on_response
        on_connected(info_to_pb(self.engine.get_info()))

    def send(self, request: executor_pb2.ExecuteRequest) -> None:
        batch = batch_from_pb(request)
        try:
            reply = reply_to_pb(request.correlation_id, batch, self.engine.execute(batch))
        except ExecutorError as error:
            reply = error_to_pb(request.correlation_id, error, is_unsupported=False)
        if reply is not None:
            asyncio.get_running_loop().call_soon(self._on_response, reply)  # type: ignore[arg-type]

    async def close(self) -> None:
        return None


class Sink:
    def __init__(self) -> None:
        self.events: list[l4m_pb2.SessionResponse] = []

    def send(self, response: l4m_pb2.SessionResponse) -> None:
        self.events.append(response)

    def end(self, trap: l4m_pb2.Trap | None) -> None:
        assert trap is None, trap


async def _answer(scheduler: Scheduler, instance: object, request: l4m_pb2.SessionRequest,
                  sink: Sink) -> l4m_pb2.SessionResponse:
    before = len(sink.events)
    scheduler.submit(instance, request)  # type: ignore[arg-type]
    deadline = time.monotonic() + 120
    while len(sink.events) == before:
        assert time.monotonic() < deadline, "no reply"
        await asyncio.sleep(0)
    (response,) = sink.events[before:]
    assert response.HasField("forward_text"), response
    return response


def _forward_text(tokens: list[int], outputs: list[int], steps: int = 0) -> l4m_pb2.SessionRequest:
    num_slots = len(tokens) + steps
    pages = list(range(-(-num_slots // PAGE_SIZE)))
    request = rq.forward_text(pages, num_slots - PAGE_SIZE * (len(pages) - 1), tokens, outputs=outputs, request_id=1)
    request.forward_text.num_continuation_steps = steps
    return request


def _run(loaded: LoadedModel, tokens: list[int], max_batch_tokens: int) -> tuple[torch.Tensor, list[int], list[int], int]:
    """Every position's logits and greedy token, then a continuation's tokens, and the chunk budget."""
    engine = Engine(loaded, EngineConfig(device=TEST_DEVICE, dtype="float32", page_size=PAGE_SIZE, num_pages=64,
                                         num_embed_slots=8, max_batch_tokens=max_batch_tokens))
    recorder = LogitsRecorder(engine)

    async def scenario() -> tuple[torch.Tensor, list[int], list[int], int]:
        scheduler = Scheduler(SchedulerConfig(), [EngineLink(engine)])  # type: ignore[list-item]
        scheduler.start()
        sessions = []
        for name in ("every-position", "continuation"):
            instance = scheduler.register_instance(name, f"{name}-token", 0, 1)
            sink = Sink()
            scheduler.open_session(instance, sink)
            scheduler.submit(instance, rq.allocate(list(range(-(-(len(tokens) + NUM_STEPS) // PAGE_SIZE)))))
            sessions.append((instance, sink))
        (instance, sink), (other, other_sink) = sessions
        every = await _answer(scheduler, instance, _forward_text(tokens, list(range(len(tokens)))), sink)
        logits = torch.cat(recorder.calls)
        continued = await _answer(scheduler, other, _forward_text(tokens, [len(tokens) - 1], NUM_STEPS), other_sink)
        chunk_tokens = scheduler.get_info(omit_tokenizer_json=True).prefill_chunk_tokens
        for session, _ in sessions:
            scheduler.close_session(session)
        await scheduler.close()
        return (logits, [o.token.token_id for o in every.forward_text.outputs],
                [o.token.token_id for o in continued.forward_text.outputs], chunk_tokens)

    return _LOOP.run_until_complete(scenario())


def test_a_prompt_longer_than_the_chunk_budget_gives_the_unchunked_logits_and_tokens(
        loaded: LoadedModel, prompts: list[list[int]]) -> None:
    tokens = [t for prompt in prompts for t in prompt]
    assert len(tokens) > 64
    logits, greedy, continued, chunk_tokens = _run(loaded, tokens, max_batch_tokens=40)  # chunks of 20
    ref_logits, ref_greedy, ref_continued, ref_chunk_tokens = _run(loaded, tokens, max_batch_tokens=8192)
    assert chunk_tokens == 20 and ref_chunk_tokens == 2048 > len(tokens)
    assert logits.shape == ref_logits.shape == (len(tokens), loaded.config.vocab_size)
    # 2e-4 plus 1e-5 of the logit: a chunk's matmuls have fewer rows than the whole prompt's, and the 4-bit
    # GEMM sums in another order at 9-15 rows than at 8 and 16+ (cpu_kernels.cpp's tiles), which moves a logit
    # by up to ~1.2e-4 on the CPU even in the first chunk, which reads nothing an earlier chunk wrote.
    torch.testing.assert_close(logits, ref_logits, atol=2e-4, rtol=1e-5)
    assert greedy == ref_greedy
    assert continued == ref_continued and len(continued) == 1 + NUM_STEPS
