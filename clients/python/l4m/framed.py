"""The SDK's end of a framed L4M session (`framed:PATH` addresses; `l4m.wire.frames`, l4m.proto "L4M
sessions over length-prefixed frames").

`FramedStub` has the two methods `Session` needs of an `L4MServiceStub` (`GetInfo`, `Session`), and
`FramedCall` the grpc.aio stream-call interface (`initial_metadata`, `write`, `read`, `done_writing`,
`cancel`) plus a direct one without tasks (`attach`, `send_nowait`) that `Session` uses; a refusal or a
trap's status is a `l4m.wire.status.StatusError` carrying the status the scheduler sent (`code()`,
`details()`, as grpc's AioRpcError), and the end of a stream `l4m.wire.status.EOF`: nothing here imports
grpc (docs/benchmarks.md, "Controller memory").
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from l4m.v1 import l4m_pb2
from l4m.wire import frames, limits
from l4m.wire.metadata import MODEL_METADATA_KEY, TOKEN_METADATA_KEY
from l4m.wire.status import EOF, StatusCode, StatusError


def _status_error(payload: bytes) -> StatusError | None:
    """The error a status frame says, None for OK."""
    code, message = frames.read_status(payload)
    return None if code == StatusCode.OK else StatusError(code, message)


P = TypeVar("P", bound=asyncio.BaseProtocol)

# A Unix socket whose accept queue is full refuses a connect with EAGAIN at once (where TCP would wait):
# many controllers starting together retry for up to this long.
CONNECT_RETRY_S = 5.0


async def connect_unix(loop: asyncio.AbstractEventLoop, factory: Callable[[], P], path: str) -> P:
    """`factory()`'s protocol connected to the Unix socket `path`, retrying a full accept queue."""
    deadline, delay_s = loop.time() + CONNECT_RETRY_S, 0.001
    while True:
        try:
            _, protocol = await loop.create_unix_connection(factory, path)
            return protocol
        except BlockingIOError:
            if loop.time() + delay_s > deadline:
                raise
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.1)


class _Connection(frames.FrameProtocol):
    """The framed connection of one call; hands frames and the stream's end to it."""

    def __init__(self, call: FramedCall) -> None:
        super().__init__(limits.MAX_RESPONSE_BYTES)
        self.call = call

    def frame_received(self, kind: int, payload: bytes) -> None:
        self.call._frame_received(kind, payload)

    def stream_ended(self, error: Exception | None) -> None:
        detail = f": {error}" if error is not None else ""
        self.call._end(StatusError(StatusCode.UNAVAILABLE,
                                   f"the scheduler closed the framed session without a status{detail}"))


class FramedCall:
    """One framed session; connects on creation and opens the session with its first frame.

    Two ways to use it. The grpc.aio stream-call interface (`write`, `read`, ...) for code written for
    both transports; and the direct one `Session` uses on this transport, without a task per direction:
    `attach(on_response, on_end)` has every event handed over in the callback that read it, and
    `send_nowait` queues a request. The requests queued within one turn of the event loop are written
    together, one system call, so a fork group's steps reach the scheduler as one read.
    """

    def __init__(self, path: str, metadata: Sequence[tuple[str, str]]) -> None:
        values = dict(metadata)
        opening = l4m_pb2.FramedSessionOpen(protocol_version=frames.PROTOCOL_VERSION,
                                            instance_token=values.get(TOKEN_METADATA_KEY, ""),
                                            traceparent=values.get("traceparent", ""),
                                            model=values.get(MODEL_METADATA_KEY, ""))
        self._path = path
        self._loop = asyncio.get_running_loop()
        # The opening goes first; the requests queued before the connection is up follow it at once (the
        # scheduler drops them if it refuses the session, and says why in the status frame).
        self._outbox: list[bytes] = [frames.encode(frames.OPEN, opening)]
        self._flush_scheduled = False
        self._connection: _Connection | None = None
        self._opened = False  # the scheduler's OK to the opening came
        self._ended: Any = None  # EOF or the StatusError the session ended with
        self._responses: deque[l4m_pb2.SessionResponse] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._on_response: Callable[[l4m_pb2.SessionResponse], None] | None = None
        self._on_end: Callable[[Any], None] | None = None
        self._connected = asyncio.ensure_future(self._connect())

    async def _connect(self) -> None:
        try:
            self._connection = await connect_unix(self._loop, lambda: _Connection(self), self._path)
        except OSError as error:
            self._end(StatusError(StatusCode.UNAVAILABLE, f"cannot connect to framed:{self._path}: {error}"))
            return
        self._flush()

    # -- the direct interface ----------------------------------------------------------------------------
    def attach(self, on_response: Callable[[l4m_pb2.SessionResponse], None], on_end: Callable[[Any], None]) -> None:
        """Every event from now on goes to `on_response`, and the end (EOF or the StatusError)
        to `on_end`, each called once, from the callback that read it."""
        self._on_response, self._on_end = on_response, on_end
        while self._responses:
            on_response(self._responses.popleft())
        if self._ended is not None:
            on_end(self._ended)

    def send_nowait(self, request: l4m_pb2.SessionRequest) -> None:
        if self._ended is not None:
            return  # the end is reported to the reader
        self._outbox.append(frames.encode(frames.REQUEST, request))
        if not self._flush_scheduled and self._connection is not None:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outbox = self._outbox
        if outbox and self._connection is not None:
            self._connection.write(outbox[0] if len(outbox) == 1 else b"".join(outbox))
            outbox.clear()

    # -- what the connection hands over ------------------------------------------------------------------
    def _frame_received(self, kind: int, payload: bytes) -> None:
        if kind == frames.RESPONSE and self._opened:
            response = l4m_pb2.SessionResponse.FromString(payload)
            if self._on_response is not None:
                self._on_response(response)
            else:
                self._responses.append(response)
                self._wake()
        elif kind == frames.STATUS:
            error = _status_error(payload)
            if error is None and not self._opened:
                self._opened = True  # the session is open
                self._wake()
            else:
                self._end(EOF if error is None else error)
        else:
            self._end(StatusError(StatusCode.INTERNAL if self._opened else StatusCode.UNAVAILABLE,
                                  f"the scheduler sent a frame of kind {kind} "
                                  + ("on an open session" if self._opened else "before answering the opening")))

    def _end(self, result: Any) -> None:
        if self._ended is not None:
            return
        self._ended = result
        if self._connection is not None:
            self._connection.end_reading()
            if self._connection.transport is not None:
                self._connection.transport.close()
        if self._on_end is not None:
            self._on_end(result)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        """Until the next frame or the end (one future for every waiter: `read` and `initial_metadata` may
        wait at once)."""
        if self._waiter is None or self._waiter.done():
            self._waiter = self._loop.create_future()
        await asyncio.shield(self._waiter)

    # -- the grpc.aio stream-call interface ----------------------------------------------------------------
    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        while not self._opened and self._ended is None:
            await self._wait()
        if not self._opened and self._ended is not EOF:
            raise self._ended
        return ()

    async def write(self, request: l4m_pb2.SessionRequest) -> None:
        self.send_nowait(request)
        if self._connection is not None:
            await self._connection.drain()

    async def read(self) -> Any:
        """The next event; `EOF` once the scheduler ended the session with OK."""
        while not self._responses and self._ended is None:
            await self._wait()
        if self._responses:
            return self._responses.popleft()
        if self._ended is EOF:
            return EOF
        raise self._ended

    async def done_writing(self) -> None:
        await self._connected
        self._flush()
        connection = self._connection
        if connection is not None and connection.transport is not None and connection.transport.can_write_eof() \
                and not connection.transport.is_closing():
            connection.transport.write_eof()

    def cancel(self) -> bool:
        self._connected.cancel()
        if self._connection is not None and self._connection.transport is not None:
            self._connection.transport.close()
        return True


class FramedStub:
    """`GetInfo` and `Session` over framed sessions on the Unix socket `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def Session(self, metadata: Sequence[tuple[str, str]] = ()) -> FramedCall:  # noqa: N802 (gRPC's name)
        return FramedCall(self.path, metadata)

    async def GetInfo(self, request: l4m_pb2.GetInfoRequest, timeout: float | None = None,  # noqa: N802
                      metadata: Any = None) -> l4m_pb2.GetInfoResponse:
        return await asyncio.wait_for(self._get_info(request), timeout)

    async def _get_info(self, request: l4m_pb2.GetInfoRequest) -> l4m_pb2.GetInfoResponse:
        try:
            reader, writer = await asyncio.open_unix_connection(self.path)
        except OSError as error:
            raise StatusError(StatusCode.UNAVAILABLE, f"cannot connect to framed:{self.path}: {error}") from None
        try:
            writer.write(frames.encode(frames.GET_INFO, request))
            frame = await frames.read_frame(reader, limits.MAX_RESPONSE_BYTES)
        finally:
            writer.close()
        return _info_from(frame)

    def get_info_blocking(self, request: l4m_pb2.GetInfoRequest, timeout: float, metadata: Any = None
                          ) -> l4m_pb2.GetInfoResponse:
        """GetInfo for synchronous code (a blocking socket of its own)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(self.path)
                sock.sendall(frames.encode(frames.GET_INFO, request))
                with sock.makefile("rb") as stream:
                    header = stream.read(frames.HEADER.size)
                    if len(header) < frames.HEADER.size:
                        return _info_from(None)
                    size, kind = frames.parse_header(header, limits.MAX_RESPONSE_BYTES)
                    return _info_from((kind, stream.read(size)))
            except (OSError, frames.FrameError) as error:
                raise StatusError(StatusCode.UNAVAILABLE, f"GetInfo on framed:{self.path}: {error}") from None


def _info_from(frame: tuple[int, bytes] | None) -> l4m_pb2.GetInfoResponse:
    if frame is not None and frame[0] == frames.INFO:
        return l4m_pb2.GetInfoResponse.FromString(frame[1])
    if frame is not None and frame[0] == frames.STATUS:
        error = _status_error(frame[1])
        if error is not None:
            raise error
    raise StatusError(StatusCode.UNAVAILABLE, "the scheduler did not answer GetInfo")
