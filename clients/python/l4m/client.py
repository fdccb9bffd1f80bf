"""The user's side: upload controller programs to a spawner, launch, attach, talk to, and stop them.

`Client.run(path, args)` is `l4m run`: upload (chunked, content-addressed by sha256), launch, and
stream the instance's events until it exits.

Every call carries the user's API key as `authorization: Bearer <key>` (`find_api_key` says where the
CLI finds it), over TLS when a CA file is given. A key the spawner refuses is an `L4MError` that says
so in one line.

Launch carries the caller's current span as `traceparent` metadata (when the caller traces), so the
spawner's `spawner.launch` span and everything under it join the caller's trace.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc

from l4m.errors import L4MError
from l4m.session import call_metadata
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire.credentials import CredentialError, bearer_metadata, open_channel, read_secret_file
from l4m.wire.tracecontext import traceparent_of

CHUNK_BYTES = 1 << 20  # the proto's limit per chunk
DEFAULT_TIMEOUT_S = 30.0


def find_api_key(key_file: str | Path | None = None, environ: dict[str, str] | None = None,
                 default_file: Path | None = None) -> str | None:
    """The API key to send: from `key_file`, else env L4M_API_KEY (the key itself), else the file named by
    env L4M_API_KEY_FILE, else `default_file` (`<state dir>/admin.key`, which `l4m up` writes) if it
    exists; None when there is none (a spawner run with --insecure-local takes that)."""
    environ = dict(os.environ) if environ is None else environ
    path = key_file or environ.get("L4M_API_KEY_FILE")
    if not key_file and environ.get("L4M_API_KEY"):
        return environ["L4M_API_KEY"].strip()
    if not path and default_file is not None and default_file.exists():
        path = default_file
    if not path:
        return None
    try:
        return read_secret_file(Path(path))
    except CredentialError as error:
        raise L4MError(str(error)) from error


class Client:
    """A `SpawnerService` client; every unary call has a deadline and every call carries `api_key`."""

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S, api_key: str | None = None,
                 tls_ca: str | Path | None = None) -> None:
        self.address = address
        try:
            self._channel = open_channel(address, Path(tls_ca) if tls_ca else None)
        except CredentialError as error:
            raise L4MError(str(error)) from error
        self._stub = spawner_pb2_grpc.SpawnerServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = bearer_metadata(api_key) if api_key else ()

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

        response = await self._call(self._stub.UploadProgram(parts(), timeout=self._timeout_s * 4,
                                                             metadata=self._metadata), "upload")
        if response.sha256 != digest:
            raise L4MError(f"the spawner stored {response.sha256}, not the {digest} sent")
        return response.sha256

    async def upload_file(self, path: str | Path, tag: str = "") -> str:
        path = Path(path)
        return await self.upload(path.read_bytes(), path.name, tag)

    async def launch(self, program: str, args: Sequence[str] = (), limits: spawner_pb2.Limits | None = None,
                     detached: bool = False, model: str = "", share_process: bool = False) -> str:
        """Starts an instance, on `model` ("": the cluster's default). One that is not `detached` is ended by
        the spawner when its last Attach stream goes away (or when nobody attaches soon after the launch).
        `share_process`: it may run in one process with this user's other running launches of the program that
        set it (LaunchRequest.share_process: cheaper launches and tokens, one fate)."""
        request = spawner_pb2.LaunchRequest(program=program, args=list(args), limits=limits, detached=detached,
                                            model=model, share_process=share_process)
        metadata = (*call_metadata(traceparent=traceparent_of()[0]), *self._metadata)
        response = await self._call(self._stub.Launch(request, timeout=self._timeout_s, metadata=metadata), "launch")
        return response.instance_id

    async def attach(self, instance_id: str, batch_events: bool = True) -> AsyncIterator[spawner_pb2.AttachResponse]:
        """Every event of the instance, from its start, ending with its exit, one by one (with
        `batch_events` the spawner sends those ready together in one response; they are handed out here
        one by one all the same)."""
        request = spawner_pb2.AttachRequest(instance_id=instance_id, batch_events=batch_events)
        call = self._stub.Attach(request, metadata=self._metadata)
        try:
            async for response in call:
                if response.events:
                    for event in response.events:
                        yield event
                else:
                    yield response
        except grpc.aio.AioRpcError as error:
            raise self._error(error, "attach") from error
        finally:
            call.cancel()  # a consumer that stops early (Ctrl-C) ends the stream, so the spawner sees it

    async def send(self, instance_id: str, text: str) -> None:
        request = spawner_pb2.SendMessageRequest(instance_id=instance_id, text=text)
        await self._call(self._stub.SendMessage(request, timeout=self._timeout_s, metadata=self._metadata), "send")

    async def terminate(self, instance_id: str) -> None:
        request = spawner_pb2.TerminateRequest(instance_id=instance_id)
        await self._call(self._stub.Terminate(request, timeout=self._timeout_s, metadata=self._metadata),
                         "terminate")

    async def list_instances(self) -> list[spawner_pb2.InstanceInfo]:
        response = await self._call(self._stub.ListInstances(spawner_pb2.ListInstancesRequest(),
                                                             timeout=self._timeout_s, metadata=self._metadata),
                                    "list")
        return list(response.instances)

    async def follow(self, instance_id: str,
                     on_event: Callable[[spawner_pb2.AttachResponse], None] | None = None) -> spawner_pb2.InstanceExit:
        """Attach and call `on_event` for every event; returns how the instance ended."""
        async for event in self.attach(instance_id):
            if on_event is not None:
                on_event(event)
            if event.WhichOneof("event") == "exit":
                return event.exit
        raise L4MError(f"the spawner ended the attach stream of {instance_id} without an exit event")

    async def run(self, path: str | Path, args: Sequence[str] = (),
                  on_event: Callable[[spawner_pb2.AttachResponse], None] | None = None,
                  limits: spawner_pb2.Limits | None = None, model: str = "",
                  share_process: bool = False) -> spawner_pb2.InstanceExit:
        """Upload, launch and attach; calls `on_event` for every event; returns how the instance ended."""
        program = await self.upload_file(path)
        instance_id = await self.launch(program, args, limits, model=model, share_process=share_process)
        return await self.follow(instance_id, on_event)

    async def _call(self, awaitable, what: str):  # type: ignore[no-untyped-def]
        try:
            return await awaitable
        except grpc.aio.AioRpcError as error:
            raise self._error(error, what) from error

    def _error(self, error: grpc.aio.AioRpcError, what: str) -> L4MError:
        if error.code() is grpc.StatusCode.UNAUTHENTICATED:
            return L4MError(f"the spawner refused the API key (UNAUTHENTICATED): {error.details()} -- give one "
                            f"with --api-key-file or L4M_API_KEY (`l4m keys add NAME` makes one)")
        # Only a spawner we could not reach (or that did not answer) is worth asking about; a refusal
        # (a program that is not valid Python, an unknown instance) says itself what is wrong.
        hint = (f" -- is the spawner running at {self.address}?"
                if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else "")
        return L4MError(f"{what} failed ({error.code().name}): {error.details()}{hint}")


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
                      show_logs: bool = True, limits: spawner_pb2.Limits | None = None,
                      api_key: str | None = None, tls_ca: str | Path | None = None, model: str = "",
                      share_process: bool = False) -> int:
    """Upload, launch and attach (printing the events when `echo`); the instance's exit status."""
    async with Client(spawner_address, api_key=api_key, tls_ca=tls_ca) as client:
        on_event = (lambda e: print_event(e, show_logs)) if echo else None
        exit_ = await client.run(program, args, on_event=on_event, limits=limits, model=model,
                                 share_process=share_process)
    return exit_status(exit_)


async def launch_detached(spawner_address: str, program: str | Path, args: Sequence[str] = (),
                          limits: spawner_pb2.Limits | None = None, api_key: str | None = None,
                          tls_ca: str | Path | None = None, model: str = "", share_process: bool = False) -> str:
    """Upload and launch an instance that runs on without a client; its id."""
    async with Client(spawner_address, api_key=api_key, tls_ca=tls_ca) as client:
        return await client.launch(await client.upload_file(program), args, limits, detached=True, model=model,
                                   share_process=share_process)


async def attach_program(spawner_address: str, instance_id: str, show_logs: bool = True,
                         api_key: str | None = None, tls_ca: str | Path | None = None) -> int:
    """Stream an instance's events (from its start) until it exits; its exit status."""
    async with Client(spawner_address, api_key=api_key, tls_ca=tls_ca) as client:
        exit_ = await client.follow(instance_id, lambda e: print_event(e, show_logs))
    return exit_status(exit_)
