"""The SDK's end of a framed L4M session (`framed:PATH` addresses; `l4m.wire.frames`, l4m.proto "L4M
sessions over length-prefixed frames").

`FramedStub` has the two methods `Session` needs of an `L4MServiceStub` (`GetInfo`, `Session`), and
`FramedCall` the grpc.aio stream-call interface (`initial_metadata`, `write`, `read`, `done_writing`,
`cancel`), so the session code is the same on both transports; a refusal or a trap's status is raised as
a `grpc.aio.AioRpcError` carrying the status the scheduler sent, as on gRPC.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence
from typing import Any

import grpc

from l4m.v1 import l4m_pb2
from l4m.wire import frames, limits
from l4m.wire.metadata import TOKEN_METADATA_KEY


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _status_error(payload: bytes) -> grpc.aio.AioRpcError | None:
    """The error a status frame says, None for OK."""
    status = l4m_pb2.FramedSessionStatus.FromString(payload)
    if status.code == 0:
        return None
    return _rpc_error(frames.STATUS_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)


class FramedCall:
    """One framed session; connects (and opens the session) on first use."""

    def __init__(self, path: str, metadata: Sequence[tuple[str, str]]) -> None:
        values = dict(metadata)
        self._opening = l4m_pb2.FramedSessionOpen(protocol_version=frames.PROTOCOL_VERSION,
                                                  instance_token=values.get(TOKEN_METADATA_KEY, ""),
                                                  traceparent=values.get("traceparent", ""))
        self._path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._connected = asyncio.ensure_future(self._connect())
        self._ended = False

    async def _connect(self) -> None:
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self._path)
        except OSError as error:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"cannot connect to framed:{self._path}: {error}") from None
        self._writer.write(frames.encode(frames.OPEN, self._opening))
        frame = await self._read_frame()
        if frame is None or frame[0] != frames.STATUS:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler did not answer the framed session's opening")
        error = _status_error(frame[1])
        if error is not None:
            raise error

    async def _read_frame(self) -> tuple[int, bytes] | None:
        assert self._reader is not None
        try:
            return await frames.read_frame(self._reader, limits.MAX_RESPONSE_BYTES)
        except (frames.FrameError, ConnectionError) as error:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"the framed session broke: {error}") from None

    async def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        await self._connected
        return ()

    async def write(self, request: l4m_pb2.SessionRequest) -> None:
        await self._connected
        assert self._writer is not None
        self._writer.write(frames.encode(frames.REQUEST, request))
        await self._writer.drain()

    async def read(self) -> Any:
        """The next event; `grpc.aio.EOF` once the scheduler ended the session with OK."""
        await self._connected
        if self._ended:
            return grpc.aio.EOF
        frame = await self._read_frame()
        if frame is None:
            self._ended = True
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler closed the framed session without a status")
        kind, payload = frame
        if kind == frames.RESPONSE:
            return l4m_pb2.SessionResponse.FromString(payload)
        if kind == frames.STATUS:
            self._ended = True
            error = _status_error(payload)
            if error is not None:
                raise error
            return grpc.aio.EOF
        raise _rpc_error(grpc.StatusCode.INTERNAL, f"the scheduler sent a frame of kind {kind} on an open session")

    async def done_writing(self) -> None:
        await self._connected
        assert self._writer is not None
        if self._writer.can_write_eof():
            self._writer.write_eof()

    def cancel(self) -> bool:
        self._connected.cancel()
        if self._writer is not None:
            self._writer.close()
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
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"cannot connect to framed:{self.path}: {error}") from None
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
                raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"GetInfo on framed:{self.path}: {error}") from None


def _info_from(frame: tuple[int, bytes] | None) -> l4m_pb2.GetInfoResponse:
    if frame is not None and frame[0] == frames.INFO:
        return l4m_pb2.GetInfoResponse.FromString(frame[1])
    if frame is not None and frame[0] == frames.STATUS:
        error = _status_error(frame[1])
        if error is not None:
            raise error
    raise _rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler did not answer GetInfo")
