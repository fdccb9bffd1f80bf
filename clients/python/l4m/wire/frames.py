"""Framed L4M sessions: the frame format both ends speak (l4m.proto, "L4M sessions over length-prefixed
frames"; docs/protocol.md). A frame is a 4-byte little-endian payload length, a 1-byte kind, the payload.

The same `SessionRequest` / `SessionResponse` messages as on gRPC, on a plain Unix stream socket: in
Python a gRPC message costs ~150-420 us of CPU on each side, a frame ~35-170 (`bench/transport.py`).
"""

from __future__ import annotations

import asyncio
import struct

import grpc
from google.protobuf.message import Message

HEADER = struct.Struct("<IB")
OPEN, REQUEST, STATUS, RESPONSE, GET_INFO, INFO = 1, 2, 3, 4, 5, 6
KIND_NAMES = {OPEN: "FramedSessionOpen", REQUEST: "SessionRequest", STATUS: "FramedSessionStatus",
              RESPONSE: "SessionResponse", GET_INFO: "GetInfoRequest", INFO: "GetInfoResponse"}
PROTOCOL_VERSION = "l4m.v1"
ADDRESS_PREFIX = "framed:"
# gRPC status codes by number (a status frame carries the number).
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


class FrameError(ValueError):
    """A frame that breaks the format: too large, cut off, or of a kind not expected here."""


def framed_path(address: str) -> str | None:
    """The socket path of a framed address (`framed:/run/l4m/scheduler.frames.sock`, or with `//`);
    None for any other address."""
    if not address.startswith(ADDRESS_PREFIX):
        return None
    path = address[len(ADDRESS_PREFIX):]
    return path[2:] if path.startswith("///") else path


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
