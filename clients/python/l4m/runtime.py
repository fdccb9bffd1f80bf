"""What a controller asks of the spawner: user messages, shared variables, child controllers.

`RuntimeClient` speaks `RuntimeService` over the sockets the spawner provides (every call with a
deadline and the instance token): as frames on L4M_RUNTIME_FRAMED_ADDR where the spawner serves them,
gRPC otherwise (and for `watch`). `LocalRuntime` stands in for it during development, when no spawner
runs the controller: messages go to stdout as one parseable line each (`l4m-message: <JSON string>`),
user input comes from stdin lines, shared variables live in this process, and children run in this
process as tasks (each with its own L4M session).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf.message import DecodeError, Message

from l4m.errors import L4MError
from l4m.framed import connect_unix
from l4m.session import call_metadata
from l4m.v1 import spawner_pb2
from l4m.wire import frames, limits
from l4m.wire.status import StatusCode, code_name

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


# Messages a framed runtime has sent that the spawner has not answered yet, before `send` waits for the
# oldest answer: a controller that outruns the spawner holds at most this many in flight.
MAX_UNANSWERED_SENDS = 256
# The spawner's answers: status frames, and call results (a variable's value, within the runtime's limit).
_MAX_ANSWER_BYTES = limits.RUNTIME_MAX_REQUEST_BYTES + 64 * 1024
# How long a call that waits without a timeout of its own (a receive or a child's wait with none) may take.
_UNBOUNDED_WAIT_S = 24 * 3600.0


class FramedRuntime(frames.FrameProtocol):
    """RuntimeService over frames (spawner.proto, "SendToUser over frames"), on the socket the spawner names
    in L4M_RUNTIME_FRAMED_ADDR: every call but WatchVariable.

    `send` queues the message and returns: the messages of one event-loop turn go out in one write, and
    the spawner answers each, in order. A refusal (the output limit used up, an unknown token) fails the
    next `send` and `close`; `close` returns once every message sent is answered, so whatever a
    controller sent before it ends has reached its user before its process exits. `call` sends one
    `FramedRuntimeCall` and waits for its result; a caller that gives up (its deadline, a cancellation)
    cancels it on the spawner too, as gRPC would."""

    def __init__(self, path: str, token: str | None, timeout_s: float = DEFAULT_RUNTIME_TIMEOUT_S,
                 traceparent: str | None = None) -> None:
        super().__init__(_MAX_ANSWER_BYTES)
        self._path = path
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        opening = spawner_pb2.FramedRuntimeOpen(protocol_version=frames.PROTOCOL_VERSION, instance_token=token or "",
                                                traceparent=traceparent or "")
        self._outbox: list[bytes] = [frames.encode(frames.RUNTIME_OPEN, opening)]
        self._flush_scheduled = False
        self._unanswered = 1  # the opening's answer, then one per message
        self._calls: dict[int, asyncio.Future[spawner_pb2.FramedRuntimeResult]] = {}  # by call_id
        self._call_ids = itertools.count(1)
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
        self._queue(frames.encode(frames.SEND_TO_USER, spawner_pb2.SendToUserRequest(text=text)))
        self._unanswered += 1

    async def call(self, method: str, field: str, request: Message, deadline_s: float | None = None) -> Any:
        """`method`'s response (the `field` of FramedRuntimeCall and FramedRuntimeResult it goes in), within
        `deadline_s` (default: the runtime timeout); a status other than OK raises L4MError."""
        if self._error is not None:
            raise self._error
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        self._queue(frames.encode(frames.RUNTIME_CALL, spawner_pb2.FramedRuntimeCall(call_id=call_id,
                                                                                     **{field: request})))
        deadline_s = deadline_s or self._timeout_s
        try:
            result = await asyncio.wait_for(future, deadline_s)
        except TimeoutError:
            self._cancel(call_id)
            raise L4MError(f"runtime call {method} failed (DEADLINE_EXCEEDED): no answer within {deadline_s:g} s") \
                from None
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise
        if result.code != StatusCode.OK:
            raise L4MError(f"runtime call {method} failed ({StatusCode.of(result.code).name}): {result.message}")
        return getattr(result, field)

    async def flush(self) -> None:
        """Returns once every message sent so far is answered (up to the runtime timeout); a refusal raises."""
        try:
            await asyncio.wait_for(self._all_answered(), self._timeout_s)
        except TimeoutError:
            self._fail(f"the spawner did not answer {self._unanswered} messages within {self._timeout_s:g} s")
        if self._error is not None:
            raise self._error

    async def close(self) -> None:
        """`flush`, then closes. The calls still in flight are cancelled, as closing a gRPC channel cancels
        its calls: a task left waiting on one (a `ctx.receive()` the program never awaited, when a trap
        ended its `main`) ends cancelled, not with an exception asyncio would log at exit, whose traceback
        would be the last thing the controller wrote in place of its trap report."""
        try:
            await self.flush()
        finally:
            self._connected.cancel()
            if self.transport is not None:
                self.transport.close()
            calls, self._calls = self._calls, {}
            for future in calls.values():
                future.cancel()
            if self._error is None:  # a call after the close fails at once
                self._error = L4MError("the runtime connection was closed")

    async def _all_answered(self) -> None:
        await asyncio.wait([self._connected])  # (a failed connection set the error; wait raises nothing)
        self._flush()
        while self._error is None and self._unanswered:
            await self._wait()

    def _queue(self, frame: bytes) -> None:
        self._outbox.append(frame)
        if not self._flush_scheduled and self.transport is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _cancel(self, call_id: int) -> None:
        if self._calls.pop(call_id, None) is not None and self._error is None:
            self._queue(frames.encode(frames.RUNTIME_CANCEL, spawner_pb2.FramedRuntimeCancel(call_id=call_id)))

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._outbox and self.transport is not None:
            self.write(self._outbox[0] if len(self._outbox) == 1 else b"".join(self._outbox))
            self._outbox.clear()

    # -- frames.FrameProtocol ------------------------------------------------------------------------------
    def frame_received(self, kind: int, payload: bytes) -> None:
        if kind == frames.RUNTIME_RESULT:
            self._result_received(payload)
            return
        if kind != frames.STATUS:
            self._fail(f"the spawner sent a frame of kind {kind} on the runtime socket")
            return
        code, message = frames.read_status(payload)
        if code != StatusCode.OK:
            self._fail(f"the spawner ended the runtime connection ({code.name}): {message}")
            return
        self._unanswered -= 1
        self._wake()

    def _result_received(self, payload: bytes) -> None:
        try:
            result = spawner_pb2.FramedRuntimeResult.FromString(payload)
        except DecodeError as error:
            self._fail(f"the spawner sent a result that does not parse ({error})")
            return
        future = self._calls.pop(result.call_id, None)  # None: a call its caller gave up on
        if future is not None and not future.done():
            future.set_result(result)

    def stream_ended(self, error: Exception | None) -> None:
        if self._unanswered or self._calls:
            self._fail(f"the spawner closed the runtime socket with {self._unanswered} messages and "
                       f"{len(self._calls)} calls unanswered")

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = L4MError(reason)
        self.end_reading()
        if self.transport is not None:
            self.transport.close()
        self._fail_calls(self._error)
        self._wake()

    def _fail_calls(self, error: L4MError) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        if self._waiter is None or self._waiter.done():
            self._waiter = self._loop.create_future()
        await asyncio.shield(self._waiter)


class RuntimeClient:
    """`RuntimeService` for a controller: over frames where the spawner serves them (`framed_address`:
    L4M_RUNTIME_FRAMED_ADDR), every call but `watch`; otherwise, and for `watch`, over gRPC (the spawner's
    Unix socket), whose channel (and grpc's import) waits for the first call that needs it."""

    def __init__(self, address: str, token: str | None, traceparent: str | None = None,
                 timeout_s: float = DEFAULT_RUNTIME_TIMEOUT_S, framed_address: str | None = None) -> None:
        self._framed_path = frames.framed_path(framed_address) if framed_address else None
        if framed_address and self._framed_path is None:
            raise L4MError(f"L4M_RUNTIME_FRAMED_ADDR {framed_address!r} is not a framed: address")
        self._address = address
        # Opened on the first call that goes over gRPC: a controller whose calls go as frames never starts
        # gRPC's channel and threads, nor imports grpc (docs/benchmarks.md, "Controller memory").
        self._channel: Any = None
        self._runtime_stub: Any = None
        self._metadata = call_metadata(token, traceparent)
        self._timeout_s = timeout_s
        self._token = token
        self._traceparent = traceparent
        self._framed_runtime: FramedRuntime | None = None  # connected on the first call

    @property
    def _stub(self) -> Any:
        if self._runtime_stub is None:
            import grpc

            from l4m.v1 import spawner_pb2_grpc

            self._channel = grpc.aio.insecure_channel(self._address)
            self._runtime_stub = spawner_pb2_grpc.RuntimeServiceStub(self._channel)
        return self._runtime_stub

    @property
    def _framed(self) -> FramedRuntime:
        if self._framed_runtime is None:
            assert self._framed_path is not None
            self._framed_runtime = FramedRuntime(self._framed_path, self._token, self._timeout_s, self._traceparent)
        return self._framed_runtime

    async def _call(self, method: str, field: str, request: Message, timeout_s: float | None = None) -> Any:
        """`method` over frames where the spawner serves them, else over gRPC; L4MError when it fails."""
        if self._framed_path is not None:
            return await self._framed.call(method, field, request, timeout_s)
        stub = self._stub
        try:
            return await getattr(stub, method)(request, timeout=timeout_s or self._timeout_s, metadata=self._metadata)
        except Exception as error:
            code = code_name(error)
            if code is None:
                raise
            raise L4MError(f"runtime call {method} failed ({code}): {error.details()}") from error  # type: ignore[attr-defined]

    async def send(self, text: str) -> None:
        if self._framed_path is None:
            await self._call("SendToUser", "send_to_user", spawner_pb2.SendToUserRequest(text=text))
            return
        await self._framed.send(text)

    async def flush(self) -> None:
        if self._framed_runtime is not None:
            await self._framed_runtime.flush()

    async def receive(self, timeout_s: float | None = None) -> str | None:
        timeout_ms = int(timeout_s * 1000) if timeout_s else 0
        # The call itself may wait as long as the receive does (0 = until the instance ends).
        deadline = (timeout_s + self._timeout_s) if timeout_s else _UNBOUNDED_WAIT_S
        response = await self._call("ReceiveFromUser", "receive_from_user",
                                    spawner_pb2.ReceiveFromUserRequest(timeout_ms=timeout_ms), deadline)
        return response.text if response.received else None

    async def get(self, name: str) -> Variable:
        response = await self._call("GetVariable", "get_variable", spawner_pb2.GetVariableRequest(name=name))
        return Variable(response.exists, response.value, response.version)

    async def set(self, name: str, value: bytes | str) -> int:
        response = await self._call("SetVariable", "set_variable",
                                    spawner_pb2.SetVariableRequest(name=name, value=_to_bytes(value)))
        return response.version

    async def compare_and_set(self, name: str, expected_version: int, value: bytes | str) -> SwapResult:
        request = spawner_pb2.CompareAndSetVariableRequest(name=name, expected_version=expected_version,
                                                           value=_to_bytes(value))
        response = await self._call("CompareAndSetVariable", "compare_and_set_variable", request)
        return SwapResult(response.swapped, response.version, response.value)

    async def append(self, name: str, value: bytes | str) -> int:
        response = await self._call("AppendVariable", "append_variable",
                                    spawner_pb2.AppendVariableRequest(name=name, value=_to_bytes(value)))
        return response.version

    async def watch(self, name: str) -> AsyncIterator[Variable]:
        call = self._stub.WatchVariable(spawner_pb2.WatchVariableRequest(name=name), metadata=self._metadata)
        try:
            async for response in call:
                yield Variable(response.exists, response.value, response.version)
        finally:
            call.cancel()

    async def spawn_child(self, program: str, args: Sequence[str]) -> str:
        response = await self._call("SpawnChild", "spawn_child",
                                    spawner_pb2.SpawnChildRequest(program=program, args=list(args)))
        return response.instance_id

    async def wait_child(self, instance_id: str, timeout_s: float | None = None) -> ChildExit | None:
        timeout_ms = int(timeout_s * 1000) if timeout_s else 0
        deadline = (timeout_s + self._timeout_s) if timeout_s else _UNBOUNDED_WAIT_S
        response = await self._call("WaitChild", "wait_child",
                                    spawner_pb2.WaitChildRequest(instance_id=instance_id, timeout_ms=timeout_ms),
                                    deadline)
        if not response.exited:
            return None
        exit_ = response.exit
        return ChildExit(spawner_pb2.ExitReason.Name(exit_.reason), exit_.exit_code, exit_.message)

    async def close(self) -> None:
        try:
            if self._framed_runtime is not None:
                await self._framed_runtime.close()
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
        import json  # here: local runs only, and an idle controller under a spawner need not hold it

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
