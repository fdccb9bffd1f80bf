"""Framed L4M sessions: the frame format both ends speak (l4m.proto, "L4M sessions over length-prefixed
frames"; docs/protocol.md). A frame is a 4-byte little-endian payload length, a 1-byte kind, the payload.

The same `SessionRequest` / `SessionResponse` messages as on gRPC, on a plain Unix stream socket: in
Python a gRPC message costs ~150-420 us of CPU on each side, a frame ~35-170 (`bench/transport.py`).

Both ends read with `FrameProtocol` (an asyncio protocol: every frame that one read brings in is handled in
that one callback, with no task hop per frame) and `FrameDecoder` (the parsing, fed arbitrary pieces).
Several frames written together arrive together: that is how a controller sends a fork group's steps in
one message, and the scheduler handles them in order, in one wake-up.
"""

from __future__ import annotations

import asyncio
import struct
from typing import TYPE_CHECKING, Any

from google.protobuf.message import Message

from l4m.v1 import l4m_pb2
from l4m.wire.status import StatusCode

if TYPE_CHECKING:
    import grpc

HEADER = struct.Struct("<IB")
# L4M sessions (controller <-> scheduler; l4m.proto).
OPEN, REQUEST, STATUS, RESPONSE, GET_INFO, INFO = 1, 2, 3, 4, 5, 6
# The Execute stream (scheduler <-> executor; executor.proto), whose status frames are kind 3 too.
EXECUTE_OPEN, EXECUTE, EXECUTED = 7, 8, 9
# A controller's messages to its user (controller -> spawner; spawner.proto, "SendToUser over frames"),
# each answered by a status frame; its other runtime calls, each answered by a result frame, and their
# cancellations.
RUNTIME_OPEN, SEND_TO_USER, RUNTIME_CALL, RUNTIME_RESULT, RUNTIME_CANCEL = 10, 11, 12, 13, 14
# A shared controller process's control connection (spawner.proto, "Shared controller processes"): the
# instances to start or stop in it (spawner -> process), what they wrote and how they ended (process -> spawner).
SHARED_SLOT, SHARED_REPORT = 15, 16
KIND_NAMES = {OPEN: "FramedSessionOpen", REQUEST: "SessionRequest", STATUS: "FramedSessionStatus",
              RESPONSE: "SessionResponse", GET_INFO: "GetInfoRequest", INFO: "GetInfoResponse",
              EXECUTE_OPEN: "FramedExecuteOpen", EXECUTE: "ExecuteRequest", EXECUTED: "ExecuteResponse",
              RUNTIME_OPEN: "FramedRuntimeOpen", SEND_TO_USER: "SendToUserRequest",
              RUNTIME_CALL: "FramedRuntimeCall", RUNTIME_RESULT: "FramedRuntimeResult",
              RUNTIME_CANCEL: "FramedRuntimeCancel", SHARED_SLOT: "SharedProcessSlot",
              SHARED_REPORT: "SharedProcessReport"}
PROTOCOL_VERSION = "l4m.v1"
ADDRESS_PREFIX = "framed:"


def __getattr__(name: str) -> Any:
    # STATUS_CODES (grpc.StatusCode by number, for the services and tests that speak grpc's codes) imports
    # grpc on first use: the SDK's framed path reads statuses as `l4m.wire.status` codes, without grpc.
    if name == "STATUS_CODES":
        import grpc

        return {code.value[0]: code for code in grpc.StatusCode}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class FrameError(ValueError):
    """A frame that breaks the format: too large, cut off, or of a kind not expected here."""


def framed_path(address: str) -> str | None:
    """The socket path of a framed address (`framed:/run/l4m/scheduler.frames.sock`, or with `//`);
    None for any other address."""
    if not address.startswith(ADDRESS_PREFIX):
        return None
    path = address[len(ADDRESS_PREFIX):]
    return path[2:] if path.startswith("///") else path


def status_number(code: grpc.StatusCode | StatusCode) -> int:
    """The number of a status code, grpc's (whose value is `(number, name)`) or ours."""
    return code if isinstance(code, StatusCode) else code.value[0]


def status_frame(code: grpc.StatusCode | StatusCode, message: str = "") -> bytes:
    """A status frame (kind 3): what a gRPC status would say."""
    return encode(STATUS, l4m_pb2.FramedSessionStatus(code=status_number(code), message=message))


def read_status(payload: bytes) -> tuple[StatusCode, str]:
    """What a status frame says, without grpc: (code, message); a number gRPC does not know is UNKNOWN."""
    status = l4m_pb2.FramedSessionStatus.FromString(payload)
    return StatusCode.of(status.code), status.message


def parse_status(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """`read_status` in grpc's codes (for the services, which speak grpc anyway)."""
    import grpc

    code, message = read_status(payload)
    return grpc.StatusCode[code.name], message


def encode(kind: int, message: Message) -> bytes:
    payload = message.SerializeToString()
    return HEADER.pack(len(payload), kind) + payload


def parse_header(header: bytes, max_bytes: int) -> tuple[int, int]:
    """(payload size, kind); a size over `max_bytes` is a FrameError (nothing of it is read)."""
    size, kind = HEADER.unpack(header)
    if size > max_bytes:
        raise FrameError(f"a {KIND_NAMES.get(kind, f'kind {kind}')} frame of {size} bytes is larger than the "
                         f"{max_bytes} allowed")
    return size, kind


class FrameDecoder:
    """Whole frames out of a byte stream that arrives in arbitrary pieces."""

    __slots__ = ("max_bytes", "error", "_pieces", "_pending", "_needed")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.error: FrameError | None = None  # set by an oversized frame: the stream is broken from there
        self._pieces: list[bytes] = []  # the start of a frame not yet whole
        self._pending = 0  # their bytes
        self._needed = 0  # the bytes it takes before anything more can be parsed

    @property
    def inside_a_frame(self) -> bool:
        """Whether the bytes so far end inside a frame (a stream that ends here was cut)."""
        return self._pending > 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames `data` completes, in order, as (kind, payload). An oversized frame sets `error` as soon
        as its header is in: the frames before it are returned, nothing after it ever is."""
        if self.error is not None:
            return []
        if self._pending:
            self._pieces.append(data)
            self._pending += len(data)
            if self._pending < self._needed:  # a large frame arriving in pieces is joined once, when whole
                return []
            data = b"".join(self._pieces)
            self._pieces.clear()
        received = []
        offset, end, unpack_from, header_size, max_bytes = 0, len(data), HEADER.unpack_from, HEADER.size, self.max_bytes
        needed = header_size
        while end - offset >= header_size:
            size, kind = unpack_from(data, offset)
            if size > max_bytes:
                self.error = FrameError(f"a {KIND_NAMES.get(kind, f'kind {kind}')} frame of {size} bytes is larger "
                                        f"than the {max_bytes} allowed")
                self._pending = 0
                self._pieces.clear()
                return received
            start = offset + header_size
            if end - start < size:
                needed = header_size + size
                break
            offset = start + size
            received.append((kind, data[start:offset]))
        if offset < end:
            self._pieces.append(data[offset:])
            self._pending, self._needed = end - offset, needed
        else:
            self._pending = 0
        return received


class FrameProtocol(asyncio.Protocol):
    """What both ends of a framed connection share: frames handed to `frame_received` in the order they
    came, in the callback that read them; the end of the stream to `stream_ended` (None when it ended
    cleanly between frames, the FrameError otherwise); writes that can wait while the peer does not read
    (`drain`). A subclass decides what a frame means."""

    def __init__(self, max_bytes: int) -> None:
        self.decoder = FrameDecoder(max_bytes)
        self.transport: asyncio.Transport | None = None
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._ended = False

    # -- what a subclass implements ----------------------------------------------------------------------
    def frame_received(self, kind: int, payload: bytes) -> None:
        raise NotImplementedError

    def stream_ended(self, error: Exception | None) -> None:
        """The peer closed its side (or the connection broke, or sent a broken frame: `error`)."""

    # -- asyncio.Protocol -------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._ended:
            return
        for kind, payload in self.decoder.feed(data):
            if self._ended:  # a frame's handler ended the stream: the rest of this read is dropped
                return
            self.frame_received(kind, payload)
        if self.decoder.error is not None:
            self._end(self.decoder.error)

    def eof_received(self) -> bool:
        self._end(FrameError("the stream ended inside a frame") if self.decoder.inside_a_frame else None)
        return True  # the write half stays open until the subclass closes it

    def connection_lost(self, exc: Exception | None) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._end(ConnectionResetError(str(exc)) if exc is not None else None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- for the subclass ----------------------------------------------------------------------------------
    def _end(self, error: Exception | None) -> None:
        if not self._ended:
            self._ended = True
            self.stream_ended(error)

    def end_reading(self) -> None:
        """Hands no more frames to `frame_received`, nor the stream's end to `stream_ended` (a trap or a
        refusal ended what the peer may send)."""
        self._ended = True

    def resume_reading_frames(self) -> None:
        """Undoes `end_reading` (the rest of the current read is handed on too)."""
        self._ended = False

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    async def drain(self) -> None:
        """Returns once what was written is below the transport's high-water mark (or the connection is gone)."""
        if self._write_paused and self.transport is not None and not self.transport.is_closing():
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> tuple[int, bytes] | None:
    """The next frame as (kind, payload); None when the stream ended cleanly between frames."""
    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as end:
        if not end.partial:
            return None
        raise FrameError("the stream ended inside a frame header") from None
    size, kind = parse_header(header, max_bytes)
    try:
        return kind, await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise FrameError(f"the stream ended inside a {size}-byte frame") from None
