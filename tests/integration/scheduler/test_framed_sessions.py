"""Framed L4M sessions (the scheduler's `--listen-framed`, `l4m.wire.frames`): the same session as gRPC on
a Unix socket, over real processes. Who may use the socket: anyone may connect (mode 0666, like the gRPC
Unix socket), and only a registered instance token in the first frame opens a session (anonymous only
where the scheduler allows it). A bad frame traps its instance alone, with a reason, and frees what it held."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
from pathlib import Path

import grpc
import pytest
from scheduler_procs import Cluster
from test_scheduler_planes import Planes, _register

from l4m import Greedy, stop
from l4m.errors import SessionClosed, Trapped
from l4m.model import Model
from l4m.scheduler import requests as rq
from l4m.session import Session
from l4m.v1 import l4m_pb2
from l4m.wire import frames

NUM_KV_PAGES = 32  # Planes starts its simulated executor with 32 pages


def _planes(cluster: Cluster, tmp_path: Path) -> tuple[Planes, str]:
    path = str(tmp_path / "scheduler.frames.sock")
    return Planes(cluster, tmp_path, "--listen-framed", path), path


def _open(token: str = "", version: str = frames.PROTOCOL_VERSION) -> bytes:
    return frames.encode(frames.OPEN, l4m_pb2.FramedSessionOpen(protocol_version=version, instance_token=token))


def _request(request: l4m_pb2.SessionRequest) -> bytes:
    return frames.encode(frames.REQUEST, request)


def _exchange(path: str, *chunks: bytes, half_close: bool = True) -> list[tuple[int, bytes]]:
    """Sends the bytes, shuts the write half (the controller is done) and reads every frame until the
    scheduler closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(b"".join(chunks))
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        return _read_to_end(sock)


def _read_to_end(sock: socket.socket) -> list[tuple[int, bytes]]:
    """Every frame until the scheduler closes the connection, as (kind, payload)."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    received = []
    while data:
        size, kind = frames.HEADER.unpack_from(data)
        received.append((kind, data[frames.HEADER.size:frames.HEADER.size + size]))
        data = data[frames.HEADER.size + size:]
    return received


def _status(frame: tuple[int, bytes]) -> tuple[grpc.StatusCode, str]:
    assert frame[0] == frames.STATUS, frame
    status = l4m_pb2.FramedSessionStatus.FromString(frame[1])
    return frames.STATUS_CODES[status.code], status.message


def _free_pages(path: str) -> int:
    (frame,) = _exchange(path, frames.encode(frames.GET_INFO, l4m_pb2.GetInfoRequest(omit_tokenizer_json=True)))
    assert frame[0] == frames.INFO, frame
    return l4m_pb2.GetInfoResponse.FromString(frame[1]).num_free_kv_pages


def test_a_framed_session_runs_commands_and_ends_ok(cluster: Cluster, tmp_path: Path) -> None:
    planes, path = _planes(cluster, tmp_path)
    token = _register(planes, "framed-a")
    received = _exchange(path, _open(token), _request(rq.allocate([0, 1])),
                         _request(rq.forward_text([0], 3, [1, 2, 3], outputs=[2], request_id=7)))
    assert [kind for kind, _ in received] == [frames.STATUS, frames.RESPONSE, frames.STATUS]
    assert _status(received[0]) == _status(received[-1]) == (grpc.StatusCode.OK, "")
    reply = l4m_pb2.SessionResponse.FromString(received[1][1])
    assert reply.request_id == 7 and len(reply.forward_text.outputs) == 1
    assert _free_pages(path) == NUM_KV_PAGES  # the closed session freed its pages


def test_anyone_may_connect_but_only_a_registered_token_opens_a_session(cluster: Cluster, tmp_path: Path) -> None:
    planes, path = _planes(cluster, tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
    token = _register(planes, "framed-b")
    refusals = {
        "no token": _exchange(path, _open("")),
        "unknown token": _exchange(path, _open("not-a-registered-token-0123")),
        "other version": _exchange(path, _open(token, "l4m.v0")),
        "a request first": _exchange(path, _request(rq.allocate([0]))),
        "an opening that does not parse": _exchange(path, struct.pack("<IB", 3, frames.OPEN) + b"\xff\xff\xff"),
        "a header announcing 1 GiB": _exchange(path, struct.pack("<IB", 1 << 30, frames.OPEN)),
    }
    expected = {
        "no token": (grpc.StatusCode.UNAUTHENTICATED, "missing l4m-instance-token"),
        "unknown token": (grpc.StatusCode.UNAUTHENTICATED, "unknown l4m-instance-token"),
        "other version": (grpc.StatusCode.FAILED_PRECONDITION, "protocol_version 'l4m.v0' is not 'l4m.v1'"),
        "a request first": (grpc.StatusCode.INVALID_ARGUMENT, "not FramedSessionOpen (1)"),
        "an opening that does not parse": (grpc.StatusCode.INVALID_ARGUMENT, "does not parse as FramedSessionOpen"),
        "a header announcing 1 GiB": (grpc.StatusCode.INVALID_ARGUMENT, "of 1073741824 bytes is larger than"),
    }
    for case, received in refusals.items():
        assert len(received) == 1, (case, received)
        code, message = _status(received[0])
        assert code == expected[case][0] and expected[case][1] in message, (case, code, message)
    # None of that touched the registered instance: it opens its one session now, and only one.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
        first.settimeout(10)
        first.connect(path)
        first.sendall(_open(token))
        header = first.recv(frames.HEADER.size)
        size, kind = frames.HEADER.unpack(header)
        assert (kind, _status((kind, first.recv(size)))) == (frames.STATUS, (grpc.StatusCode.OK, ""))
        (again,) = _exchange(path, _open(token))
        code, message = _status(again)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "one session per instance" in message


BAD_FRAMES = {
    "oversized": (struct.pack("<IB", (64 << 20) + 1, frames.REQUEST), "larger than"),
    "garbage": (struct.pack("<IB", 4, frames.REQUEST) + b"\xff\xff\xff\xff", "does not parse as l4m.v1.SessionRequest"),
    "another opening": (_open("x"), "only SessionRequest (2) frames may follow"),
}


@pytest.mark.parametrize("case", BAD_FRAMES)
def test_a_bad_frame_traps_its_instance_alone_and_frees_it(cluster: Cluster, tmp_path: Path, case: str) -> None:
    planes, path = _planes(cluster, tmp_path)
    good_token, bad_token = _register(planes, "framed-good"), _register(planes, "framed-bad")
    bad_frame, reason = BAD_FRAMES[case]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as good:
        good.settimeout(10)
        good.connect(path)
        good.sendall(_open(good_token) + _request(rq.allocate([0, 1])))
        received = _exchange(path, _open(bad_token), _request(rq.allocate(list(range(8)))), bad_frame,
                             half_close=False)
        assert [kind for kind, _ in received] == [frames.STATUS, frames.RESPONSE, frames.STATUS], received
        trap = l4m_pb2.SessionResponse.FromString(received[1][1]).trap
        assert trap.kind == l4m_pb2.TRAP_KIND_INVALID_COMMAND and reason in trap.reason, trap
        code, message = _status(received[2])
        assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in message
        assert _free_pages(path) == NUM_KV_PAGES - 2  # the offender's 8 are back; the good instance keeps 2
        # The good instance goes on: its forward_text is answered.
        good.sendall(_request(rq.forward_text([0], 2, [4, 5], outputs=[1], request_id=3)))
        good.shutdown(socket.SHUT_WR)
        received = _read_to_end(good)
    assert [kind for kind, _ in received] == [frames.STATUS, frames.RESPONSE, frames.STATUS]
    assert l4m_pb2.SessionResponse.FromString(received[1][1]).request_id == 3


async def _generate(address: str, token: str, num_tokens: int) -> list[int]:
    session = await Session.connect(address, token)
    try:
        model = await Model.load(session)
        async with model.new_context() as context:
            context.fill([5, 6, 7, 8])
            return [t.token_id async for t in context.generate(Greedy(), stop=stop.max_tokens(num_tokens),
                                                               max_continuation_steps=0)]
    finally:
        await session.close()


def test_the_sdk_gets_the_same_tokens_over_framed_sessions_as_over_grpc(cluster: Cluster, tmp_path: Path) -> None:
    planes, path = _planes(cluster, tmp_path)
    over_grpc = asyncio.run(_generate(f"unix://{planes.l4m_unix}", _register(planes, "sdk-grpc"), 24))
    over_frames = asyncio.run(_generate(f"framed:{path}", _register(planes, "sdk-framed"), 24))
    assert len(over_frames) == 24 and over_frames == over_grpc
    assert _free_pages(path) == NUM_KV_PAGES


def test_the_sdk_reports_a_trap_and_a_refusal_over_framed_sessions(cluster: Cluster, tmp_path: Path) -> None:
    planes, path = _planes(cluster, tmp_path)
    token = _register(planes, "sdk-trap")

    async def trapped() -> None:
        session = await Session.connect(f"framed:{path}", token)
        try:
            await session.request("forward_text", rq.forward_text([9], 1, [1], outputs=[0]).forward_text)
        finally:
            await session.close()

    with pytest.raises(Trapped) as trap:
        asyncio.run(trapped())
    assert trap.value.kind == l4m_pb2.TRAP_KIND_INVALID_COMMAND and "kv page 9 is not allocated" in str(trap.value)

    async def refused() -> None:
        session = await Session.connect(f"framed:{path}", "not-a-registered-token-0123")
        try:
            await session.request("synchronize", l4m_pb2.SynchronizeCommand())
        finally:
            await session.close()

    with pytest.raises(SessionClosed, match="UNAUTHENTICATED.*unknown l4m-instance-token"):
        asyncio.run(refused())
    assert _free_pages(path) == NUM_KV_PAGES
