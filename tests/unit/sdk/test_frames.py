"""The framed sessions' frame format (`l4m.wire.frames`), without sockets: addresses, the header's bound,
where a stream may end, and status frames read alike in grpc's codes and in the SDK's own
(`l4m.wire.status`)."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from l4m.scheduler import requests as rq
from l4m.v1 import l4m_pb2
from l4m.wire import frames
from l4m.wire.status import EOF, StatusCode, StatusError, code_name, is_eof


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


def test_the_decoder_gives_the_same_frames_however_the_bytes_are_cut() -> None:
    sent = [(frames.REQUEST, rq.forward_text([0], 1, [7 + i], outputs=[0], request_id=i).SerializeToString())
            for i in range(3)] + [(frames.STATUS, b"")]
    data = b"".join(frames.HEADER.pack(len(payload), kind) + payload for kind, payload in sent)
    for cut in (1, 2, 5, 7, len(data)):
        decoder = frames.FrameDecoder(1 << 20)
        received = []
        for start in range(0, len(data), cut):
            received += decoder.feed(data[start:start + cut])
        assert received == sent and not decoder.inside_a_frame, cut
    decoder = frames.FrameDecoder(1 << 20)
    assert decoder.feed(data[:3]) == [] and decoder.inside_a_frame  # a stream ending here was cut


def test_an_oversized_frame_keeps_what_came_before_it_and_nothing_after() -> None:
    good = frames.encode(frames.REQUEST, rq.allocate([0]))
    decoder = frames.FrameDecoder(64)
    received = decoder.feed(good + frames.HEADER.pack(65, frames.REQUEST) + b"x" * 65 + good)
    assert received == [(frames.REQUEST, rq.allocate([0]).SerializeToString())]
    assert str(decoder.error) == "a SessionRequest frame of 65 bytes is larger than the 64 allowed"
    assert decoder.feed(good) == []


def test_status_frames_mean_the_same_in_grpcs_codes_and_the_sdks_own() -> None:
    assert [code.name for code in StatusCode] == [code.name for code in grpc.StatusCode]
    for code in grpc.StatusCode:
        ours = StatusCode[code.name]
        assert ours == code.value[0]
        frame = frames.status_frame(code, "why")
        assert frames.status_frame(ours, "why") == frame
        [(kind, payload)] = frames.FrameDecoder(1 << 10).feed(frame)
        assert kind == frames.STATUS
        assert frames.read_status(payload) == (ours, "why")
        assert frames.parse_status(payload) == (code, "why")
        assert frames.STATUS_CODES[ours] is code
    unknown = l4m_pb2.FramedSessionStatus(code=99, message="?").SerializeToString()
    assert frames.read_status(unknown) == (StatusCode.UNKNOWN, "?")
    assert frames.parse_status(unknown) == (grpc.StatusCode.UNKNOWN, "?")


def test_a_failed_call_and_a_streams_end_read_alike_from_either_transport() -> None:
    framed = StatusError(StatusCode.UNAVAILABLE, "gone")
    assert (framed.code(), framed.details(), str(framed)) == (StatusCode.UNAVAILABLE, "gone", "UNAVAILABLE: gone")
    over_grpc = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    assert code_name(framed) == code_name(over_grpc) == "UNAVAILABLE"
    assert code_name(ValueError("not a call")) is None
    assert is_eof(EOF) and is_eof(grpc.aio.EOF)
    assert not is_eof(None) and not is_eof(framed)
