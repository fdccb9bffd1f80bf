"""The spawner's gRPC server end to end: upload, launch in a real sandbox, runtime message, attach, list."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.process_sandbox import ProcessSandbox
from l4m.spawner.server import create_server
from l4m.v1 import spawner_pb2, spawner_pb2_grpc

CONTROLLER = b"""
import os, grpc
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
metadata = (("l4m-instance-token", os.environ["L4M_INSTANCE_TOKEN"]),)
with grpc.insecure_channel(os.environ["L4M_RUNTIME_ADDR"]) as channel:
    runtime = spawner_pb2_grpc.RuntimeServiceStub(channel)
    runtime.SendToUser(spawner_pb2.SendToUserRequest(text="hello user"), metadata=metadata, timeout=10)
    got = runtime.ReceiveFromUser(spawner_pb2.ReceiveFromUserRequest(timeout_ms=10000), metadata=metadata, timeout=15)
print("got", got.text)
"""


def test_upload_launch_message_attach(process_sandbox: ProcessSandbox, tmp_path: Path) -> None:
    async def go() -> list[spawner_pb2.AttachResponse]:
        socket_dir = tmp_path / "sockets"
        config = SpawnerConfig(
            state_dir=tmp_path / "state", socket_dir=socket_dir, spawner_id="srv-test", controller_runner="",
            insecure_local=True,
        )
        server = await create_server(config, sandbox=process_sandbox)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                spawner = spawner_pb2_grpc.SpawnerServiceStub(channel)
                requests = [
                    spawner_pb2.UploadProgramRequest(header=spawner_pb2.ProgramHeader(tag="hello:v1")),
                    spawner_pb2.UploadProgramRequest(chunk=CONTROLLER[:50]),
                    spawner_pb2.UploadProgramRequest(chunk=CONTROLLER[50:]),
                ]
                uploaded = await spawner.UploadProgram(iter(requests), timeout=10)
                again = await spawner.UploadProgram(iter(requests), timeout=10)
                assert again.already_present and again.sha256 == uploaded.sha256
                launched = await spawner.Launch(spawner_pb2.LaunchRequest(program="hello:v1"), timeout=10)
                events = []
                async for event in spawner.Attach(
                    spawner_pb2.AttachRequest(instance_id=launched.instance_id), timeout=30
                ):
                    events.append(event)
                    if event.HasField("message"):
                        await spawner.SendMessage(
                            spawner_pb2.SendMessageRequest(instance_id=launched.instance_id, text="hi back"),
                            timeout=10,
                        )
                listed = await spawner.ListInstances(spawner_pb2.ListInstancesRequest(), timeout=10)
                assert [i.state for i in listed.instances] == [spawner_pb2.INSTANCE_STATE_EXITED]
                try:
                    await spawner.Launch(spawner_pb2.LaunchRequest(program="nope:v1"), timeout=10)
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() is grpc.StatusCode.NOT_FOUND
                else:
                    raise AssertionError("launching an unknown tag must fail")
                return events
        finally:
            await server.stop(None)

    events = asyncio.run(go())
    kinds = [event.WhichOneof("event") for event in events]
    assert kinds[0] == "message" and events[0].message.text == "hello user", events
    assert any(e.HasField("log") and e.log.line == "got hi back" for e in events), events
    assert kinds[-1] == "exit" and events[-1].exit.reason == spawner_pb2.EXIT_REASON_EXITED, events[-1]
