"""A controller's other runtime calls as frames (spawner.proto, "SendToUser over frames", kinds 12-14): the
spawner's `FramedRuntimeConnection` over a fake sandbox and the SDK's `RuntimeClient`, joined by the
in-memory transport of test_framed_runtime.py (no sockets in unit tests; the spawner's integration test
runs them from a real sandbox: tests/integration/spawner/test_with_scheduler.py).

What is pinned: each call answers what its gRPC method would (the very servicer method runs), over frames
alone (the client's gRPC address leads nowhere and its channel stays closed); a connection's calls speak for
its instance only; a call that names nothing, or one over the calls in flight, is refused alone and the
connection goes on; a call_id reused while in flight or a call that does not parse ends the connection
(INVALID_ARGUMENT), the instance and its other connections untouched; a caller that gives up cancels its
call on the spawner, so a cancelled receive takes no message; a connection's end cancels its calls; and
the SDK's idle path never imports grpc."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from l4m.errors import L4MError
from l4m.runtime import RuntimeClient
from l4m.spawner import framed_runtime
from l4m.spawner.sandbox import ExitReason
from l4m.v1 import spawner_pb2
from l4m.wire import frames
from tests.unit.spawner.test_framed_runtime import Harness, Pipe, opening, run, settle

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def client(h: Harness, token: str, traceparent: str | None = None) -> RuntimeClient:
    """The SDK's runtime client whose framed connection reaches a connection of `h`'s server (as
    `Harness.sender`); its gRPC address leads nowhere, so a call that went over gRPC would fail."""

    async def connect(factory, path):  # type: ignore[no-untyped-def]
        runtime = factory()
        connection, _ = h.connect(runtime)
        to_server = Pipe(runtime, connection)
        runtime.connection_made(to_server)
        return to_server, runtime

    asyncio.get_running_loop().create_unix_connection = connect  # type: ignore[method-assign]
    return RuntimeClient("unix:///nonexistent/runtime.sock", token, traceparent,
                         framed_address="framed:///run/l4m/runtime.frames.sock")


def call(call_id: int, **request: object) -> bytes:
    return frames.encode(frames.RUNTIME_CALL, spawner_pb2.FramedRuntimeCall(call_id=call_id, **request))


def results(answers: list[tuple[int, bytes]]) -> dict[int, tuple[grpc.StatusCode, str, str | None]]:
    """The result frames among `answers`, by call_id: (code, message, the response's field)."""
    found = {}
    for kind, payload in answers:
        if kind == frames.RUNTIME_RESULT:
            result = spawner_pb2.FramedRuntimeResult.FromString(payload)
            found[result.call_id] = (frames.STATUS_CODES[result.code], result.message,
                                     result.WhichOneof("response"))
    return found


def statuses(answers: list[tuple[int, bytes]]) -> list[tuple[grpc.StatusCode, str]]:
    return [frames.parse_status(payload) for kind, payload in answers if kind == frames.STATUS]


def test_every_call_answers_as_its_grpc_method_over_frames_alone(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        runtime = client(h, instance.token, TRACEPARENT)
        assert await runtime.set("x", "1") == 1
        assert (await runtime.get("x")).text == "1"
        assert (await runtime.compare_and_set("x", 1, b"2")).swapped
        swap = await runtime.compare_and_set("x", 1, b"3")  # a stale version: refused, the value as it is
        assert (swap.swapped, swap.version, swap.value) == (False, 2, b"2")
        assert await runtime.append("x", "+") == 3
        assert (await runtime.get("x")).value == b"2+"
        assert not (await runtime.get("absent")).exists
        with pytest.raises(L4MError, match=r"runtime call SetVariable failed \(INVALID_ARGUMENT\)"):
            await runtime.set("", "a name is needed")
        assert await runtime.receive(timeout_s=0.05) is None  # nothing sent: the timeout
        h.manager.send_to_instance(instance.instance_id, "hello")
        assert await runtime.receive(timeout_s=5) == "hello"
        child_id = await runtime.spawn_child("", ["a"])
        child = h.manager.get(child_id)
        assert instance.child_ids == [child_id]
        assert child.supervisor.spec.env["TRACEPARENT"] == TRACEPARENT  # the opening's traceparent
        assert await runtime.wait_child(child_id, timeout_s=0.05) is None  # still running
        await child.supervisor.terminate()
        exit_ = await runtime.wait_child(child_id)
        assert exit_ is not None and exit_.reason == "EXIT_REASON_TERMINATED"
        with pytest.raises(L4MError, match=r"runtime call WaitChild failed \(NOT_FOUND\).*'nobody' is not a child"):
            await runtime.wait_child("nobody")
        await runtime.send("a message among the calls")
        await runtime.close()
        assert runtime._channel is None  # nothing went over gRPC
        await instance.supervisor.terminate()
        assert await h.messages(instance) == ["a message among the calls"]

    run(tmp_path, body)


def test_a_connections_calls_speak_for_its_instance_alone(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        first, second = await h.launch(), await h.launch()
        mine, theirs = client(h, first.token), client(h, second.token)
        await mine.set("secret", "first's")
        assert not (await theirs.get("secret")).exists  # another launch tree's variables
        child_id = await mine.spawn_child("", [])
        with pytest.raises(L4MError, match="NOT_FOUND"):
            await theirs.wait_child(child_id)  # another instance's child
        h.manager.send_to_instance(second.instance_id, "for the second")
        assert await mine.receive(timeout_s=0.05) is None
        assert await theirs.receive(timeout_s=5) == "for the second"
        for runtime in (mine, theirs):
            await runtime.close()

    run(tmp_path, body)


def test_a_call_that_names_nothing_or_one_too_many_is_refused_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(framed_runtime, "MAX_CALLS_IN_FLIGHT", 2)

    async def body(h: Harness) -> None:
        instance = await h.launch()
        answers = await h.raw(opening(instance.token), call(1),
                              call(2, receive_from_user=spawner_pb2.ReceiveFromUserRequest()),
                              call(3, receive_from_user=spawner_pb2.ReceiveFromUserRequest()),
                              call(4, receive_from_user=spawner_pb2.ReceiveFromUserRequest()),
                              call(5, get_variable=spawner_pb2.GetVariableRequest(name="v")))
        assert statuses(answers) == [(grpc.StatusCode.OK, "")]  # the opening's: the connection stays open
        found = results(answers)
        assert found[1][0] == grpc.StatusCode.INVALID_ARGUMENT and "names no request" in found[1][1]
        assert found[4] == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                            "2 calls are in flight on this connection already", None)
        assert found[5][0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # 2 and 3 still wait on the user
        assert 2 not in found and 3 not in found
        [connection] = h.server.connections
        assert sorted(connection.calls) == [2, 3]
        await instance.supervisor.terminate()

    run(tmp_path, body)


def test_a_broken_call_ends_its_connection_and_nothing_else(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        receive = call(7, receive_from_user=spawner_pb2.ReceiveFromUserRequest())
        cases = {
            "a call_id in flight": (receive + receive, "call_id 7 is already in flight"),
            "a call that does not parse": (frames.HEADER.pack(3, frames.RUNTIME_CALL) + b"\xff\xff\xff",
                                           "does not parse as l4m.v1.FramedRuntimeCall"),
            "a cancel that does not parse": (frames.HEADER.pack(3, frames.RUNTIME_CANCEL) + b"\xff\xff\xff",
                                             "does not parse as l4m.v1.FramedRuntimeCancel"),
            "a result from the client": (frames.encode(frames.RUNTIME_RESULT, spawner_pb2.FramedRuntimeResult()),
                                         f"a frame of kind {frames.RUNTIME_RESULT} after the opening"),
        }
        for bad, reason in cases.values():
            answers = await h.raw(opening(instance.token), bad)
            [(ok, _), (code, message)] = statuses(answers)
            assert (ok, code) == (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT) and reason in message, answers
            assert results(answers) == {}  # its calls were cancelled, unanswered
        await settle()
        assert not h.server.connections  # each closed, its calls cancelled with it
        assert instance.supervisor.exit_info is None  # the instance runs on: its other connections work
        runtime = client(h, instance.token)
        assert await runtime.set("still", "here") == 1
        await runtime.close()
        await instance.supervisor.terminate()

    run(tmp_path, body)


def test_a_caller_that_gives_up_cancels_its_call_so_no_message_is_lost(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        runtime = client(h, instance.token)
        waiting = asyncio.ensure_future(runtime.receive())
        await settle()
        [connection] = h.server.connections
        assert len(connection.calls) == 1  # the receive waits on the spawner
        waiting.cancel()
        await settle()
        assert connection.calls == {}  # the cancel frame stopped it there
        h.manager.send_to_instance(instance.instance_id, "kept")
        assert await runtime.receive(timeout_s=5) == "kept"  # the cancelled receive took nothing
        # A receive with a deadline the spawner cannot meet: the client gives up and cancels it too.
        runtime._framed._timeout_s = 0.05
        with pytest.raises(L4MError, match=r"ReceiveFromUser failed \(DEADLINE_EXCEEDED\)"):
            await runtime._framed.call("ReceiveFromUser", "receive_from_user", spawner_pb2.ReceiveFromUserRequest())
        await settle()
        assert connection.calls == {}
        pending = asyncio.ensure_future(runtime.receive())
        await settle()
        assert len(connection.calls) == 1
        await runtime.close()  # the connection's end cancels what it had in flight
        await settle()
        assert connection.calls == {}
        # Cancelled, as a closed gRPC channel's calls are: a task the program never awaited ends without an
        # exception for asyncio to log over the runner's own last line (its trap report).
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert pending.cancelled()
        with pytest.raises(L4MError, match="the runtime connection was closed"):
            await runtime.receive(timeout_s=5)
        h.manager.send_to_instance(instance.instance_id, "still kept")
        later = client(h, instance.token)
        assert await later.receive(timeout_s=5) == "still kept"
        await later.close()
        await instance.supervisor.terminate()

    run(tmp_path, body)


def test_an_unknown_token_fails_every_call_clearly(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        runtime = client(h, "not-a-token")
        with pytest.raises(L4MError, match=r"ended the runtime connection \(UNAUTHENTICATED\): missing or unknown"):
            await runtime.get("x")
        with pytest.raises(L4MError, match="UNAUTHENTICATED"):
            await runtime.receive(timeout_s=1)  # and every later call
        await h.launch()  # (the manager runs; nothing else reached it)

    run(tmp_path, body)


def test_an_instance_that_ended_answers_its_connections_calls_unauthenticated(tmp_path: Path) -> None:
    async def body(h: Harness) -> None:
        instance = await h.launch()
        runtime = client(h, instance.token)
        assert await runtime.set("x", "1") == 1
        await instance.supervisor.terminate()
        assert (await instance.supervisor.wait()).reason is ExitReason.TERMINATED
        with pytest.raises(L4MError, match=r"GetVariable failed \(UNAUTHENTICATED\)"):
            await runtime.get("x")  # the token is looked up per call, as on gRPC
        await runtime.close()

    run(tmp_path, body)


# The modules a controller imports to run (the runner, its SDK, the event loop) and the clients it makes
# on framed addresses: none may import grpc (docs/benchmarks.md, "Controller memory": ~2.8 MiB per
# controller). (No connection here: a controller in a real sandbox checks the same after its calls,
# tests/integration/spawner/test_with_scheduler.py.)
_IDLE_IMPORTS = """
import asyncio, sys
import l4m.controller, l4m.runtime, l4m.session, l4m.framed, l4m.wire.frames, l4m.instance, l4m.model, uvloop
from l4m.session import Session
from l4m.runtime import RuntimeClient

async def clients():
    session = await Session.connect("framed:///run/l4m/scheduler.frames.sock")
    runtime = RuntimeClient("unix:///run/l4m/runtime.sock", "t", framed_address="framed:///run/l4m/runtime.frames.sock")
    print(type(session).__name__, type(runtime).__name__)

asyncio.run(clients())
print(sorted(name for name in sys.modules if name == "grpc" or name.startswith("grpc.")))
"""


def test_the_idle_controller_path_never_imports_grpc() -> None:
    done = subprocess.run([sys.executable, "-c", _IDLE_IMPORTS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Session", "RuntimeClient", "[]"], done.stdout
