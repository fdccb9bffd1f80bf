"""What a controller asks of the spawner: user messages, shared variables, child controllers.

`RuntimeClient` speaks `RuntimeService` over the socket the spawner provides (every call with a
deadline and the instance token). `LocalRuntime` stands in for it during development, when no spawner
runs the controller: messages go to stdout as one parseable line each (`l4m-message: <JSON string>`),
user input comes from stdin lines, shared variables live in this process, and children run in this
process as tasks (each with its own L4M session).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from l4m.errors import L4MError
from l4m.framed import connect_unix
from l4m.session import call_metadata
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire import frames

MESSAGE_PREFIX = "l4m-message: "
DEFAULT_RUNTIME_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Variable:
    """A shared variable's state; `version` is 0 when it does not exist, and grows with every write."""

    exists: bool
    value: bytes
    version: int

    @property
    def text(self) -> str:
        return self.value.decode()


@dataclass(frozen=True)
class SwapResult:
    swapped: bool
    version: int
    value: bytes


@dataclass(frozen=True)
class ChildExit:
    """How a child ended: `reason` is an `ExitReason` name such as "EXIT_REASON_EXITED"."""

    reason: str
    exit_code: int
    message: str

    @property
    def is_success(self) -> bool:
        return self.reason == "EXIT_REASON_EXITED" and self.exit_code == 0


def _to_bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class Runtime(Protocol):
    async def send(self, text: str) -> None: ...
    async def flush(self) -> None: ...
    async def receive(self, timeout_s: float | None = None) -> str | None: ...
    async def get(self, name: str) -> Variable: ...
    async def set(self, name: str, value: bytes | str) -> int: ...
    async def compare_and_set(self, name: str, expected_version: int, value: bytes | str) -> SwapResult: ...
    async def append(self, name: str, value: bytes | str) -> int: ...
    def watch(self, name: str) -> AsyncIterator[Variable]: ...
    async def spawn_child(self, program: str, args: Sequence[str]) -> str: ...
    async def wait_child(self, instance_id: str, timeout_s: float | None = None) -> ChildExit | None: ...
    async def close(self) -> None: ...


# Messages a framed sender has sent that the spawner has not answered yet, before `send` waits for the
# oldest answer: a controller that outruns the spawner holds at most this many in flight.
MAX_UNANSWERED_SENDS = 256
# The spawner's answers are status frames: small.
_MAX_ANSWER_BYTES = 64 * 1024


class FramedSender(frames.FrameProtocol):
    """`SendToUser` over frames (spawner.proto, "SendToUser over frames"), on the socket the spawner names
    in L4M_RUNTIME_FRAMED_ADDR.

    `send` queues the message and returns: the messages of one event-loop turn go out in one write, and
    the spawner answers each, in order. A refusal (the output limit used up, an unknown token) fails the
    next `send` and `close`; `close` returns once every message sent is answered, so whatever a
    controller sent before it ends has reached its user before its process exits."""

    def __init__(self, path: str, token: str | None, timeout_s: float = DEFAULT_RUNTIME_TIMEOUT_S) -> None:
        super().__init__(_MAX_ANSWER_BYTES)
        self._path = path
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        opening = spawner_pb2.FramedRuntimeOpen(protocol_version=frames.PROTOCOL_VERSION, instance_token=token or "")
        self._outbox: list[bytes] = [frames.encode(frames.RUNTIME_OPEN, opening)]
        self._flush_scheduled = False
        self._unanswered = 1  # the opening's answer, then one per message
        self._error: L4MError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._connected = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            await connect_unix(self._loop, lambda: self, self._path)
        except OSError as error:
            self._fail(f"cannot connect to framed:{self._path}: {error}")
            return
        self._flush()

    async def send(self, text: str) -> None:
        while self._error is None and self._unanswered > MAX_UNANSWERED_SENDS:
            await self._wait()
        if self._error is not None:
            raise self._error
        self._outbox.append(frames.encode(frames.SEND_TO_USER, spawner_pb2.SendToUserRequest(text=text)))
        self._unanswered += 1
        if not self._flush_scheduled and self.transport is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    async def flush(self) -> None:
        """Returns once every message sent so far is answered (up to the runtime timeout); a refusal raises."""
        try:
            await asyncio.wait_for(self._all_answered(), self._timeout_s)
        except TimeoutError:
            self._fail(f"the spawner did not answer {self._unanswered} messages within {self._timeout_s:g} s")
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """`flush`, then closes."""
        try:
            await self.flush()
        finally:
            self._connected.cancel()
            if self.transport is not None:
                self.transport.close()

    async def _all_answered(self) -> None:
        await asyncio.wait([self._connected])  # (a failed connection set the error; wait raises nothing)
        self._flush()
        while self._error is None and self._unanswered:
            await self._wait()

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._outbox and self.transport is not None:
            self.write(self._outbox[0] if len(self._outbox) == 1 else b"".join(self._outbox))
            self._outbox.clear()

    # -- frames.FrameProtocol ------------------------------------------------------------------------------
    def frame_received(self, kind: int, payload: bytes) -> None:
        if kind != frames.STATUS:
            self._fail(f"the spawner sent a frame of kind {kind} on the message socket")
            return
        code, message = frames.parse_status(payload)
        if code != grpc.StatusCode.OK:
            self._fail(f"runtime call SendToUser failed ({code.name}): {message}")
            return
        self._unanswered -= 1
        self._wake()

    def stream_ended(self, error: Exception | None) -> None:
        if self._unanswered:
            self._fail(f"the spawner closed the message socket with {self._unanswered} messages unanswered")

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = L4MError(reason)
        self.end_reading()
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        if self._waiter is None or self._waiter.done():
            self._waiter = self._loop.create_future()
        await asyncio.shield(self._waiter)


class RuntimeClient:
    """`RuntimeService` over gRPC (the spawner's Unix socket); user messages as frames where the spawner
    serves them (`framed_address`: L4M_RUNTIME_FRAMED_ADDR)."""

    def __init__(self, address: str, token: str | None, traceparent: str | None = None,
                 timeout_s: float = DEFAULT_RUNTIME_TIMEOUT_S, framed_address: str | None = None) -> None:
        self._framed_path = frames.framed_path(framed_address) if framed_address else None
        if framed_address and self._framed_path is None:
            raise L4MError(f"L4M_RUNTIME_FRAMED_ADDR {framed_address!r} is not a framed: address")
        self._address = address
        # Opened on the first RuntimeService call: a controller whose messages go as frames and that
        # makes no other call never starts gRPC's channel and threads (docs/benchmarks.md, "Controller
        # memory").
        self._channel: grpc.aio.Channel | None = None
        self._runtime_stub: spawner_pb2_grpc.RuntimeServiceStub | None = None
        self._metadata = call_metadata(token, traceparent)
        self._timeout_s = timeout_s
        self._token = token
        self._sender: FramedSender | None = None  # connected on the first message

    @property
    def _stub(self) -> spawner_pb2_grpc.RuntimeServiceStub:
        if self._runtime_stub is None:
            self._channel = grpc.aio.insecure_channel(self._address)
            self._runtime_stub = spawner_pb2_grpc.RuntimeServiceStub(self._channel)
        return self._runtime_stub

    async def _call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s or self._timeout_s,
                                                     metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            raise L4MError(f"runtime call {method} failed ({error.code().name}): {error.details()}") from error

    async def send(self, text: str) -> None:
        if self._framed_path is None:
            await self._call("SendToUser", spawner_pb2.SendToUserRequest(text=text))
            return
        if self._sender is None:
            self._sender = FramedSender(self._framed_path, self._token, self._timeout_s)
        await self._sender.send(text)

    async def flush(self) -> None:
        if self._sender is not None:
            await self._sender.flush()

    async def receive(self, timeout_s: float | None = None) -> str | None:
        timeout_ms = int(timeout_s * 1000) if timeout_s else 0
        # The call itself may wait as long as the receive does (0 = until the instance ends).
        deadline = (timeout_s + self._timeout_s) if timeout_s else 24 * 3600.0
        response = await self._call("ReceiveFromUser", spawner_pb2.ReceiveFromUserRequest(timeout_ms=timeout_ms), deadline)
        return response.text if response.received else None

    async def get(self, name: str) -> Variable:
        response = await self._call("GetVariable", spawner_pb2.GetVariableRequest(name=name))
        return Variable(response.exists, response.value, response.version)

    async def set(self, name: str, value: bytes | str) -> int:
        response = await self._call("SetVariable", spawner_pb2.SetVariableRequest(name=name, value=_to_bytes(value)))
        return response.version

    async def compare_and_set(self, name: str, expected_version: int, value: bytes | str) -> SwapResult:
        request = spawner_pb2.CompareAndSetVariableRequest(name=name, expected_version=expected_version,
                                                           value=_to_bytes(value))
        response = await self._call("CompareAndSetVariable", request)
        return SwapResult(response.swapped, response.version, response.value)

    async def append(self, name: str, value: bytes | str) -> int:
        response = await self._call("AppendVariable", spawner_pb2.AppendVariableRequest(name=name, value=_to_bytes(value)))
        return response.version

    async def watch(self, name: str) -> AsyncIterator[Variable]:
        call = self._stub.WatchVariable(spawner_pb2.WatchVariableRequest(name=name), metadata=self._metadata)
        try:
            async for response in call:
                yield Variable(response.exists, response.value, response.version)
        finally:
            call.cancel()

    async def spawn_child(self, program: str, args: Sequence[str]) -> str:
        response = await self._call("SpawnChild", spawner_pb2.SpawnChildRequest(program=program, args=list(args)))
        return response.instance_id

    async def wait_child(self, instance_id: str, timeout_s: float | None = None) -> ChildExit | None:
        timeout_ms = int(timeout_s * 1000) if timeout_s else 0
        deadline = (timeout_s + self._timeout_s) if timeout_s else 24 * 3600.0
        response = await self._call("WaitChild", spawner_pb2.WaitChildRequest(instance_id=instance_id,
                                                                             timeout_ms=timeout_ms), deadline)
        if not response.exited:
            return None
        exit_ = response.exit
        return ChildExit(spawner_pb2.ExitReason.Name(exit_.reason), exit_.exit_code, exit_.message)

    async def close(self) -> None:
        try:
            if self._sender is not None:
                await self._sender.close()
        finally:
            if self._channel is not None:
                await self._channel.close()


class LocalVariables:
    """Versioned variables with compare-and-set, shared by a local launch tree."""

    def __init__(self) -> None:
        self._values: dict[str, Variable] = {}
        self._changed = asyncio.Condition()

    def get(self, name: str) -> Variable:
        return self._values.get(name, Variable(False, b"", 0))

    async def write(self, name: str, value: bytes, expected_version: int | None = None, append: bool = False) -> SwapResult:
        async with self._changed:
            current = self.get(name)
            if expected_version is not None and current.version != expected_version:
                return SwapResult(False, current.version, current.value)
            new_value = current.value + value if append else value
            self._values[name] = Variable(True, new_value, current.version + 1)
            self._changed.notify_all()
            return SwapResult(True, current.version + 1, new_value)

    async def watch(self, name: str) -> AsyncIterator[Variable]:
        last_version = -1
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda seen=last_version: self.get(name).version != seen)
                current = self.get(name)
            last_version = current.version
            yield current


ChildLauncher = Callable[[str, Sequence[str], "LocalRuntime"], Awaitable[ChildExit]]


class LocalRuntime:
    """The development stand-in for the spawner (see the module docstring)."""

    def __init__(self, instance_id: str = "local", variables: LocalVariables | None = None,
                 launch_child: ChildLauncher | None = None) -> None:
        self.instance_id = instance_id
        self._variables = variables or LocalVariables()
        self._launch_child = launch_child
        self._children: dict[str, asyncio.Task[ChildExit]] = {}
        self._num_children = 0

    async def send(self, text: str) -> None:
        prefix = MESSAGE_PREFIX if self.instance_id == "local" else f"l4m-message[{self.instance_id}]: "
        print(prefix + json.dumps(text), flush=True)

    async def flush(self) -> None:
        """Nothing to wait for: `send` printed and flushed already."""

    async def receive(self, timeout_s: float | None = None) -> str | None:
        try:
            line = await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), timeout_s)
        except TimeoutError:
            return None
        return line.rstrip("\n") if line else None

    async def get(self, name: str) -> Variable:
        return self._variables.get(name)

    async def set(self, name: str, value: bytes | str) -> int:
        return (await self._variables.write(name, _to_bytes(value))).version

    async def compare_and_set(self, name: str, expected_version: int, value: bytes | str) -> SwapResult:
        return await self._variables.write(name, _to_bytes(value), expected_version=expected_version)

    async def append(self, name: str, value: bytes | str) -> int:
        return (await self._variables.write(name, _to_bytes(value), append=True)).version

    def watch(self, name: str) -> AsyncIterator[Variable]:
        return self._variables.watch(name)

    async def spawn_child(self, program: str, args: Sequence[str]) -> str:
        if self._launch_child is None:
            raise L4MError("spawning children needs the spawner (`l4m run`) or `python -m l4m.controller`")
        self._num_children += 1
        child_id = f"{self.instance_id}.{self._num_children}"
        child_runtime = LocalRuntime(child_id, self._variables, self._launch_child)
        self._children[child_id] = asyncio.create_task(self._launch_child(program, list(args), child_runtime))
        return child_id

    async def wait_child(self, instance_id: str, timeout_s: float | None = None) -> ChildExit | None:
        task = self._children.get(instance_id)
        if task is None:
            raise L4MError(f"no child {instance_id!r} of this instance")
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            return None

    async def close(self) -> None:
        for task in self._children.values():
            task.cancel()
        await asyncio.gather(*self._children.values(), return_exceptions=True)
