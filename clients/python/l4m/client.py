"""The user's side: upload controller programs to a spawner, launch, attach, talk to, and stop them.

`Client.run(path, args)` is `l4m run`: upload (chunked, content-addressed by sha256), launch, and
stream the instance's events until it exits.

Launch carries the caller's current span as `traceparent` metadata (when the caller traces), so the
spawner's `spawner.launch` span and everything under it join the caller's trace.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc

from l4m.errors import L4MError
from l4m.session import call_metadata
from l4m.telemetry import traceparent_of
from l4m.v1 import spawner_pb2, spawner_pb2_grpc

CHUNK_BYTES = 1 << 20  # the proto's limit per chunk
DEFAULT_TIMEOUT_S = 30.0


class Client:
    """A `SpawnerService` client; every unary call has a deadline."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = spawner_pb2_grpc.SpawnerServiceStub(self._channel)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def upload(self, program: bytes, filename: str, tag: str = "") -> str:
        """Store a program (a `.py` file or a zip); returns its id (sha256)."""
        digest = hashlib.sha256(program).hexdigest()
        header = spawner_pb2.ProgramHeader(size_bytes=len(program), sha256=digest, tag=tag, filename=filename)

        def parts():  # type: ignore[no-untyped-def]
            yield spawner_pb2.UploadProgramRequest(header=header)
            for start in range(0, len(program), CHUNK_BYTES):
                yield spawner_pb2.UploadProgramRequest(chunk=program[start:start + CHUNK_BYTES])

        response = await self._call(self._stub.UploadProgram(parts(), timeout=self._timeout_s * 4), "upload")
        if response.sha256 != digest:
            raise L4MError(f"the spawner stored {response.sha256}, not the {digest} sent")
        return response.sha256

    async def upload_file(self, path: str | Path, tag: str = "") -> str:
        path = Path(path)
        return await self.upload(path.read_bytes(), path.name, tag)

    async def launch(self, program: str, args: Sequence[str] = (), limits: spawner_pb2.Limits | None = None) -> str:
        request = spawner_pb2.LaunchRequest(program=program, args=list(args), limits=limits)
        metadata = call_metadata(traceparent=traceparent_of()[0])
        response = await self._call(self._stub.Launch(request, timeout=self._timeout_s, metadata=metadata), "launch")
        return response.instance_id

    async def attach(self, instance_id: str) -> AsyncIterator[spawner_pb2.AttachResponse]:
        """Every event of the instance, from its start, ending with its exit."""
        call = self._stub.Attach(spawner_pb2.AttachRequest(instance_id=instance_id))
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as error:
            raise L4MError(f"attach failed ({error.code().name}): {error.details()}") from error

    async def send(self, instance_id: str, text: str) -> None:
        request = spawner_pb2.SendMessageRequest(instance_id=instance_id, text=text)
        await self._call(self._stub.SendMessage(request, timeout=self._timeout_s), "send")

    async def terminate(self, instance_id: str) -> None:
        request = spawner_pb2.TerminateRequest(instance_id=instance_id)
        await self._call(self._stub.Terminate(request, timeout=self._timeout_s), "terminate")

    async def list_instances(self) -> list[spawner_pb2.InstanceInfo]:
        response = await self._call(self._stub.ListInstances(spawner_pb2.ListInstancesRequest(),
                                                             timeout=self._timeout_s), "list")
        return list(response.instances)

    async def run(self, path: str | Path, args: Sequence[str] = (),
                  on_event: Callable[[spawner_pb2.AttachResponse], None] | None = None,
                  limits: spawner_pb2.Limits | None = None) -> spawner_pb2.InstanceExit:
        """Upload, launch and attach; calls `on_event` for every event; returns how the instance ended."""
        program = await self.upload_file(path)
        instance_id = await self.launch(program, args, limits)
        async for event in self.attach(instance_id):
            if on_event is not None:
                on_event(event)
            if event.WhichOneof("event") == "exit":
                return event.exit
        raise L4MError(f"the spawner ended the attach stream of {instance_id} without an exit event")

    async def _call(self, awaitable, what: str):  # type: ignore[no-untyped-def]
        try:
            return await awaitable
        except grpc.aio.AioRpcError as error:
            # Only a spawner we could not reach (or that did not answer) is worth asking about; a refusal
            # (a program that is not valid Python, an unknown instance) says itself what is wrong.
            hint = (f" -- is the spawner running at {self.address}?"
                    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "")
            raise L4MError(f"{what} failed ({error.code().name}): {error.details()}{hint}") from error


def exit_status(exit_: spawner_pb2.InstanceExit) -> int:
    """A process exit status for an instance's exit: its own code (the spawner calls a non-zero one a crash),
    3 for a trap, 1 for other ends (a limit, a signal, a terminate)."""
    if exit_.reason == spawner_pb2.EXIT_REASON_EXITED or (exit_.reason == spawner_pb2.EXIT_REASON_CRASHED
                                                          and exit_.exit_code > 0):
        return exit_.exit_code
    if exit_.reason == spawner_pb2.EXIT_REASON_TRAPPED:
        return 3
    return 1


def print_event(event: spawner_pb2.AttachResponse, show_logs: bool = True) -> None:
    """Messages to stdout, log lines to stderr, and an abnormal exit's reason to stderr."""
    kind = event.WhichOneof("event")
    if kind == "message":
        print(event.message.text, flush=True)
    elif kind == "log" and show_logs:
        print(event.log.line, file=sys.stderr, flush=True)
    elif kind == "exit" and event.exit.reason != spawner_pb2.EXIT_REASON_EXITED:
        reason = spawner_pb2.ExitReason.Name(event.exit.reason)
        print(f"l4m: the controller ended: {reason}: {event.exit.message}", file=sys.stderr, flush=True)


async def run_program(spawner_address: str, program: str | Path, args: Sequence[str] = (), echo: bool = True,
                      show_logs: bool = True, limits: spawner_pb2.Limits | None = None) -> int:
    """Upload, launch and attach (printing the events when `echo`); the instance's exit status."""
    async with Client(spawner_address) as client:
        on_event = (lambda e: print_event(e, show_logs)) if echo else None
        exit_ = await client.run(program, args, on_event=on_event, limits=limits)
    return exit_status(exit_)
