"""The server's side of a framed connection (`l4m.wire.frames`), for the scheduler's framed L4M sessions and
the executors' framed Execute stream: what both listeners do the same way.

- A Unix socket of a given mode, a deep accept queue (many controllers connect at once), every live
  connection known so that `stop` closes them.
- A connection must send its first frame within `open_timeout_s`, else it is refused (DEADLINE_EXCEEDED).
- While what the server wrote to a connection has not drained (the peer does not read), the connection
  is not read either, so a peer that stops reading holds no more than that in the server.
- A refusal is a status frame, then the connection closes (what is buffered is still sent).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError, Message

from l4m.wire import frames

# How long a new connection may take to send its first frame.
OPEN_TIMEOUT_S = 10.0
# Connections the kernel queues before they are accepted (asyncio's default, 100, is less than the
# controllers a spawner starts at once; the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 4096


class FramedServerConnection(frames.FrameProtocol):
    """One accepted connection; a subclass handles its frames and calls `opened` once the first one is in."""

    def __init__(self, listener: FramedListener, max_bytes: int) -> None:
        super().__init__(max_bytes)
        self.listener = listener
        self._open_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.listener.connections.add(self)
        self._open_timer = asyncio.get_running_loop().call_later(self.listener.open_timeout_s, self._open_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.opened()
        self.listener.connections.discard(self)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def opened(self) -> None:
        """The first frame came (or the connection is gone): no open timeout any more."""
        if self._open_timer is not None:
            self._open_timer.cancel()
            self._open_timer = None

    def parse_opening(self, kind: int, payload: bytes, expected_kind: int, message_class: type[Message]) -> Message | None:
        """The first frame as `message_class` when it is of `expected_kind`, parses and names this protocol
        version; otherwise None, the connection refused with why (INVALID_ARGUMENT, FAILED_PRECONDITION)."""
        self.opened()
        name = message_class.DESCRIPTOR.name
        if kind != expected_kind:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, f"the first frame is of kind {kind}, not {name} ({expected_kind})")
            return None
        try:
            opening = message_class.FromString(payload)
        except DecodeError as error:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT, f"the first frame does not parse as {name} ({error})")
            return None
        version = opening.protocol_version  # type: ignore[attr-defined]
        if version != frames.PROTOCOL_VERSION:
            self.refuse(grpc.StatusCode.FAILED_PRECONDITION,
                        f"protocol_version {version[:40]!r} is not {frames.PROTOCOL_VERSION!r}")
            return None
        return opening

    def _open_timed_out(self) -> None:
        self._open_timer = None
        self.refuse(grpc.StatusCode.DEADLINE_EXCEEDED, f"no first frame within {self.listener.open_timeout_s:g} s")

    def refuse(self, code: grpc.StatusCode, message: str) -> None:
        """A status frame saying why, then the connection closes; nothing more of it is read."""
        self.end_reading()
        self.write(frames.status_frame(code, message))
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()  # what is buffered is still sent


class FramedListener:
    """A Unix socket at `path` (made `mode`) whose connections are `factory(listener)`."""

    def __init__(self, path: str, factory: Callable[[FramedListener], FramedServerConnection], mode: int,
                 open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        self.path = os.path.abspath(path)
        self.open_timeout_s = open_timeout_s
        self.connections: set[FramedServerConnection] = set()
        self._factory = factory
        self._mode = mode
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()  # (it replaces a socket file left at `path`, nothing else)
        self._server = await loop.create_unix_server(lambda: self._factory(self), self.path, backlog=LISTEN_BACKLOG)
        os.chmod(self.path, self._mode)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close()
        if self._server is not None:
            await self._server.wait_closed()
