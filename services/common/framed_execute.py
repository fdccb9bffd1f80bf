"""The executor's side of the Execute stream over frames (executor.proto, "The Execute stream over
length-prefixed frames"), for the executor and the simulated one alike: each supplies what runs a batch.

The first frame opens the stream with the cluster secret (the same check as the gRPC `Execute`); every
`ExecuteRequest` frame after it is handed to the stream's `BatchRunner` in the callback that read it, and
the replies are written in the order of their batches as they complete (no task per batch or per
stream). While the scheduler does not read its replies, the stream is not read either. The socket is
the operator's only (mode 0600) and the secret is checked anyway: nothing but the scheduler may reach
an executor, whose pages hold every instance's context.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from google.protobuf.message import DecodeError

from l4m.common.framed import OPEN_TIMEOUT_S, FramedListener, FramedServerConnection
from l4m.v1 import executor_pb2
from l4m.wire import frames, limits
from l4m.wire.credentials import secrets_equal

log = logging.getLogger(__name__)

_parse_request = executor_pb2.ExecuteRequest.FromString


class BatchRunner(Protocol):
    """What runs the batches of one stream, opened when the stream is accepted."""

    def run(self, request: executor_pb2.ExecuteRequest) -> Awaitable[executor_pb2.ExecuteResponse | None]:
        """The batch's reply (None: no reply), as a future; batches run in the order they are handed over."""
        ...

    @property
    def is_retired(self) -> bool:
        """True once a Reset retired this stream: it takes no more batches and ends."""
        ...


class FramedExecuteConnection(FramedServerConnection):
    """One scheduler's framed Execute stream."""

    def __init__(self, server: FramedExecuteServer) -> None:
        super().__init__(server, limits.EXECUTOR_MAX_REQUEST_BYTES)
        self.server = server
        self.runner: BatchRunner | None = None
        self._replies: deque[asyncio.Future[executor_pb2.ExecuteResponse | None]] = deque()
        self._finishing = False  # no more batches: close once the last reply is written

    def frame_received(self, kind: int, payload: bytes) -> None:
        runner = self.runner
        if runner is None:
            self._open(kind, payload)
            return
        if runner.is_retired:  # a Reset since this stream opened: what it sends now is dropped
            self._finish()
            return
        if kind != frames.EXECUTE:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a frame of kind {kind} on an Execute stream; only ExecuteRequest ({frames.EXECUTE}) "
                        "frames may follow the opening")
            return
        try:
            request = _parse_request(payload)
        except DecodeError as error:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, f"a frame does not parse as l4m.v1.ExecuteRequest ({error})")
            return
        reply = asyncio.ensure_future(runner.run(request))
        self._replies.append(reply)
        reply.add_done_callback(self._write_replies)

    def stream_ended(self, error: Exception | None) -> None:
        if isinstance(error, frames.FrameError):
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        else:
            self._finish()

    def _write_replies(self, _: object = None) -> None:
        """Writes the replies that are ready, in the order of their batches."""
        replies = self._replies
        while replies and replies[0].done():
            reply = replies.popleft()
            if reply.cancelled():
                continue
            if reply.exception() is not None:  # a runner reports failures as BatchErrors: this is a bug
                log.error("a batch failed outside its runner", exc_info=reply.exception())
                self.refuse(grpc.StatusCode.INTERNAL, f"a batch failed: {reply.exception()}")
                return
            response = reply.result()
            if response is not None:
                self.write(frames.encode(frames.EXECUTED, response))
        if self._finishing and not replies:
            self.close()

    def _finish(self) -> None:
        self.end_reading()
        self._finishing = True
        self._write_replies()

    def _open(self, kind: int, payload: bytes) -> None:
        opening = self.parse_opening(kind, payload, frames.EXECUTE_OPEN, executor_pb2.FramedExecuteOpen)
        if opening is None:
            return
        secret = self.server.cluster_secret
        if secret and not secrets_equal(opening.cluster_secret, secret):
            self.refuse(grpc.StatusCode.UNAUTHENTICATED, "the executor needs the cluster secret in FramedExecuteOpen")
            return
        self.runner = self.server.open_stream()
        self.write(frames.status_frame(grpc.StatusCode.OK))


class FramedExecuteServer(FramedListener):
    """An executor's framed Execute listener on the Unix socket `path`: mode 0600, and the cluster secret
    checked anyway (a connection before the chmod gains nothing)."""

    def __init__(self, path: str, open_stream: Callable[[], BatchRunner], cluster_secret: str = "",
                 open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        super().__init__(path, lambda _: FramedExecuteConnection(self), 0o600, open_timeout_s)
        self.open_stream = open_stream
        self.cluster_secret = cluster_secret
