"""The framed sessions' frame format (`l4m.wire.frames`), without sockets: addresses, the header's bound,
and where a stream may end."""

from __future__ import annotations

import asyncio
import re

import pytest

from l4m.scheduler import requests as rq
from l4m.v1 import l4m_pb2
from l4m.wire import frames


@pytest.mark.parametrize(("address", "path"), [
    ("framed:/run/l4m/scheduler.frames.sock", "/run/l4m/scheduler.frames.sock"),
    ("framed:///run/l4m/scheduler.frames.sock", "/run/l4m/scheduler.frames.sock"),
    ("unix:///run/l4m/scheduler.sock", None),
    ("127.0.0.1:50051", None),
])
def test_only_framed_addresses_name_a_framed_socket(address: str, path: str | None) -> None:
    assert frames.framed_path(address) == path


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_a_frame_reads_back_as_it_was_written_then_the_clean_end() -> None:
    request = rq.forward_text([0, 1], 3, [7], [18], outputs=[0], request_id=5)

    async def read_all() -> list[tuple[int, bytes] | None]:
        reader = _reader(frames.encode(frames.REQUEST, request) * 2)
        return [await frames.read_frame(reader, 1 << 20) for _ in range(3)]

    first, second, end = asyncio.run(read_all())
    assert first == second == (frames.REQUEST, request.SerializeToString()) and end is None
    assert l4m_pb2.SessionRequest.FromString(first[1]) == request  # type: ignore[index]


@pytest.mark.parametrize(("data", "reason"), [
    (frames.HEADER.pack(1 << 30, frames.REQUEST), "a SessionRequest frame of 1073741824 bytes is larger than the 1024 allowed"),
    (frames.HEADER.pack(10, frames.REQUEST) + b"abc", "the stream ended inside a 10-byte frame"),
    (b"\x01\x00", "the stream ended inside a frame header"),
])
def test_an_oversized_or_cut_frame_is_a_frame_error(data: bytes, reason: str) -> None:
    async def read() -> object:
        return await frames.read_frame(_reader(data), 1024)

    with pytest.raises(frames.FrameError, match=re.escape(reason)):
        asyncio.run(read())
