"""The scheduler's batch stream on an executor's framed Execute socket (`--listen-framed` on the executor,
`--executor-transport` on the scheduler), over real processes with the simulated executor:

- with the framed socket offered, the scheduler uses it and a greedy decode gets the same tokens as over
  gRPC's `Execute`;
- a framed socket the scheduler cannot open (nothing listens at the path GetInfo names) falls back to
  gRPC, and `--executor-transport grpc` never tries;
- an executor that dies takes its framed stream with it: its instances are trapped, and the scheduler
  reconnects, over frames again, to the executor restarted on the same addresses.

The real executor's framed socket (mode 0600, the cluster secret) is tests/integration/test_executor_server.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import grpc
from scheduler_procs import Cluster, executor_probe
from session_client import Session, greedy_decode

from l4m.scheduler import requests as rq
from tests.integration.harness import ServiceProcess

PROMPT = [5, 6, 7, 8, 9]
PAGE_SIZE = 16  # the simulated executor's default


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _stats(address: str) -> dict:  # type: ignore[type-arg]
    async with grpc.aio.insecure_channel(address) as channel:
        session = Session(channel)
        reply = await session.ask(rq.debug_query("stats", request_id=1))
        await session.close()
    return json.loads(reply.debug_query.response)


async def _decode(address: str, num_steps: int = 12) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        session = Session(channel)
        tokens = await greedy_decode(session, PROMPT, num_steps, PAGE_SIZE)
        await session.close()
    return tokens


def _transport(address: str, timeout_s: float = 30) -> str:
    """The scheduler's link to its one executor, once connected ("" when it did not connect in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # sessions are refused (UNAVAILABLE) while no executor is connected
            (executor,) = asyncio.run(_stats(address))["executors"]
        except ConnectionError:
            executor = {"connected": False}
        if executor["connected"]:
            return executor["transport"]
        time.sleep(0.1)
    return ""


def test_batches_go_on_frames_where_offered_with_the_tokens_of_grpc(cluster: Cluster, tmp_path: Path) -> None:
    executor = cluster.simulated_executor("--listen-framed", str(tmp_path / "executor.frames.sock"))
    framed = cluster.scheduler(executor)
    grpc_only = cluster.scheduler(executor, extra=("--allow-anonymous", "--executor-transport", "grpc"))
    assert _transport(framed) == "framed" and _transport(grpc_only) == "grpc"
    tokens = asyncio.run(_decode(framed))
    assert len(tokens) == 12 and tokens == asyncio.run(_decode(grpc_only))


def test_a_framed_socket_that_cannot_be_opened_falls_back_to_grpc(cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "executor.frames.sock"
    executor = cluster.simulated_executor("--listen-framed", str(path))
    os.unlink(path)  # GetInfo still names it; nothing listens there any more
    scheduler = cluster.scheduler(executor)
    assert _transport(scheduler) == "grpc"
    assert len(asyncio.run(_decode(scheduler, 4))) == 4


def test_an_executor_restart_traps_its_instances_and_the_link_reconnects_on_frames(tmp_path: Path) -> None:
    cluster = Cluster()
    address = f"127.0.0.1:{_free_port()}"
    executor_args = ["--listen", address, "--listen-framed", str(tmp_path / "executor.frames.sock")]
    try:
        executor = cluster.start("simulated-executor", "l4m.scheduler.simulated", executor_args, executor_probe)
        scheduler = cluster.scheduler(executor)
        assert _transport(scheduler) == "framed"

        async def held_then_lost() -> str:
            async with grpc.aio.insecure_channel(scheduler) as channel:
                session = Session(channel)
                await greedy_decode(session, PROMPT, 2, PAGE_SIZE)  # holds a page on the executor
                cluster.processes[0].stop()  # the executor dies: its framed stream ends
                await asyncio.wait_for(session.close(), 30)
                return session.trap.reason if session.trap is not None else f"no trap ({session.status})"

        reason = asyncio.run(held_then_lost())
        assert "executor 0" in reason and "was lost" in reason, reason
        restarted = ServiceProcess("l4m.scheduler.simulated", executor_args, name="simulated-executor-2")
        cluster.processes.append(restarted)
        restarted.wait_listening(60)
        assert _transport(scheduler, timeout_s=60) == "framed"
        assert len(asyncio.run(_decode(scheduler, 4))) == 4
    finally:
        cluster.stop()
