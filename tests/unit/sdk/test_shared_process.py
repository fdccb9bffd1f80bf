"""The SDK's side of a shared controller process (l4m.shared_process): what an instance writes goes to its
own reports, the process's own writes do not, and a slot frame starts a task in the instance's context.
The instances' runs are stubbed here (`run_loaded`); tests/integration/spawner/test_shared_process.py runs
real ones in real sandboxes."""

from __future__ import annotations

import asyncio
import io
import sys
from typing import Any

import pytest

from l4m import shared_process
from l4m.controller import ControllerConfig
from l4m.errors import Trapped
from l4m.shared_process import SharedProcess, _InstanceWriter, current_instance
from l4m.v1 import l4m_pb2, spawner_pb2
from l4m.wire import frames
from l4m.wire.status import StatusCode


class FakeTransport:
    def __init__(self) -> None:
        self.decoder = frames.FrameDecoder(8 << 20)
        self.frames: list[tuple[int, bytes]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.frames += self.decoder.feed(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def reports(self) -> list[spawner_pb2.SharedProcessReport]:
        return [spawner_pb2.SharedProcessReport.FromString(p) for k, p in self.frames if k == frames.SHARED_REPORT]


CONFIG = ControllerConfig("framed:///run/l4m/scheduler.frames.sock", "unix:///run/l4m/runtime.sock", None, "", None,
                          "framed:///run/l4m/runtime.frames.sock")


def _opened_process() -> tuple[SharedProcess, FakeTransport]:
    async def main(ctx: Any) -> None:
        return None

    process = SharedProcess(main, "/opt/l4m/program/main.py", CONFIG)
    transport = FakeTransport()
    process.connection_made(transport)  # type: ignore[arg-type]
    process.data_received(frames.status_frame(StatusCode.OK))
    return process, transport


def _slot(instance_id: str, *args: str, stop: bool = False) -> bytes:
    return frames.encode(frames.SHARED_SLOT, spawner_pb2.SharedProcessSlot(
        instance_id=instance_id, instance_token=f"t-{instance_id}", args=list(args), stop=stop))


def test_each_instance_runs_in_its_context_with_its_token_and_reports_its_output_and_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str | None, str | None, tuple[str, ...]]] = []

    async def fake_run_loaded(main: Any, program: str, args: tuple[str, ...], config: ControllerConfig) -> Any:
        seen.append((current_instance.get(), config.instance_token, args))
        print(f"hello from {config.instance_id}")
        await asyncio.sleep(0)
        if args == ("raise",):
            raise ValueError("boom")
        if args == ("trap",):
            raise Trapped(l4m_pb2.TRAP_KIND_TOKEN_BUDGET, "the token budget of 8 is used up")
        if args == ("wait",):
            await asyncio.sleep(60)
        if args == ("exit",):
            sys.exit(4)
        return 7 if args == ("seven",) else None

    monkeypatch.setattr(shared_process, "run_loaded", fake_run_loaded)

    async def go() -> tuple[FakeTransport, str]:
        process, transport = _opened_process()
        fallback = io.StringIO()
        writer = _InstanceWriter(process, "stdout", fallback)  # type: ignore[arg-type]
        monkeypatch.setattr("sys.stdout", writer)
        monkeypatch.setattr("sys.stderr", _InstanceWriter(process, "stderr", io.StringIO()))  # type: ignore[arg-type]
        process.data_received(_slot("i-a") + _slot("i-b", "raise") + _slot("i-c", "seven") + _slot("i-d", "trap")
                              + _slot("i-e", "wait") + _slot("i-f", "exit"))
        print("the process itself")
        await asyncio.sleep(0.05)
        process.data_received(_slot("i-e", stop=True))
        while process.tasks:
            await asyncio.wait(list(process.tasks.values()))
        return transport, fallback.getvalue()

    transport, process_output = asyncio.run(go())
    assert sorted(seen) == [("i-a", "t-i-a", ()), ("i-b", "t-i-b", ("raise",)), ("i-c", "t-i-c", ("seven",)),
                            ("i-d", "t-i-d", ("trap",)), ("i-e", "t-i-e", ("wait",)), ("i-f", "t-i-f", ("exit",))]
    assert process_output == "the process itself\n"
    reports = transport.reports()
    stdout = {r.instance_id: b"" for r in reports}
    for report in reports:
        if report.WhichOneof("report") == "stdout":
            stdout[report.instance_id] += report.stdout
    assert stdout == {i: f"hello from {i}\n".encode() for i in ("i-a", "i-b", "i-c", "i-d", "i-e", "i-f")}
    exits = {r.instance_id: (r.exit.exit_code, r.exit.message) for r in reports if r.HasField("exit")}
    assert exits == {"i-a": (0, ""), "i-b": (1, "ValueError: boom"), "i-c": (7, ""),
                     "i-d": (3, f"l4m.controller: trapped: {Trapped(l4m_pb2.TRAP_KIND_TOKEN_BUDGET, 'the token budget of 8 is used up')}"),
                     "i-e": (143, "l4m.controller: stopped"), "i-f": (4, "")}


def test_a_large_write_goes_in_reports_under_the_frame_limit() -> None:
    async def go() -> list[spawner_pb2.SharedProcessReport]:
        process, transport = _opened_process()
        process._tails["i-a"] = bytearray()
        token = current_instance.set("i-a")
        try:
            writer = _InstanceWriter(process, "stdout", io.StringIO())  # type: ignore[arg-type]
            writer.write("x" * (3 * shared_process.MAX_REPORT_BYTES + 5))
            writer.buffer.write(b"tail\n")
        finally:
            current_instance.reset(token)
        return transport.reports()

    reports = asyncio.run(go())
    assert [len(r.stdout) for r in reports] == [shared_process.MAX_REPORT_BYTES] * 3 + [5, 5]
    assert b"".join(r.stdout for r in reports) == b"x" * (3 * shared_process.MAX_REPORT_BYTES + 5) + b"tail\n"


def test_a_refused_or_broken_connection_stops_the_instances_and_says_why() -> None:
    async def go() -> tuple[str | None, bool]:
        process, transport = _opened_process()
        process.data_received(frames.status_frame(StatusCode.INVALID_ARGUMENT, "a report on 'i-x', ..."))
        why = await process._end_of_connection
        return why, transport.closed

    why, closed = asyncio.run(go())
    assert why == "the spawner ended this shared process's connection (INVALID_ARGUMENT): a report on 'i-x', ..."
    assert closed
