"""A spawner server on loopback for integration tests, and the processes around it.

`running_spawner` starts `create_server` (the same function `python -m l4m.spawner` uses) on port 0
with a real sandbox; `run_with` runs a test's launches beside a sandbox's background work (a full warm
pool); `upload`, `launch` and `attach` are the user's side of SpawnerService. A service as a real
process is `tests.integration.harness.ServiceProcess`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.instances import InstanceRegistry
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.sandbox import Sandbox
from l4m.spawner.server import SpawnerServer, create_server
from l4m.v1 import spawner_pb2, spawner_pb2_grpc

RPC_DEADLINE_S = 30.0
POOL_FILL_TIMEOUT_S = 120.0
T = TypeVar("T")


def serves_warm(sandbox: Sandbox) -> bool:
    """Whether launches on `sandbox` are served by a warm pool (when it is full)."""
    return isinstance(sandbox, ProcessSandbox) and sandbox.config.warm_pool_size > 0


async def open_full(sandbox: Sandbox) -> None:
    """Opens the sandbox's background work and, for a warm pool, waits until it is full."""
    await sandbox.open()
    if isinstance(sandbox, ProcessSandbox):
        await asyncio.wait_for(sandbox.wait_warm_pool_full(), POOL_FILL_TIMEOUT_S)


def run_with(sandbox: Sandbox, work: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(work)` with the sandbox opened (a warm pool full) before and closed after."""

    async def go() -> T:
        await open_full(sandbox)
        try:
            return await work
        finally:
            await sandbox.close()

    return asyncio.run(go())


@dataclass
class RunningSpawner:
    server: SpawnerServer
    stub: spawner_pb2_grpc.SpawnerServiceStub
    channel: grpc.aio.Channel

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@contextlib.asynccontextmanager
async def running_spawner(
    config: SpawnerConfig, sandbox: Sandbox, registry: InstanceRegistry | None = None
) -> AsyncIterator[RunningSpawner]:
    """`stub` calls without a key: a config with no keys file runs --insecure-local (the caller is the
    admin "local"); tests of users pass `api_keys_file` and talk through `l4m.client.Client`."""
    if config.api_keys_file is None:
        config = dataclasses.replace(config, insecure_local=True)
    server = await create_server(config, sandbox=sandbox, registry=registry)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield RunningSpawner(server, spawner_pb2_grpc.SpawnerServiceStub(channel), channel)
    finally:
        await server.stop(None)


async def upload(stub: spawner_pb2_grpc.SpawnerServiceStub, source: str | bytes, tag: str = "") -> str:
    data = source.encode() if isinstance(source, str) else source
    requests = [
        spawner_pb2.UploadProgramRequest(header=spawner_pb2.ProgramHeader(size_bytes=len(data), tag=tag)),
        spawner_pb2.UploadProgramRequest(chunk=data),
    ]
    return (await stub.UploadProgram(iter(requests), timeout=RPC_DEADLINE_S)).sha256


async def attach(
    stub: spawner_pb2_grpc.SpawnerServiceStub, instance_id: str, timeout_s: float = 60.0
) -> list[spawner_pb2.AttachResponse]:
    """Every event of the instance, through its exit."""
    request = spawner_pb2.AttachRequest(instance_id=instance_id)
    return [event async for event in stub.Attach(request, timeout=timeout_s)]


def log_lines(events: Sequence[spawner_pb2.AttachResponse]) -> list[str]:
    return [e.log.line for e in events if e.HasField("log")]


def exit_of(events: Sequence[spawner_pb2.AttachResponse]) -> spawner_pb2.InstanceExit:
    assert events and events[-1].HasField("exit"), f"no exit event: {events}"
    return events[-1].exit
