"""Executor link failures heal, and a bystander is never blamed: a real executor and a real scheduler.

- The scheduler's Execute stream breaks (a TCP relay between the two cuts every connection) while
  instances hold pages and a forward pass is in flight. The executor lives on with those pages; the
  scheduler reconnects with empty tables and resets the executor (Reset RPC). Afterwards a controller
  needing many pages gets the greedy tokens it got before, and both sides count the same pages.
- One instance sends two forward_texts on two streams that write the same KV slot (each valid alone) into
  a batch with another instance's decode step, 12 times: the attacker is trapped, the bystander never.
- Persistent exports are capped per user (--max-export-pages-per-user); another user still gets pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import grpc
from scheduler_procs import Cluster, executor_probe
from session_client import Session, greedy_decode

from l4m.scheduler import requests as rq
from l4m.v1 import executor_pb2, executor_pb2_grpc, l4m_pb2, l4m_pb2_grpc
from tests.integration.harness import executor_args

NUM_PAGES = 64
PROMPT = list(range(300, 380))  # 80 tokens: with 8 continuation steps, 6 pages of 16 slots
NUM_STEPS = 8
TIMEOUT_S = 120


class CuttableRelay:
    """A TCP relay in front of an executor. `cut()` closes every connection through it: the scheduler's
    link breaks, the executor process lives on and keeps what it held. New connections are relayed."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> int:
        """Close every relayed connection; returns how many there were."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        return len(sockets) // 2

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut()


def _start(cluster: Cluster, scheduler_flags: tuple[str, ...] = (), batching: str = "adaptive") -> tuple[str, str, CuttableRelay]:
    """(scheduler address, executor address, relay the scheduler reaches the executor through)."""
    executor = cluster.start("executor", "l4m.executor", [*executor_args(), "--num-pages", str(NUM_PAGES)],
                             executor_probe, timeout_s=300)
    relay = CuttableRelay(executor)
    scheduler = cluster.scheduler(relay.address, extra=("--allow-anonymous", *scheduler_flags), batching=batching)
    return scheduler, executor, relay


def _executor_pages(executor: str) -> int:
    """KV pages the executor holds, by its own count (debug_query stats on a stream of our own)."""
    request = executor_pb2.ExecuteRequest(correlation_id=1)
    request.debug_query.queries.append("stats")
    with grpc.insecure_channel(executor) as channel:
        for reply in executor_pb2_grpc.ExecutorServiceStub(channel).Execute(iter([request]), timeout=30):
            return int(json.loads(reply.debug_query.responses[0])["num_kv_pages_allocated"])
    raise AssertionError("the executor did not answer debug_query")


async def _scheduler_pages(channel: grpc.aio.Channel) -> int:
    """KV pages the scheduler counts as held (debug_query stats)."""
    session = Session(channel)
    reply = await asyncio.wait_for(session.ask(rq.debug_query("stats", request_id=1)), TIMEOUT_S)
    await session.close()
    (executor,) = json.loads(reply.debug_query.response)["executors"]
    assert executor["connected"], executor
    return executor["kv_pages_total"] - executor["kv_pages_free"]


async def _pages_agree(channel: grpc.aio.Channel, executor: str, expected: int) -> None:
    """Both sides count `expected` pages (closing sessions free theirs shortly after: bounded wait)."""
    for _ in range(100):
        seen = (await _scheduler_pages(channel), _executor_pages(executor))
        if seen == (expected, expected):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"(scheduler, executor) pages {seen}, expected {expected} on both")


async def _completion(channel: grpc.aio.Channel) -> list[int]:
    """A controller needing 6 pages: prefill 80 tokens, then 8 greedy continuation steps."""
    session = Session(channel)
    await session.write(rq.allocate(list(range(6)), request_id=1))
    request = rq.forward_text(list(range(6)), 8, PROMPT, outputs=[len(PROMPT) - 1], request_id=2)
    request.forward_text.num_continuation_steps = NUM_STEPS
    reply = await asyncio.wait_for(session.ask(request), TIMEOUT_S)
    await session.close()
    assert reply.WhichOneof("event") == "forward_text", reply
    return [output.token.token_id for output in reply.forward_text.outputs]


async def _hold_pages(channel: grpc.aio.Channel, num_pages: int, first_token: int) -> Session:
    """A session holding `num_pages` pages, all written."""
    session = Session(channel)
    pages = list(range(num_pages))
    tokens = list(range(first_token, first_token + 16 * num_pages))
    await session.write(rq.allocate(pages, request_id=1))
    await session.write(rq.forward_text(pages, 16, tokens, request_id=2))
    reply = await asyncio.wait_for(session.ask(rq.synchronize(request_id=3)), TIMEOUT_S)
    assert reply.WhichOneof("event") == "synchronize", reply
    return session


async def _wait_connected(channel: grpc.aio.Channel) -> None:
    stub = l4m_pb2_grpc.L4MServiceStub(channel)
    deadline = time.monotonic() + TIMEOUT_S
    while (await stub.GetInfo(l4m_pb2.GetInfoRequest(omit_tokenizer_json=True), timeout=10)).num_executors != 1:
        assert time.monotonic() < deadline, "the scheduler did not reconnect"
        await asyncio.sleep(0.1)


async def _break_and_heal(scheduler: str, executor: str, relay: CuttableRelay) -> str:
    async with grpc.aio.insecure_channel(scheduler) as channel:
        before = await _completion(channel)
        holders = [await _hold_pages(channel, 10, 1000), await _hold_pages(channel, 10, 2000)]
        await _pages_agree(channel, executor, 20)
        # A forward pass in flight when the stream breaks.
        in_flight = holders[1]
        await in_flight.write(rq.allocate([10, 11, 12], request_id=4))
        await in_flight.write(rq.forward_text(list(range(13)), 16, list(range(3000, 3048)), outputs=[47],
                                              request_id=5))
        assert relay.cut() >= 1
        for session in holders:  # trapped, not closed: their sessions end with the trap
            for _ in range(TIMEOUT_S * 10):
                if session.trap is not None:
                    break
                await asyncio.sleep(0.1)
            assert session.trap is not None and session.trap.kind == l4m_pb2.TRAP_KIND_EXECUTOR_LOST, session.events
            await asyncio.wait_for(session.close(), TIMEOUT_S)
        await _wait_connected(channel)
        # The executor kept the holders' pages; the reset freed them before the new stream opened.
        await _pages_agree(channel, executor, 0)
        after = await _completion(channel)
        assert after == before, (before, after)
        held = await _hold_pages(channel, 40, 4000)  # pages the lost connection held, handed out again
        await _pages_agree(channel, executor, 40)
        await held.close()
        assert held.trap is None, held.trap
        await _pages_agree(channel, executor, 0)
        return f"tokens {before} before and after"


def test_a_broken_execute_stream_heals_with_every_page_accounted_for(cluster: Cluster) -> None:
    scheduler, executor, relay = _start(cluster)
    try:
        print(asyncio.run(_break_and_heal(scheduler, executor, relay)))
    finally:
        relay.close()
    scheduler_log = next(p for p in cluster.processes if p.name == "scheduler").log_tail(8000)
    assert "still held 23 kv pages" in scheduler_log or "still held 20 kv pages" in scheduler_log, scheduler_log


async def _collide(scheduler: str, executor: str, num_tries: int) -> None:
    async with grpc.aio.insecure_channel(scheduler) as channel:
        alone = Session(channel)
        expected = await greedy_decode(alone, [40, 41, 42, 43, 44], num_tries, 16)
        await alone.close()
        bystander = Session(channel)
        await bystander.write(rq.allocate([0, 1], request_id=1))
        tokens, generated, fed = [40, 41, 42, 43, 44], [], 0
        for attempt in range(num_tries):
            attacker = Session(channel)
            await attacker.write(rq.allocate([0], request_id=1))
            await attacker.ask(rq.synchronize(request_id=2))
            # Each valid alone; both write slot 2 of the attacker's page 0.
            await attacker.write(rq.forward_text([0], 3, [1, 2, 3], outputs=[2], stream_id=1, request_id=10))
            await attacker.write(rq.forward_text([0], 3, [9], positions=[2], outputs=[0], stream_id=2, request_id=11))
            total = len(tokens)
            num_pages = -(-total // 16)
            step = rq.forward_text(list(range(num_pages)), total - 16 * (num_pages - 1), tokens[fed:],
                                   list(range(fed, total)), outputs=[total - fed - 1], request_id=100 + attempt)
            reply = await asyncio.wait_for(bystander.ask(step), TIMEOUT_S)
            assert reply.WhichOneof("event") == "forward_text", f"attempt {attempt}: the bystander got {reply}"
            generated.append(reply.forward_text.outputs[0].token.token_id)
            tokens.append(generated[-1])
            fed = total
            await asyncio.wait_for(attacker.close(), TIMEOUT_S)
            trap = attacker.trap
            assert trap is not None and trap.kind == l4m_pb2.TRAP_KIND_INVALID_COMMAND, attacker.events
            assert "also writes" in trap.reason, trap.reason
        await bystander.close()
        assert bystander.trap is None and generated == expected, (generated, expected)
        await _pages_agree(channel, executor, 0)


def test_two_streams_writing_one_slot_trap_their_instance_never_the_bystander(cluster: Cluster) -> None:
    # k-or-t:3: the attacker's two items and the bystander's step fire as one batch.
    scheduler, executor, relay = _start(cluster, batching="k-or-t:3:200")
    try:
        asyncio.run(_collide(scheduler, executor, 12))
    finally:
        relay.close()


async def _export_quota(scheduler: str, executor: str) -> None:
    async with grpc.aio.insecure_channel(scheduler) as channel:
        hoarder = Session(channel)  # each anonymous session is a user of its own
        await hoarder.write(rq.allocate(list(range(12)), request_id=1))
        await hoarder.write(rq.export("first", list(range(8)), persistent=True, request_id=2))
        await hoarder.write(rq.export("same-pages", list(range(4)), persistent=True, request_id=3))
        await hoarder.write(rq.export("over", [8, 9], persistent=True, request_id=4))
        await asyncio.wait_for(hoarder.close(), TIMEOUT_S)
        trap = hoarder.trap
        assert trap is not None and trap.kind == l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED, hoarder.events
        assert trap.offending_request_id == 4 and "quota of 8" in trap.reason, trap.reason
        await _pages_agree(channel, executor, 8)  # the persistent export outlives its exporter
        other = await _hold_pages(channel, NUM_PAGES - 8, 100)  # another user gets every other page
        await _pages_agree(channel, executor, NUM_PAGES)
        await other.close()
        assert other.trap is None, other.trap


def test_persistent_exports_are_capped_per_user(cluster: Cluster) -> None:
    scheduler, executor, relay = _start(cluster, scheduler_flags=("--max-export-pages-per-user", "8"))
    try:
        asyncio.run(_export_quota(scheduler, executor))
    finally:
        relay.close()
