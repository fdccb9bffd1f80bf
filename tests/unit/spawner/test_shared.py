"""The spawner's side of shared controller processes (spawner/shared.py), behind the Sandbox interface with a
fake backend: who joins which process, what a report may say, and how instances end with their process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from l4m.spawner import shared
from l4m.spawner.sandbox import (
    ExitInfo,
    ExitReason,
    Limits,
    OutputChunk,
    OutputStream,
    Sandbox,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
)
from l4m.spawner.shared import SharedProcesses, ShareKey
from l4m.v1 import spawner_pb2
from l4m.wire import frames


class FakeHandle(SandboxHandle):
    """A process that runs until killed or `end`ed; its output is what `say` gives it."""

    def __init__(self, spec: SandboxSpec) -> None:
        self.instance_id = spec.instance_id
        self.spec = spec
        self.kills: list[tuple[ExitReason, str]] = []
        self._output: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self._exit: asyncio.Future[ExitInfo] = asyncio.get_running_loop().create_future()

    def say(self, data: bytes) -> None:
        self._output.put_nowait(OutputChunk(OutputStream.STDERR, data))

    def end(self, info: ExitInfo) -> None:
        if not self._exit.done():
            self._output.put_nowait(None)
            self._exit.set_result(info)

    async def output(self) -> AsyncIterator[OutputChunk]:
        while (chunk := await self._output.get()) is not None:
            yield chunk

    async def wait(self) -> ExitInfo:
        return await asyncio.shield(self._exit)

    async def kill(self, reason: ExitReason, message: str) -> None:
        self.kills.append((reason, message))
        self.end(ExitInfo(reason, message, None, 9, "spawner"))


class FakeSandbox(Sandbox):
    kind = "fake"

    def __init__(self, fails: bool = False) -> None:
        self.handles: list[FakeHandle] = []
        self.fails = fails

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        await asyncio.sleep(0)
        if self.fails:
            raise SandboxError("no sandbox today")
        handle = FakeHandle(spec)
        self.handles.append(handle)
        return handle

    async def cleanup_orphans(self) -> int:
        return 0

    def enforcement(self) -> dict[str, str]:
        return {}


class FakeConnection:
    def __init__(self) -> None:
        self.frames: list[tuple[int, bytes]] = []
        self.decoder = frames.FrameDecoder(1 << 20)
        self.is_closed = False

    def write(self, data: bytes) -> None:
        self.frames += self.decoder.feed(data)

    def close(self) -> None:
        self.is_closed = True

    def slots(self) -> list[spawner_pb2.SharedProcessSlot]:
        return [spawner_pb2.SharedProcessSlot.FromString(p) for kind, p in self.frames if kind == frames.SHARED_SLOT]


KEY = ShareKey("alice", "a" * 64, "", Limits())


def _spec(instance_id: str) -> SandboxSpec:
    return SandboxSpec(instance_id, Path("/p/main.py"), ("x", instance_id), {"L4M_INSTANCE_TOKEN": f"t-{instance_id}"},
                       None, KEY.limits, runner_module="l4m.controller")


def _processes(sandbox: Sandbox, capacity: int = 4) -> SharedProcesses:
    return SharedProcesses(sandbox, capacity, lambda token, key: {shared.PROCESS_TOKEN_ENV: token, "L4M_MODEL": key.model},
                           "l4m.controller")


def _report(instance_id: str, **fields: object) -> bytes:
    return spawner_pb2.SharedProcessReport(instance_id=instance_id, **fields).SerializeToString()


def test_launches_with_one_key_share_a_process_up_to_its_capacity_and_another_key_never() -> None:
    async def go() -> None:
        sandbox = FakeSandbox()
        processes = _processes(sandbox, capacity=2)
        a, b = await asyncio.gather(processes.start(KEY, _spec("i-a")), processes.start(KEY, _spec("i-b")))
        c = await processes.start(KEY, _spec("i-c"))
        other = await processes.start(ShareKey("bob", KEY.program_sha256, "", Limits()), _spec("i-d"))
        assert a.process is b.process and c.process is not a.process and other.process not in (a.process, c.process)
        assert len(sandbox.handles) == 3
        first = sandbox.handles[0]
        assert first.spec.env[shared.PROCESS_TOKEN_ENV] == a.process.token and first.spec.args == ()
        assert "L4M_INSTANCE_TOKEN" not in first.spec.env
        assert (a.is_first, b.is_first) == (True, False)
        # Each instance's token and arguments go to the process once it connects, in launch order.
        connection = FakeConnection()
        a.process.connected(connection)  # type: ignore[arg-type]
        assert [(s.instance_id, s.instance_token, list(s.args)) for s in connection.slots()] == [
            ("i-a", "t-i-a", ["x", "i-a"]), ("i-b", "t-i-b", ["x", "i-b"])]
        await processes.close()

    asyncio.run(go())


def test_reports_reach_their_own_instance_only_and_the_last_exit_retires_the_process() -> None:
    async def go() -> None:
        processes = _processes(FakeSandbox())
        a, b = await asyncio.gather(processes.start(KEY, _spec("i-a")), processes.start(KEY, _spec("i-b")))
        process = a.process
        connection = FakeConnection()
        process.connected(connection)  # type: ignore[arg-type]
        assert process.report(_report("i-a", stdout=b"hello a\n")) is None
        assert process.report(_report("i-b", stderr=b"hello b\n")) is None
        why = process.report(_report("i-zzz", stdout=b"not mine"))
        assert why is not None and "'i-zzz', which the spawner did not start in this process" in why
        assert "does not parse" in (process.report(b"\xff\xff") or "")
        assert process.report(_report("i-a", exit=spawner_pb2.SharedProcessExit(exit_code=1, message="ValueError: x"))) \
            is None
        assert await a.wait() == ExitInfo(ExitReason.CRASHED, "exited with status 1: ValueError: x", 1, None)
        assert [chunk async for chunk in a.output()] == [OutputChunk(OutputStream.STDOUT, b"hello a\n")]
        # An ended instance is not the process's any more: a report on it is refused.
        assert "did not start in this process or has ended" in (process.report(_report("i-a", stdout=b"late")) or "")
        assert not connection.is_closed and process.can_join()
        assert process.report(_report("i-b", exit=spawner_pb2.SharedProcessExit(exit_code=0))) is None
        assert (await b.wait()).reason is ExitReason.EXITED
        assert connection.is_closed and not process.can_join()  # retired: the next launch starts a new one
        c = await processes.start(KEY, _spec("i-c"))
        assert c.process is not process
        await processes.close()

    asyncio.run(go())


def test_an_instance_that_does_not_stop_gets_its_process_killed_and_the_others_hear_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shared, "STOP_GRACE_S", 0.05)

    async def go() -> None:
        sandbox = FakeSandbox()
        processes = _processes(sandbox)
        a, b, c = await asyncio.gather(*(processes.start(KEY, _spec(i)) for i in ("i-a", "i-b", "i-c")))
        connection = FakeConnection()
        a.process.connected(connection)  # type: ignore[arg-type]
        await a.kill(ExitReason.WALL_TIME_LIMIT, "ran past its wall time limit of 1 s")
        assert [(s.instance_id, s.stop) for s in connection.slots()][-1] == ("i-a", True)
        # a stops in time: its own reason, nothing else happens.
        a.process.report(_report("i-a", exit=spawner_pb2.SharedProcessExit(exit_code=143, message="stopped")))
        assert (await a.wait()).reason is ExitReason.WALL_TIME_LIMIT
        await b.kill(ExitReason.TERMINATED, "terminated on request")
        info_b, info_c = await asyncio.wait_for(asyncio.gather(b.wait(), c.wait()), 5)
        assert sandbox.handles[0].kills == [
            (ExitReason.KILLED, f"instance i-b in it did not stop within {shared.STOP_GRACE_S:g} s of being told to")]
        assert info_b == ExitInfo(ExitReason.TERMINATED, "terminated on request", None, 9, "spawner")
        assert info_c.reason is ExitReason.KILLED
        assert info_c.message == (f"its shared process {c.process.process_id} ended: instance i-b in it did not stop "
                                  f"within {shared.STOP_GRACE_S:g} s of being told to")
        await processes.close()

    asyncio.run(go())


def test_a_process_that_ends_ends_its_instances_with_its_reason_and_shares_its_output() -> None:
    async def go() -> None:
        sandbox = FakeSandbox()
        processes = _processes(sandbox)
        a, b = await asyncio.gather(processes.start(KEY, _spec("i-a")), processes.start(KEY, _spec("i-b")))
        handle = sandbox.handles[0]
        handle.say(b"Fatal Python error: Segmentation fault\n")
        await asyncio.sleep(0.01)
        handle.end(ExitInfo(ExitReason.MEMORY_LIMIT, "killed by the kernel's OOM killer", None, 9, "cgroup memory"))
        for slot in (a, b):
            info = await slot.wait()
            assert info.reason is ExitReason.MEMORY_LIMIT and info.enforced_by == "cgroup memory"
            assert info.message == f"its shared process {a.process.process_id} ended: killed by the kernel's OOM killer"
            assert [c.data async for c in slot.output()] == [b"Fatal Python error: Segmentation fault\n"]
        assert (await processes.start(KEY, _spec("i-c"))).process is not a.process
        await processes.close()

    asyncio.run(go())


def test_a_process_that_cannot_start_fails_every_launch_waiting_on_it() -> None:
    async def go() -> None:
        processes = _processes(FakeSandbox(fails=True))
        results = await asyncio.gather(processes.start(KEY, _spec("i-a")), processes.start(KEY, _spec("i-b")),
                                       return_exceptions=True)
        assert [type(r) for r in results] == [SandboxError, SandboxError], results
        assert processes.by_token("anything") is None and not processes._open

    asyncio.run(go())


def test_a_process_connection_that_ends_under_its_instances_gets_it_killed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, "DISCONNECT_GRACE_S", 0.01)

    async def go() -> None:
        sandbox = FakeSandbox()
        processes = _processes(sandbox)
        a = await processes.start(KEY, _spec("i-a"))
        a.process.connected(FakeConnection())  # type: ignore[arg-type]
        a.process.disconnected()
        info = await asyncio.wait_for(a.wait(), 5)
        assert info.reason is ExitReason.KILLED and "its control connection to the spawner ended" in info.message
        assert processes.by_token(a.process.token) is None

    asyncio.run(go())
