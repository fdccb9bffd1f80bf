"""Two instances interleaving forward_text commands on the real executor get exactly the tokens each
gets alone, and their commands really share batches.

The real executor (`python -m l4m.executor`, extra flags from $L4M_EXECUTOR_ARGS) is used when
services/executor has its server; until then the simulated executor stands in (printed below)."""

from __future__ import annotations

import asyncio
import json

import grpc
from scheduler_procs import REAL_EXECUTOR_READY, Cluster
from session_client import Session, greedy_decode

from l4m.scheduler import requests as rq
from l4m.v1 import l4m_pb2, l4m_pb2_grpc

PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44])
NUM_STEPS = 12


async def _scenario(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        info = await l4m_pb2_grpc.L4MServiceStub(channel).GetInfo(l4m_pb2.GetInfoRequest(), timeout=10)
        page_size = info.kv_page_size
        alone = []
        for prompt in PROMPTS:
            session = Session(channel)
            alone.append(await greedy_decode(session, prompt, NUM_STEPS, page_size))
            await session.close()
            assert session.status == grpc.StatusCode.OK, session.details

        stats_session = Session(channel)
        before = json.loads((await stats_session.ask(rq.debug_query("stats", request_id=1))).debug_query.response)
        sessions = [Session(channel) for _ in PROMPTS]
        together = await asyncio.gather(*(greedy_decode(s, p, NUM_STEPS, page_size) for s, p in zip(sessions, PROMPTS, strict=False)))
        after = json.loads((await stats_session.ask(rq.debug_query("stats", request_id=2))).debug_query.response)
        for session in sessions:
            await session.close()
        await stats_session.close()

    assert together == alone
    shared = after["multi_instance_batches"].get("forward_text", 0) - before["multi_instance_batches"].get("forward_text", 0)
    print(f"executor={'real' if REAL_EXECUTOR_READY else 'simulated'} tokens={together} shared forward batches={shared}")
    assert shared >= NUM_STEPS // 2, after
    assert after["max_instances_per_batch"]["forward_text"] == 2


def test_two_instances_interleaved_get_the_tokens_they_get_alone(cluster: Cluster) -> None:
    if REAL_EXECUTOR_READY:
        executor = cluster.real_executor()
    else:
        executor = cluster.simulated_executor("--forward-latency-ms", "2")
    # k-or-t: adaptive would let two lock-step instances ping-pong (each step fires alone while the
    # other's is in flight); waiting up to 50 ms for the second makes every step a shared batch.
    asyncio.run(_scenario(cluster.scheduler(executor, batching="k-or-t:2:50")))
