"""A controller's user messages as frames (spawner.proto, "SendToUser over frames"): the spawner's
`FramedRuntimeConnection` and its core over a fake sandbox, and the SDK's `FramedRuntime` (or raw frames
for what the SDK would never send), joined by an in-memory transport (no sockets in unit tests; the
cluster's integration tests send every controller message over the real socket).

What is pinned, and who may use the socket: only a running instance's token opens a connection
(UNAUTHENTICATED otherwise, and nothing sent before the refusal reaches anyone); a connection's messages
reach that instance's attachers, in order, each answered; the output limit answers RESOURCE_EXHAUSTED,
kills the instance and ends the connection, the messages before it delivered; a frame of another kind,
one that does not parse or one over the limit ends the connection with INVALID_ARGUMENT; a connection
that sends nothing is refused after the open timeout; a sender's `close` returns once every message is
answered; Attach with `batch_events` gets the events of a burst in one response."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from l4m.controller import ControllerConfig
from l4m.errors import L4MError
from l4m.runtime import FramedRuntime, RuntimeClient
from l4m.spawner.framed_runtime import FramedRuntimeConnection, FramedRuntimeServer
from l4m.spawner.instances import Instance
from l4m.spawner.sandbox import ExitReason, Limits
from l4m.spawner.server import MAX_ATTACH_RESPONSE_BYTES, _attach_chunks, event_to_pb
from l4m.spawner.supervisor import MessageEvent
from l4m.v1 import spawner_pb2
from l4m.wire import frames, limits
from tests.unit.spawner.test_instances import _manager
from tests.unit.spawner.test_supervisor import FakeSandbox

LIMITS = Limits(wall_time_s=60, cpu_time_s=60, max_output_bytes=1 << 20)


class Pipe(asyncio.Transport):
    """One end of an in-memory connection: what is written reaches the peer protocol on a later turn of
    the loop, as from a socket; it keeps what was written; closing it ends both sides."""

    def __init__(self, protocol: frames.FrameProtocol, peer: frames.FrameProtocol | None = None) -> None:
        super().__init__()
        self.protocol, self.peer = protocol, peer
        self.written = bytearray()
        self.closed = False
        self.reading = True
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.written += data
        if self.peer is not None:
            self._loop.call_soon(self.peer.data_received, bytes(data))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.call_soon(self.protocol.connection_lost, None)
            if self.peer is not None:
                self._loop.call_soon(self.peer.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return False


class Harness:
    """The spawner's core over a fake sandbox and its framed runtime server, whose connections are made
    here (no sockets in unit tests): `raw` writes bytes as one read, `sender` is the SDK's end wired to
    a server connection."""

    def __init__(self, tmp_path: Path, open_timeout_s: float = 10.0) -> None:
        self.manager, self.sha, _ = _manager(tmp_path, FakeSandbox([], exit_code=None))  # runs until killed
        self.server = FramedRuntimeServer(self.manager, str(tmp_path / "runtime.frames.sock"), open_timeout_s)

    async def launch(self, limits: Limits = LIMITS) -> Instance:
        return await self.manager.launch(self.sha, (), limits)

    async def messages(self, instance: Instance) -> list[str]:
        """Every message the instance published, once it has ended."""
        return [e.text async for e in instance.supervisor.subscribe() if isinstance(e, MessageEvent)]

    def connect(self, peer: frames.FrameProtocol | None = None) -> tuple[FramedRuntimeConnection, Pipe]:
        connection = FramedRuntimeConnection(self.server)
        transport = Pipe(connection, peer)
        connection.connection_made(transport)
        return connection, transport

    async def raw(self, *payload: bytes) -> list[tuple[int, bytes]]:
        """`payload` as one read of a new connection; every frame the server answered."""
        connection, transport = self.connect()
        if payload:
            connection.data_received(b"".join(payload))
        await settle()
        return frames.FrameDecoder(1 << 30).feed(bytes(transport.written))

    def sender(self, token: str) -> FramedRuntime:
        """The SDK's sender, its connection wired to a server connection (`create_unix_connection` is
        the one call it makes to reach a socket)."""
        loop = asyncio.get_running_loop()

        async def connect(factory, path):  # type: ignore[no-untyped-def]
            sender = factory()
            connection, to_sender = self.connect(sender)
            to_server = Pipe(sender, connection)
            sender.connection_made(to_server)
            return to_server, sender

        loop.create_unix_connection = connect  # type: ignore[method-assign]  # (for this test's loop only)
        return FramedRuntime("runtime.frames.sock", token)


async def settle() -> None:
    for _ in range(30):
        await asyncio.sleep(0)


def opening(token: str, version: str = frames.PROTOCOL_VERSION) -> bytes:
    return frames.encode(frames.RUNTIME_OPEN, spawner_pb2.FramedRuntimeOpen(protocol_version=version,
                                                                             instance_token=token))


def message(text: str) -> bytes:
    return frames.encode(frames.SEND_TO_USER, spawner_pb2.SendToUserRequest(text=text))


def codes(answers: list[tuple[int, bytes]]) -> list[tuple[grpc.StatusCode, str]]:
    assert all(kind == frames.STATUS for kind, _ in answers), answers
    return [frames.parse_status(payload) for _, payload in answers]


def run(tmp_path: Path, body, open_timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async def go() -> None:
        harness = Harness(tmp_path, open_timeout_s)
        try:
            await asyncio.wait_for(body(harness), 30)
        finally:
            await harness.manager.shutdown()

    asyncio.run(go())


def test_the_socket_is_open_to_anyone_but_only_a_running_instances_token_opens_it(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        refused = await h.raw(opening("not-a-token"), message("spoofed"))
        assert codes(refused) == [(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown instance_token")]
        assert codes(await h.raw(message("no opening"))) == [(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the first frame is of kind {frames.SEND_TO_USER}, not FramedRuntimeOpen ({frames.RUNTIME_OPEN})")]
        [(code, reason)] = codes(await h.raw(opening(instance.token, "l4m.v0")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "'l4m.v0'" in reason
        await instance.supervisor.terminate()
        # An ended instance's token opens nothing any more.
        assert codes(await h.raw(opening(instance.token)))[0][0] == grpc.StatusCode.UNAUTHENTICATED
        assert await h.messages(instance) == []  # nothing a refused connection sent reached anyone

    run(tmp_path, body)


def test_messages_reach_the_instances_attachers_in_order_each_answered(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        first, second = await h.launch(), await h.launch()
        sender = h.sender(first.token)
        texts = [f"token {i}" for i in range(600)]  # more than MAX_UNANSWERED_SENDS: send waits for answers
        for text in texts:
            await sender.send(text)
        await sender.flush()  # returns once all 600 are answered: published before the instance ends below
        answers = codes(await h.raw(opening(second.token), message("a"), message("b")))
        assert answers == [(grpc.StatusCode.OK, "")] * 3  # the opening's, then one per message
        for instance in (first, second):
            await instance.supervisor.terminate()
        await sender.close()  # nothing left unanswered
        assert await h.messages(first) == texts
        assert await h.messages(second) == ["a", "b"]  # each connection speaks for its own instance only

    run(tmp_path, body)


def test_the_output_limit_kills_the_instance_and_ends_the_connection(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch(Limits(wall_time_s=60, cpu_time_s=60, max_output_bytes=300))
        answers = codes(await h.raw(opening(instance.token), *(message("x" * 60) for _ in range(10))))
        assert answers[0] == (grpc.StatusCode.OK, "")  # the opening
        delivered = answers[1:-1]
        assert delivered and all(answer == (grpc.StatusCode.OK, "") for answer in delivered)
        assert answers[-1] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "the instance's output limit is used up")
        exit_info = await instance.supervisor.wait()
        assert exit_info.reason is ExitReason.OUTPUT_LIMIT
        assert len(await h.messages(instance)) == len(delivered)  # what was answered OK, nothing after
        # The SDK's sender reports a refusal on the next send, and on close.
        other = await h.launch(Limits(wall_time_s=60, cpu_time_s=60, max_output_bytes=300))
        sender = h.sender(other.token)
        with pytest.raises(L4MError, match="RESOURCE_EXHAUSTED"):
            for _ in range(100):
                await sender.send("y" * 60)
                await asyncio.sleep(0.01)
        with pytest.raises(L4MError, match="RESOURCE_EXHAUSTED"):
            await sender.close()
        assert (await other.supervisor.wait()).reason is ExitReason.OUTPUT_LIMIT

    run(tmp_path, body)


def test_bad_frames_end_the_connection_with_invalid_argument(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        opened = opening(instance.token)
        too_large = frames.HEADER.pack(limits.RUNTIME_MAX_REQUEST_BYTES + 1, frames.SEND_TO_USER)
        cases = {
            "kind": (frames.encode(frames.REQUEST, spawner_pb2.SendToUserRequest(text="x")),
                     f"a frame of kind {frames.REQUEST} after the opening"),
            "parse": (frames.HEADER.pack(3, frames.SEND_TO_USER) + b"\xff\xff\xff", "does not parse as l4m.v1.SendToUserRequest"),
            "size": (too_large, f"larger than the {limits.RUNTIME_MAX_REQUEST_BYTES} allowed"),
        }
        for bad, reason in cases.values():
            answers = codes(await h.raw(opened, message("before"), bad, message("after")))
            assert answers[:2] == [(grpc.StatusCode.OK, "")] * 2
            assert answers[2][0] == grpc.StatusCode.INVALID_ARGUMENT and reason in answers[2][1], answers
            assert len(answers) == 3  # nothing after the bad frame was read
        assert instance.supervisor.exit_info is None  # a broken connection does not end the instance
        await instance.supervisor.terminate()
        assert await h.messages(instance) == ["before"] * len(cases)

    run(tmp_path, body)


def test_a_connection_that_sends_nothing_is_refused_after_the_open_timeout(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        connection, transport = h.connect()
        assert connection in h.server.connections
        await asyncio.sleep(0.4)
        answers = frames.FrameDecoder(1 << 16).feed(bytes(transport.written))
        assert codes(answers) == [(grpc.StatusCode.DEADLINE_EXCEEDED, "no first frame within 0.2 s")]
        await settle()
        assert transport.closed and connection not in h.server.connections

    run(tmp_path, body, open_timeout_s=0.2)


def test_a_sender_that_cannot_connect_fails_clearly() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()

        async def refused(factory, path):  # type: ignore[no-untyped-def]
            raise FileNotFoundError(2, "No such file or directory")

        loop.create_unix_connection = refused  # type: ignore[method-assign]
        sender = FramedRuntime("/run/l4m/absent.sock", "token")
        await sender.send("lost")  # queued: the connection's failure is reported next
        with pytest.raises(L4MError, match="cannot connect to framed:/run/l4m/absent.sock"):
            await sender.close()

    asyncio.run(go())


def test_attach_batches_cut_at_a_size_bound_in_order() -> None:
    small = [event_to_pb(MessageEvent(f"m{i}")) for i in range(5)]
    assert _attach_chunks(small) == [small]
    large = [event_to_pb(MessageEvent("x" * (MAX_ATTACH_RESPONSE_BYTES // 2))) for _ in range(3)]
    chunks = _attach_chunks([small[0], *large, small[1]])
    assert [len(chunk) for chunk in chunks] == [2, 1, 2]
    assert [event for chunk in chunks for event in chunk] == [small[0], *large, small[1]]
    assert all(sum(e.ByteSize() for e in chunk) <= MAX_ATTACH_RESPONSE_BYTES for chunk in chunks)
    huge = event_to_pb(MessageEvent("x" * (MAX_ATTACH_RESPONSE_BYTES + 1)))
    assert _attach_chunks([huge]) == [[huge]]  # a single event larger than the bound goes alone


def test_subscribe_batches_hands_over_what_is_ready_at_once(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        batches = instance.supervisor.subscribe_batches()
        for text in ("a", "b", "c"):  # published before the subscriber looks: one list
            assert instance.supervisor.publish_message_nowait(text) == "published"
        first = await anext(batches)
        assert [e.text for e in first] == ["a", "b", "c"]
        pending = asyncio.ensure_future(anext(batches))
        await asyncio.sleep(0)
        instance.supervisor.publish_message_nowait("d")
        assert [e.text for e in await pending] == ["d"]
        await instance.supervisor.terminate()
        assert instance.supervisor.publish_message_nowait("late") == "not running"
        await batches.aclose()

    run(tmp_path, body)


def test_the_runner_takes_the_framed_address_from_the_spawners_environment() -> None:
    config = ControllerConfig.from_env({"L4M_SCHEDULER_ADDR": "framed:///run/l4m/scheduler.frames.sock",
                                        "L4M_RUNTIME_ADDR": "unix:///run/l4m/runtime.sock",
                                        "L4M_RUNTIME_FRAMED_ADDR": "framed:///run/l4m/runtime.frames.sock"})
    assert config.runtime_framed_address == "framed:///run/l4m/runtime.frames.sock"
    assert ControllerConfig.from_env({"L4M_SCHEDULER_ADDR": "x:1"}).runtime_framed_address is None

    async def go() -> None:
        with pytest.raises(L4MError, match="L4M_RUNTIME_FRAMED_ADDR 'unix:///run/l4m/x.sock' is not a framed: address"):
            RuntimeClient("unix:///run/l4m/runtime.sock", "token", framed_address="unix:///run/l4m/x.sock")

    asyncio.run(go())
