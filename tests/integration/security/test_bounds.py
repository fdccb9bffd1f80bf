"""Bounded work per command (issue 17), attacked as written on the session's shared `l4m up`: one
forward_text of 256 outputs, each a DISTRIBUTION over the whole vocabulary (a ~84 MB reply, past the
executor's 64 MiB send limit, which used to break its stream and trap every instance on it), and a
vocabulary mask of 12 x 10^6 zero-length runs (which used to stall a bystander's step for seconds). Both
trap the attacker alone with a reason naming the limit; a bystander holding pages on the same executor
through both attacks finishes with the same tokens as an undisturbed run, and a normal controller with
the baseline's; scheduler and executor agree on every page.

Also on the L4M Session stream (an in-process scheduler, loopback): bytes that are not a SessionRequest
answer INVALID_ARGUMENT at once, and a message over the receive limit RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc

from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.core import Scheduler
from l4m.scheduler.server import create_server
from l4m.scheduler.simulated import SimulatedExecutor, SimulatedLink
from l4m.v1 import l4m_pb2, spawner_pb2
from l4m.wire import limits
from tests.integration.harness import UpCluster
from tests.integration.security.conftest import (
    CONTROLLERS,
    Baseline,
    Ended,
    Spawner,
    Users,
    greedy_completion,
    pages_used,
    wait_until,
)

BOUNDS = CONTROLLERS / "bounds.py"
SESSION_METHOD = "/l4m.v1.L4MService/Session"


def _trapped_invalid(ended: Ended, *words: str) -> None:
    assert ended.reason == "EXIT_REASON_TRAPPED", ended.describe()
    assert any("(TRAP_KIND_INVALID_COMMAND)" in line for line in ended.logs), ended.describe()
    for word in words:
        assert word in ended.exit.message, ended.describe()  # type: ignore[union-attr]


def _messages(spawner: Spawner, instance_id: str, timeout_s: float = 600) -> Iterator[str]:
    """The instance's messages as they come; the attach stream stays held (the instance is not detached)."""
    stream = spawner.stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id), timeout=timeout_s,
                                 metadata=spawner.metadata)
    spawner.held.append(stream)
    for event in stream:
        if event.WhichOneof("event") == "message":
            yield event.message.text


def _pages_agree(l4m_up: UpCluster) -> dict[str, float]:
    held = pages_used(l4m_up)
    return held if held["scheduler_kv_pages"] == held["executor_kv_pages"] else {}


def test_the_distribution_and_mask_attacks_trap_the_attacker_alone(l4m_up: UpCluster, users: Users,
                                                                  baseline: Baseline) -> None:
    undisturbed = json.loads(users.alice.run(BOUNDS, "bystander").messages[-1])["tokens"]
    held_before = {}
    wait_until(lambda: bool(held_before.update(_pages_agree(l4m_up)) or held_before), timeout_s=30)
    bystander = users.alice.launch(BOUNDS, ["bystander", "wait"])
    messages = _messages(users.alice, bystander)
    assert next(messages) == "ready"  # it holds pages on the executor, mid-completion

    attack = users.bob.run(BOUNDS, "distributions", "256", "vocab")
    _trapped_invalid(attack, "samplers ask for 12582912 distribution entries (outputs x distribution_top_k)",
                     f"more than max_distribution_entries_per_command "
                     f"{limits.DEFAULT_MAX_DISTRIBUTION_ENTRIES_PER_COMMAND}")
    # Within the bound the same shape is served: 21 distributions over the vocabulary.
    served = users.bob.run(BOUNDS, "distributions", "21", "vocab")
    assert served.reason == "EXIT_REASON_EXITED", served.describe()
    assert json.loads(served.messages[-1])["served_entries"] == 21 * 49152
    zero_runs = users.bob.run(BOUNDS, "zero-runs", "12000000")
    _trapped_invalid(zero_runs, "the masks carry 12000001 BRLE runs in all, more than max_mask_runs_per_command "
                                f"{limits.DEFAULT_MAX_MASK_RUNS_PER_COMMAND}")

    users.alice.stub.SendMessage(spawner_pb2.SendMessageRequest(instance_id=bystander, text="go"), timeout=10,
                                 metadata=users.alice.metadata)
    assert json.loads(next(messages))["tokens"] == undisturbed
    assert greedy_completion(l4m_up) == baseline.tokens
    wait_until(lambda: _pages_agree(l4m_up) == held_before, timeout_s=30)


async def _session_status(address: str, payload: bytes) -> grpc.aio.AioRpcError:
    """Sends `payload` as one raw message on a Session and returns the status the call ends with."""
    options = limits.grpc_options(1 << 30, 1 << 30)  # this client sends past the scheduler's limit on purpose
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        session = channel.stream_stream(SESSION_METHOD, request_serializer=lambda raw: raw,
                                        response_deserializer=l4m_pb2.SessionResponse.FromString)
        call = session(iter([payload]), timeout=30)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error
    raise AssertionError("the session ended without an error status")


def test_malformed_and_oversized_session_messages_get_a_status() -> None:
    async def scenario() -> None:
        config = SchedulerConfig(allow_anonymous=True)
        scheduler = Scheduler(config, [SimulatedLink(SimulatedExecutor())])  # type: ignore[list-item]
        server = await create_server(config, scheduler)
        try:
            for _ in range(100):  # the simulated executor connects on the loop
                if scheduler.is_ready:
                    break
                await asyncio.sleep(0.01)
            address = f"127.0.0.1:{server.port}"
            garbage = await _session_status(address, b"\xff\xff\xff\xff")
            assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT, garbage
            assert "does not parse as l4m.v1.SessionRequest" in garbage.details(), garbage.details()
            oversized = await _session_status(address, b"\0" * (limits.MAX_COMMAND_BYTES + 1))
            assert oversized.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, oversized
            good = l4m_pb2.SessionRequest(request_id=3, get_info=l4m_pb2.GetInfoCommand(omit_tokenizer_json=True))
            # The scheduler still serves: a well-formed session answers, then ends when the client closes.
            async with grpc.aio.insecure_channel(address) as channel:
                session = channel.stream_stream(SESSION_METHOD, request_serializer=l4m_pb2.SessionRequest.SerializeToString,
                                                response_deserializer=l4m_pb2.SessionResponse.FromString)
                replies = [reply async for reply in session(iter([good]), timeout=30)]
            assert [r.request_id for r in replies] == [3] and replies[0].info.max_command_bytes == limits.MAX_COMMAND_BYTES
            assert scheduler.instances.num_active() == 0
        finally:
            await server.stop(0)  # and its health task
            await scheduler.close()

    asyncio.run(scenario())
