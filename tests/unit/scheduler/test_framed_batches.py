"""Several commands in one message: a framed session's frames that arrive in one read (`FramedConnection`,
services/scheduler/framed.py) against the scheduler core and a simulated executor, no sockets (the
transport is a stand-in that records what is written). The integration tests in
tests/integration/scheduler/test_framed_sessions.py run the same protocol over real sockets.

What is pinned: the commands of one message are submitted in order, as if sent one by one (replies per
stream in order, one executor batch for what is ready together); a command that traps its instance names
itself (kind and request id) and the rest of that message is dropped, for that instance only; a
connection that sends nothing is refused after the open timeout; a controller that does not read its
replies stops being read."""

from __future__ import annotations

import asyncio

import grpc

from l4m.scheduler import requests as rq
from l4m.scheduler.framed import FramedConnection, FramedServer
from l4m.scheduler.simulated import next_token
from l4m.v1 import l4m_pb2
from l4m.wire import frames

VOCAB_SIZE = 1000  # the simulated executor's


class RecordingTransport(asyncio.Transport):
    """The part of a transport a `FramedConnection` uses; keeps what was written."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def frames(self) -> list[tuple[int, bytes]]:
        return frames.FrameDecoder(1 << 30).feed(bytes(self.written))

    def responses(self) -> list[l4m_pb2.SessionResponse]:
        return [l4m_pb2.SessionResponse.FromString(p) for k, p in self.frames() if k == frames.RESPONSE]

    def statuses(self) -> list[tuple[grpc.StatusCode, str]]:
        found = []
        for kind, payload in self.frames():
            if kind == frames.STATUS:
                status = l4m_pb2.FramedSessionStatus.FromString(payload)
                found.append((frames.STATUS_CODES[status.code], status.message))
        return found


def _connect(server: FramedServer) -> tuple[FramedConnection, RecordingTransport]:
    connection, transport = FramedConnection(server), RecordingTransport()
    connection.connection_made(transport)
    return connection, transport


def _message(token: str, *requests: l4m_pb2.SessionRequest) -> bytes:
    """The opening and the requests, as one write (one read on the scheduler's side)."""
    opening = l4m_pb2.FramedSessionOpen(protocol_version=frames.PROTOCOL_VERSION, instance_token=token)
    return frames.encode(frames.OPEN, opening) + b"".join(frames.encode(frames.REQUEST, r) for r in requests)


async def _settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


async def test_the_commands_of_one_message_run_in_order_and_each_is_answered(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    server = FramedServer(h.scheduler, "unused.sock")
    h.scheduler.register_instance("forks", "token-of-forks-0123456789", 0, 1)
    connection, transport = _connect(server)
    # A fork group's step: three streams, each one token on its own page, written together.
    connection.data_received(_message(
        "token-of-forks-0123456789",
        rq.allocate([0, 1, 2]),
        *(rq.forward_text([page], 1, [10 + page], outputs=[0], request_id=1 + page, stream_id=page)
          for page in range(3)),
        rq.forward_text([0], 2, [20], [1], outputs=[0], request_id=4, stream_id=0),  # stream 0's next step
    ))
    await _settle()
    # The adaptive batcher may hold a batch for a timer of a few ms: on a busy machine 30 loop turns are
    # not always enough, so wait (bounded) for the four replies.
    for _ in range(200):
        if len(transport.responses()) >= 4:
            break
        await asyncio.sleep(0.01)
    assert transport.statuses() == [(grpc.StatusCode.OK, "")]  # the opening's answer; the session is open
    replies = transport.responses()
    assert [r.request_id for r in replies if r.stream_id == 0] == [1, 4]  # a stream's replies in order
    assert sorted(r.request_id for r in replies) == [1, 2, 3, 4]
    tokens = {r.request_id: r.forward_text.outputs[0].token.token_id for r in replies}
    assert tokens == {1: next_token(10, 0, VOCAB_SIZE), 2: next_token(11, 0, VOCAB_SIZE),
                      3: next_token(12, 0, VOCAB_SIZE), 4: next_token(20, 1, VOCAB_SIZE)}
    # What was ready together went together: 4 forward_texts in fewer executor batches (stream 0's two
    # steps cannot share one, and stream 0 waits for its allocate).
    forward_batches = [size for kind, size in h.sim().batch_sizes if kind == "forward_text"]
    assert sum(forward_batches) == 4 and len(forward_batches) < 4, forward_batches
    assert not transport.closed


async def test_a_trap_in_the_middle_of_a_message_names_it_and_drops_the_rest_of_that_instance_only(  # type: ignore[no-untyped-def]
        harness_factory) -> None:
    h = harness_factory()
    server = FramedServer(h.scheduler, "unused.sock")
    free_before = h.free_pages()
    for name in ("offender", "bystander"):
        h.scheduler.register_instance(name, f"token-of-{name}-0123456789", 0, 1)
    offender, offender_transport = _connect(server)
    bystander, bystander_transport = _connect(server)
    offender.data_received(_message(
        "token-of-offender-0123456789",
        rq.allocate([0, 1]),
        rq.forward_text([0], 1, [5], outputs=[0], request_id=1),
        rq.forward_text([1], 1, [VOCAB_SIZE + 7], outputs=[0], request_id=2),  # a token id outside the vocabulary
        rq.forward_text([0], 2, [6], [1], outputs=[0], request_id=3),
        rq.allocate([2, 3, 4]),
    ))
    bystander.data_received(_message("token-of-bystander-0123456789", rq.allocate([0]),
                                     rq.forward_text([0], 1, [9], outputs=[0], request_id=1)))
    await _settle()

    traps = [r.trap for r in offender_transport.responses() if r.WhichOneof("event") == "trap"]
    assert len(traps) == 1 and traps[0].offending_request_id == 2, offender_transport.responses()
    assert traps[0].kind == l4m_pb2.TRAP_KIND_INVALID_COMMAND
    assert traps[0].reason.startswith("forward_text (request 2): ") and str(VOCAB_SIZE + 7) in traps[0].reason
    assert not [r for r in offender_transport.responses() if r.request_id == 3]  # the rest of the message: dropped
    (opened, ended) = offender_transport.statuses()
    assert opened == (grpc.StatusCode.OK, "") and ended[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "request 2" in ended[1] and offender_transport.closed
    # Nothing of the offender is held: not the pages its message allocated, not the later allocate's.
    assert h.free_pages() == free_before - 1  # the bystander's one page

    replies = bystander_transport.responses()
    assert [(r.request_id, r.forward_text.outputs[0].token.token_id) for r in replies] == [(1, next_token(9, 0, VOCAB_SIZE))]
    assert not bystander_transport.closed
    # The bystander goes on; a frame the offender sends after its trap is not read.
    bystander.data_received(frames.encode(frames.REQUEST, rq.forward_text([0], 2, [8], [1], outputs=[0], request_id=2)))
    offender.data_received(frames.encode(frames.REQUEST, rq.allocate([7])))
    await _settle()
    assert [r.request_id for r in bystander_transport.responses()] == [1, 2]
    assert h.free_pages() == free_before - 1


async def test_a_connection_that_sends_nothing_is_refused_after_the_open_timeout(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    server = FramedServer(h.scheduler, "unused.sock", open_timeout_s=0.05)
    connection, transport = _connect(server)
    assert connection in server.connections
    await asyncio.sleep(0.2)
    assert transport.statuses() == [(grpc.StatusCode.DEADLINE_EXCEEDED, "no first frame within 0.05 s")]
    assert transport.closed
    connection.connection_lost(None)
    assert connection not in server.connections


async def test_a_session_that_does_not_read_its_replies_stops_being_read(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    server = FramedServer(h.scheduler, "unused.sock")
    h.scheduler.register_instance("slow", "token-of-slow-0123456789", 0, 1)
    connection, transport = _connect(server)
    connection.data_received(_message("token-of-slow-0123456789"))
    connection.pause_writing()  # what the transport calls at its high-water mark
    assert not transport.reading
    connection.resume_writing()
    assert transport.reading


async def test_a_frame_cut_by_the_end_of_the_stream_traps_its_instance(harness_factory) -> None:  # type: ignore[no-untyped-def]
    h = harness_factory()
    server = FramedServer(h.scheduler, "unused.sock")
    h.scheduler.register_instance("cut", "token-of-cut-0123456789", 0, 1)
    connection, transport = _connect(server)
    whole = frames.encode(frames.REQUEST, rq.allocate([0, 1]))
    connection.data_received(_message("token-of-cut-0123456789") + whole[:-1])  # a frame whose last byte never comes
    assert connection.eof_received() is True  # keeps the write half open for the trap
    await _settle()
    (trap,) = [r.trap for r in transport.responses()]
    assert "the stream ended inside a frame" in trap.reason and transport.closed
