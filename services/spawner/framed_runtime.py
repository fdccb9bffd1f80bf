"""A controller's messages to its user over length-prefixed frames (spawner.proto, "SendToUser over frames";
`l4m.wire.frames`): the socket `<socket_dir>/<runtime_framed_socket_name>` beside the runtime socket.

`RuntimeService.SendToUser` is one gRPC call per message, ~150-400 us of CPU on each side in Python; a
controller streaming tokens sends one per token. Here the first frame opens the connection with the
instance token (the runtime's own check, `InstanceManager.by_token`); every later frame is one
`SendToUserRequest`, published in the callback that read it (`publish_message_nowait`) and answered by a
status frame, in order. A controller sends without waiting for those answers, so the frames of a burst
arrive in one read and cost one wake-up.

Whoever reaches the socket may connect (mode 0666, as the runtime socket: the sandbox uid must), but only
a running instance's token opens a connection, and a connection speaks for that instance alone. An output
limit used up answers RESOURCE_EXHAUSTED, kills the instance (as on gRPC) and stops reading; a frame of
another kind, a payload that does not parse or one over RUNTIME_MAX_REQUEST_BYTES ends the connection with
INVALID_ARGUMENT. While the controller does not read its answers, its connection is not read either.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from l4m.common.framed import OPEN_TIMEOUT_S, FramedListener, FramedServerConnection
from l4m.spawner.instances import Instance, InstanceManager, InstanceNotFound
from l4m.v1 import spawner_pb2
from l4m.wire import frames, limits

_OK_FRAME = frames.status_frame(grpc.StatusCode.OK)
_parse_send = spawner_pb2.SendToUserRequest.FromString


class FramedRuntimeConnection(FramedServerConnection):
    """One controller's connection: its opening, then its messages."""

    def __init__(self, server: FramedRuntimeServer) -> None:
        super().__init__(server, limits.RUNTIME_MAX_REQUEST_BYTES)
        self.manager = server.manager
        self.instance: Instance | None = None
        self._num_acks = 0  # OK answers owed for the messages of the current read, written at its end

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._write_acks()

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        self._write_acks()  # the messages before the refused frame went to the user: their answers first
        super().refuse(code, message)

    def _write_acks(self) -> None:
        if self._num_acks:
            self.write(_OK_FRAME * self._num_acks)
            self._num_acks = 0

    def frame_received(self, kind: int, payload: bytes) -> None:
        instance = self.instance
        if instance is None:
            self._open(kind, payload)
            return
        if kind != frames.SEND_TO_USER:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame of kind {kind} after the opening; only SendToUserRequest ({frames.SEND_TO_USER}) "
                        "frames may follow")
            return
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

    def stream_ended(self, error: Exception | None) -> None:
        if isinstance(error, frames.FrameError):
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        else:
            self.close()  # the controller closed its side: every message it sent has been answered

    def _open(self, kind: int, payload: bytes) -> None:
        opening = self.parse_opening(kind, payload, frames.RUNTIME_OPEN, spawner_pb2.FramedRuntimeOpen)
        if opening is None:
            return
        try:
            self.instance = self.manager.by_token(opening.instance_token)
        except InstanceNotFound:
            self.refuse(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown instance_token")
            return
        self.write(_OK_FRAME)


class FramedRuntimeServer(FramedListener):
    """The framed runtime listener of one spawner."""

    def __init__(self, manager: InstanceManager, path: str, open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        super().__init__(path, lambda _: FramedRuntimeConnection(self), 0o666, open_timeout_s)
        self.manager = manager
