"""A controller's runtime calls over length-prefixed frames (spawner.proto, "SendToUser over frames";
`l4m.wire.frames`): the socket `<socket_dir>/<runtime_framed_socket_name>` beside the runtime socket.

`RuntimeService.SendToUser` is one gRPC call per message, ~150-400 us of CPU on each side in Python; a
controller streaming tokens sends one per token. Here the first frame opens the connection with the
instance token (the runtime's own check, `InstanceManager.by_token`); every later `SendToUserRequest` frame
is published in the callback that read it (`publish_message_nowait`) and answered by a status frame, in
order. A controller sends without waiting for those answers, so the frames of a burst arrive in one read
and cost one wake-up.

Every other RuntimeService call but WatchVariable (a stream) comes as a `FramedRuntimeCall` frame: it runs
as a task through `RuntimeServicer`'s own method (the gRPC servicer's code, errors and status codes, behind
a context that reads this connection's token and traceparent), and its `FramedRuntimeResult` goes back
when it is done, under its call_id. A `FramedRuntimeCancel` stops a call as a gRPC cancellation would; the
connection's end stops them all. A controller that speaks only frames never opens a gRPC channel, nor
imports grpc (docs/benchmarks.md, "Controller memory").

Whoever reaches the socket may connect (mode 0666, as the runtime socket: the sandbox uid must), but only
a running instance's token opens a connection, and a connection speaks for that instance alone. A shared
controller process's token (`FramedRuntimeOpen.process_token`, spawner/shared.py) opens its control
connection instead, once: it carries the instances to start or stop and their reports, nothing else. An output
limit used up answers RESOURCE_EXHAUSTED, kills the instance (as on gRPC) and stops reading; a frame of
another kind, a payload that does not parse, one over RUNTIME_MAX_REQUEST_BYTES, or a call whose call_id is
already in flight ends the connection with INVALID_ARGUMENT. A call that names no request is answered
INVALID_ARGUMENT, and one over MAX_CALLS_IN_FLIGHT RESOURCE_EXHAUSTED: that call alone. While the
controller does not read its answers, its connection is not read either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from l4m.common.framed import OPEN_TIMEOUT_S, FramedListener, FramedServerConnection
from l4m.spawner.instances import Instance, InstanceManager, InstanceNotFound
from l4m.spawner.shared import SharedProcess
from l4m.v1 import spawner_pb2
from l4m.wire import frames, limits
from l4m.wire.metadata import TOKEN_METADATA_KEY

log = logging.getLogger(__name__)

_OK_FRAME = frames.status_frame(grpc.StatusCode.OK)
_parse_send = spawner_pb2.SendToUserRequest.FromString
# A connection's calls running at once (a controller waiting on all its children, the tree's 32 by default,
# and on its user stays well under it); one more is answered RESOURCE_EXHAUSTED.
MAX_CALLS_IN_FLIGHT = 128
# FramedRuntimeCall's request fields -> RuntimeServicer's methods.
_METHODS = {"receive_from_user": "ReceiveFromUser", "get_variable": "GetVariable", "set_variable": "SetVariable",
            "compare_and_set_variable": "CompareAndSetVariable", "append_variable": "AppendVariable",
            "spawn_child": "SpawnChild", "wait_child": "WaitChild"}


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _CallContext:
    """What `RuntimeServicer`'s methods read of a `grpc.aio.ServicerContext`, for a framed call: the
    connection's token and traceparent as its metadata; `abort` raises the status."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


def _result(call_id: int, code: grpc.StatusCode, message: str) -> bytes:
    result = spawner_pb2.FramedRuntimeResult(call_id=call_id, code=frames.status_number(code), message=message)
    return frames.encode(frames.RUNTIME_RESULT, result)


class FramedRuntimeConnection(FramedServerConnection):
    """One controller's connection: its opening, then its messages and calls."""

    def __init__(self, server: FramedRuntimeServer) -> None:
        super().__init__(server, limits.RUNTIME_MAX_REQUEST_BYTES)
        self.manager = server.manager
        self.servicer = server.servicer
        self.instance: Instance | None = None
        self._context: _CallContext | None = None
        self._num_acks = 0  # OK answers owed for the messages of the current read, written at its end
        self.calls: dict[int, asyncio.Task[None]] = {}  # by call_id, while they run
        self.shared: SharedProcess | None = None  # a shared process's control connection (process_token)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._write_acks()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.shared is not None:
            shared, self.shared = self.shared, None
            shared.disconnected()
        for task in self.calls.values():
            task.cancel()  # nobody is left to answer: a waiting receive must not take the next message
        self.calls.clear()
        super().connection_lost(exc)

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        self._write_acks()  # the messages before the refused frame went to the user: their answers first
        super().refuse(code, message)

    def _write_acks(self) -> None:
        if self._num_acks:
            self.write(_OK_FRAME * self._num_acks)
            self._num_acks = 0

    def frame_received(self, kind: int, payload: bytes) -> None:
        instance = self.instance
        if self.shared is not None:
            self._shared_report(self.shared, kind, payload)
        elif instance is None:
            self._open(kind, payload)
        elif kind == frames.SEND_TO_USER:
            self._send_to_user(instance, payload)
        elif kind == frames.RUNTIME_CALL:
            self._start_call(payload)
        elif kind == frames.RUNTIME_CANCEL:
            self._cancel_call(payload)
        else:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame of kind {kind} after the opening; only SendToUserRequest ({frames.SEND_TO_USER}), "
                        f"FramedRuntimeCall ({frames.RUNTIME_CALL}) and FramedRuntimeCancel ({frames.RUNTIME_CANCEL}) "
                        "frames may follow")

    def stream_ended(self, error: Exception | None) -> None:
        if isinstance(error, frames.FrameError):
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        else:
            self.close()  # the controller closed its side: every message it sent has been answered

    def _open(self, kind: int, payload: bytes) -> None:
        opening = self.parse_opening(kind, payload, frames.RUNTIME_OPEN, spawner_pb2.FramedRuntimeOpen)
        if opening is None:
            return
        if opening.process_token:
            self._open_shared(opening.process_token)
            return
        try:
            self.instance = self.manager.by_token(opening.instance_token)
        except InstanceNotFound:
            self.refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown instance_token")
            return
        metadata = [(TOKEN_METADATA_KEY, opening.instance_token)]
        if opening.traceparent:
            metadata.append(("traceparent", opening.traceparent))
        self._context = _CallContext(metadata)
        self.write(_OK_FRAME)

    def _open_shared(self, token: str) -> None:
        shared = self.manager.shared.by_token(token)
        if shared is None or shared.is_connected_once:
            self.refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown process_token")
            return
        self.shared = shared
        self.write(_OK_FRAME)
        shared.connected(self)

    def _shared_report(self, shared: SharedProcess, kind: int, payload: bytes) -> None:
        if kind != frames.SHARED_REPORT:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame of kind {kind} on a shared process's connection; only SharedProcessReport "
                        f"({frames.SHARED_REPORT}) frames may follow its opening")
            return
        why = shared.report(payload)
        if why is not None:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, why)

    def _send_to_user(self, instance: Instance, payload: bytes) -> None:
        try:
            text = _parse_send(payload).text
        except DecodeError as error:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame does not parse as l4m.v1.SendToUserRequest ({error})")
            return
        verdict = instance.supervisor.publish_message_nowait(text)
        if verdict == "published":
            self._num_acks += 1
        elif verdict == "over the limit":
            self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, "the instance's output limit is used up")
        else:
            self.refuse(grpc.StatusCode.FAILED_PRECONDITION, "the instance is no longer running")

    def _parse(self, payload: bytes, message_class: type[Message]) -> Any:
        try:
            return message_class.FromString(payload)
        except DecodeError as error:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame does not parse as l4m.v1.{message_class.DESCRIPTOR.name} ({error})")
            return None

    def _start_call(self, payload: bytes) -> None:
        call = self._parse(payload, spawner_pb2.FramedRuntimeCall)
        if call is None:
            return
        call_id, field = call.call_id, call.WhichOneof("request")
        if call_id in self.calls:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, f"call_id {call_id} is already in flight")
        elif field is None:
            self.write(_result(call_id, grpc.StatusCode.INVALID_ARGUMENT,
                               "a FramedRuntimeCall that names no request (or one this spawner does not know)"))
        elif len(self.calls) >= MAX_CALLS_IN_FLIGHT:
            self.write(_result(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{MAX_CALLS_IN_FLIGHT} calls are in flight on this connection already"))
        else:
            self.calls[call_id] = asyncio.ensure_future(self._serve(call_id, field, getattr(call, field)))

    def _cancel_call(self, payload: bytes) -> None:
        cancel = self._parse(payload, spawner_pb2.FramedRuntimeCancel)
        task = self.calls.pop(cancel.call_id, None) if cancel is not None else None
        if task is not None:
            task.cancel()

    async def _serve(self, call_id: int, field: str, request: Message) -> None:
        """One call through the gRPC servicer's method; its result, unless it was cancelled."""
        try:
            response = await getattr(self.servicer, _METHODS[field])(request, self._context)
            answer = frames.encode(frames.RUNTIME_RESULT, spawner_pb2.FramedRuntimeResult(
                call_id=call_id, **{field: response}))
        except _Aborted as aborted:
            answer = _result(call_id, aborted.code, aborted.details)
        except Exception as error:  # a bug: the caller hears of it as on gRPC (UNKNOWN), the spawner goes on
            log.exception("framed runtime call %s failed", _METHODS[field])
            answer = _result(call_id, grpc.StatusCode.UNKNOWN, f"{type(error).__name__}: {error}")
        if self.calls.get(call_id) is asyncio.current_task():
            del self.calls[call_id]
            self.write(answer)


class FramedRuntimeServer(FramedListener):
    """The framed runtime listener of one spawner; its calls run through `servicer` (a RuntimeServicer of
    `manager`, made here when not given)."""

    def __init__(self, manager: InstanceManager, path: str, open_timeout_s: float = OPEN_TIMEOUT_S,
                 servicer: Any = None) -> None:
        super().__init__(path, lambda _: FramedRuntimeConnection(self), 0o666, open_timeout_s)
        self.manager = manager
        if servicer is None:  # (imported here: server.py imports this module)
            from l4m.spawner.server import RuntimeServicer

            servicer = RuntimeServicer(manager)
        self.servicer = servicer
