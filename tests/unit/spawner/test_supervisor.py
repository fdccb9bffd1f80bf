"""The supervisor over a fake sandbox: lines, replay, output and wall-time limits, one exit report."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from l4m.spawner.sandbox import (
    ExitFacts,
    ExitInfo,
    ExitReason,
    Limits,
    OutputChunk,
    OutputStream,
    Sandbox,
    SandboxHandle,
    SandboxSpec,
    derive_exit_info,
)
from l4m.spawner.supervisor import (
    EXITED_REPLAY_BYTES,
    ITEM_OVERHEAD_BYTES,
    ExitEvent,
    InstanceState,
    InstanceSupervisor,
    MessageEvent,
    OutputEvent,
    affordable_prefix,
    output_charge,
)


class FakeHandle(SandboxHandle):
    """Emits scripted chunks; then either exits with `exit_code` or runs until killed."""

    def __init__(self, spec: SandboxSpec, chunks: list[OutputChunk], exit_code: int | None) -> None:
        self.instance_id = spec.instance_id
        self.spec = spec
        self._limits = spec.limits
        self._chunks = chunks
        self._exit_code = exit_code
        self._killed = asyncio.Event()
        self._kill_reason: ExitReason | None = None
        self._kill_message = ""
        self.num_waits = 0

    async def output(self) -> AsyncIterator[OutputChunk]:
        for chunk in self._chunks:
            if self._killed.is_set():
                return
            yield chunk
            await asyncio.sleep(0)
        if self._exit_code is None:
            await self._killed.wait()

    async def wait(self) -> ExitInfo:
        self.num_waits += 1
        if self._exit_code is None:
            await self._killed.wait()
            return derive_exit_info(
                ExitFacts(
                    self._limits, signal=9, kill_reason=self._kill_reason, kill_message=self._kill_message
                )
            )
        stderr_tail = b"".join(c.data for c in self._chunks if c.stream is OutputStream.STDERR)
        return derive_exit_info(ExitFacts(self._limits, exit_code=self._exit_code, stderr_tail=stderr_tail))

    async def kill(self, reason: ExitReason, message: str) -> None:
        if self._kill_reason is None:
            self._kill_reason, self._kill_message = reason, message
        self._killed.set()


class FakeSandbox(Sandbox):
    kind = "fake"

    def __init__(self, chunks: list[OutputChunk], exit_code: int | None = 0) -> None:
        self.chunks, self.exit_code = chunks, exit_code
        self.handles: list[FakeHandle] = []

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        self.handles.append(FakeHandle(spec, self.chunks, self.exit_code))
        return self.handles[-1]

    async def cleanup_orphans(self) -> int:
        return 0

    def enforcement(self) -> dict[str, str]:
        return {}


def out(data: bytes, stream: OutputStream = OutputStream.STDOUT) -> OutputChunk:
    return OutputChunk(stream, data)


def spec(**limits: object) -> SandboxSpec:
    return SandboxSpec("i-1", Path("/nonexistent"), limits=Limits(**limits))


async def collect(supervisor: InstanceSupervisor) -> list[OutputEvent | ExitEvent]:
    return [event async for event in supervisor.subscribe()]


class BusyHandle(FakeHandle):
    """Runs until killed, using `cores` CPU seconds per second of the loop's clock; counts the reads."""

    def __init__(self, spec: SandboxSpec, cores: float) -> None:
        super().__init__(spec, [], exit_code=None)
        self._cores = cores
        self._started_s = asyncio.get_running_loop().time()
        self.num_cpu_reads = 0

    def cpu_time_s(self) -> float | None:
        self.num_cpu_reads += 1
        return self._cores * (asyncio.get_running_loop().time() - self._started_s)


class BusySandbox(FakeSandbox):
    def __init__(self, cores: float) -> None:
        super().__init__([], exit_code=None)
        self._cores = cores

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        self.handles.append(BusyHandle(spec, self._cores))
        return self.handles[-1]


def test_a_sandbox_over_its_cpu_time_on_every_core_is_killed() -> None:
    async def go() -> None:
        sandbox = BusySandbox(cores=2.0)
        supervisor = InstanceSupervisor(
            sandbox, spec(cpu_time_s=0.2), cpu_poll_interval_s=0.01, max_cpu_parallelism=2
        )
        await supervisor.start()
        info = await asyncio.wait_for(supervisor.wait(), 10.0)
        assert info.reason is ExitReason.CPU_TIME_LIMIT, info
        assert "over the limit of 0.2 s" in info.message
        # A read every 10 ms would have taken ~10 reads to get there; the first waited for the budget.
        assert sandbox.handles[0].num_cpu_reads <= 5

    asyncio.run(go())


def test_the_cpu_time_is_not_read_before_the_sandbox_could_have_used_its_budget() -> None:
    async def go() -> None:
        sandbox = BusySandbox(cores=0.0)
        supervisor = InstanceSupervisor(
            sandbox, spec(cpu_time_s=10.0), cpu_poll_interval_s=0.01, max_cpu_parallelism=1
        )
        await supervisor.start()
        await asyncio.sleep(0.2)  # 20 intervals; 10 s of CPU takes one core 10 s
        assert sandbox.handles[0].num_cpu_reads == 2  # the check that it has a CPU count, and the first
        info = await supervisor.terminate()
        assert info.reason is ExitReason.TERMINATED

    asyncio.run(go())


def test_output_is_split_into_lines_per_stream_and_ends_with_one_exit() -> None:
    async def go() -> None:
        sandbox = FakeSandbox([out(b"hel"), out(b"oops\n", OutputStream.STDERR), out(b"lo\nwor"), out(b"ld")])
        supervisor = InstanceSupervisor(sandbox, spec())
        await supervisor.start()
        events = await collect(supervisor)
        assert [(e.stream.value, e.data) for e in events[:-1]] == [
            ("stderr", b"oops\n"),
            ("stdout", b"hello\n"),
            ("stdout", b"world"),
        ]
        assert isinstance(events[-1], ExitEvent) and events[-1].info.reason is ExitReason.EXITED
        assert supervisor.state is InstanceState.EXITED
        assert sandbox.handles[0].num_waits == 1

    asyncio.run(go())


def test_long_lines_are_cut_at_the_line_limit() -> None:
    async def go() -> None:
        supervisor = InstanceSupervisor(FakeSandbox([out(b"x" * 25)]), spec(), max_line_bytes=10)
        await supervisor.start()
        events = await collect(supervisor)
        assert [len(e.data) for e in events[:-1]] == [10, 10, 5]

    asyncio.run(go())


def test_a_late_subscriber_gets_the_replay_and_the_exit() -> None:
    async def go() -> None:
        supervisor = InstanceSupervisor(FakeSandbox([out(b"a\n"), out(b"b\n")]), spec())
        await supervisor.start()
        await supervisor.wait()
        events = await collect(supervisor)
        assert [e.data for e in events[:-1]] == [b"a\n", b"b\n"]
        assert isinstance(events[-1], ExitEvent)

    asyncio.run(go())


def test_output_past_the_limit_kills_with_output_limit() -> None:
    async def go() -> None:
        chunks = [out(b"y" * 99 + b"\n")] * 100
        supervisor = InstanceSupervisor(FakeSandbox(chunks, exit_code=None), spec(max_output_bytes=250))
        await supervisor.start()
        events = await collect(supervisor)
        # The first line costs 100 + ITEM_OVERHEAD_BYTES; what is left of the 250 is cut from the second.
        assert sum(len(e.data) for e in events[:-1]) == 250 - ITEM_OVERHEAD_BYTES
        assert events[-1].info.reason is ExitReason.OUTPUT_LIMIT
        assert f"output limit of 250 bytes (each line and message counts {ITEM_OVERHEAD_BYTES}" in (
            events[-1].info.message
        )

    asyncio.run(go())


def test_wall_time_kills_with_wall_time_limit() -> None:
    async def go() -> None:
        supervisor = InstanceSupervisor(FakeSandbox([], exit_code=None), spec(wall_time_s=0.05))
        await supervisor.start()
        assert (await supervisor.wait()).reason is ExitReason.WALL_TIME_LIMIT

    asyncio.run(go())


def test_terminate_reports_the_reason_given_and_callbacks_run_once() -> None:
    async def go() -> None:
        reports: list[ExitInfo] = []
        supervisor = InstanceSupervisor(FakeSandbox([out(b"ready\n")], exit_code=None), spec())
        supervisor.add_exit_callback(reports.append)
        await supervisor.start()
        info = await supervisor.terminate(ExitReason.TRAPPED, "bad page id 7")
        assert (info.reason, info.message) == (ExitReason.TRAPPED, "bad page id 7")
        assert await supervisor.terminate() == info  # the first reason stands
        assert reports == [info]

    asyncio.run(go())


def test_cancelling_the_supervisor_kills_and_reaps_the_sandbox() -> None:
    async def go() -> None:
        sandbox = FakeSandbox([], exit_code=None)
        supervisor = InstanceSupervisor(sandbox, spec())
        await supervisor.start()
        await asyncio.sleep(0.01)
        supervisor._run_task.cancel()
        await asyncio.sleep(0.01)
        handle = sandbox.handles[0]
        assert handle._kill_reason is ExitReason.KILLED
        assert handle.num_waits == 1

    asyncio.run(go())


def test_output_ending_exactly_at_the_limit_then_more_still_kills() -> None:
    # Chunks that fill the limit exactly, then one more byte: the next chunk finds no room at all.
    async def go() -> None:
        sandbox = FakeSandbox([out(b"x" * 5 + b"\n"), out(b"y" * 6), out(b"z"), out(b"more")], exit_code=None)
        supervisor = InstanceSupervisor(sandbox, spec(max_output_bytes=12 + ITEM_OVERHEAD_BYTES))
        await supervisor.start()
        events = await collect(supervisor)
        assert events[-1].info.reason is ExitReason.OUTPUT_LIMIT
        assert b"".join(e.data for e in events[:-1]) == b"xxxxx\nyyyyyy"

    asyncio.run(go())


def test_refine_exit_and_output_counter_hooks() -> None:
    async def go() -> None:
        counted: list[int] = []
        supervisor = InstanceSupervisor(
            FakeSandbox([out(b"ab\n"), out(b"cd\n")], exit_code=3),
            spec(),
            refine_exit=lambda info: ExitInfo(ExitReason.TRAPPED, "refined", info.exit_code),
            count_output_bytes=counted.append,
        )
        await supervisor.start()
        events = await collect(supervisor)
        assert events[-1].info == ExitInfo(ExitReason.TRAPPED, "refined", 3)
        assert sum(counted) == 6

    asyncio.run(go())


def test_affordable_prefix_fits_the_charge() -> None:
    data = b"ab\n\ncdef\n"
    for room in range(output_charge(data) + 1):
        prefix = affordable_prefix(data, room)
        assert output_charge(prefix) <= room
        assert data.startswith(prefix)
        longer = data[: len(prefix) + 1]
        assert len(prefix) == len(data) or output_charge(longer) > room
    assert affordable_prefix(data, output_charge(data)) == data


def test_a_million_empty_lines_hit_the_output_limit_and_the_replay_stays_bounded() -> None:
    """Issue #17: 8x10^6 empty lines kept 100-320 MB. Each line now costs ITEM_OVERHEAD_BYTES + 1, against
    the 16 MiB default output limit and in the 1 MiB replay buffer (64 KiB once exited)."""

    async def go() -> None:
        chunks = [out(b"\n" * 65536)] * 16  # 1,048,576 empty lines
        supervisor = InstanceSupervisor(FakeSandbox(chunks, exit_code=None), spec())
        await supervisor.start()
        info = await supervisor.wait()
        assert info.reason is ExitReason.OUTPUT_LIMIT
        num_kept = len(supervisor._history) - 1
        assert num_kept <= EXITED_REPLAY_BYTES // (ITEM_OVERHEAD_BYTES + 1)
        events = await collect(supervisor)
        assert len(events) == num_kept + 1 and isinstance(events[-1], ExitEvent)
        print(f"1,048,576 empty lines: {supervisor.num_output_bytes} bytes charged, {num_kept} lines kept")

    asyncio.run(go())


def test_empty_messages_cost_the_overhead_and_are_refused_past_the_limit() -> None:
    async def go() -> None:
        limit = 1 << 20
        supervisor = InstanceSupervisor(FakeSandbox([], exit_code=None), spec(max_output_bytes=limit))
        await supervisor.start()
        num_sent = 0
        for _ in range(100_000):
            if not await supervisor.publish_message(""):
                break
            num_sent += 1
            # While running, the replay holds at most DEFAULT_MAX_REPLAY_BYTES of charge.
            assert len(supervisor._history) <= (1 << 20) // ITEM_OVERHEAD_BYTES
        assert num_sent == limit // ITEM_OVERHEAD_BYTES
        info = await supervisor.wait()
        assert info.reason is ExitReason.OUTPUT_LIMIT
        messages = [e for e in await collect(supervisor) if isinstance(e, MessageEvent)]
        assert len(messages) == EXITED_REPLAY_BYTES // ITEM_OVERHEAD_BYTES

    asyncio.run(go())


def test_an_exited_instance_keeps_only_the_tail_of_its_output() -> None:
    async def go() -> None:
        lines = [out(b"%07d\n" % i) for i in range(20_000)]  # 72 bytes charged each, 1.4 MB in all
        supervisor = InstanceSupervisor(FakeSandbox(lines), spec())
        await supervisor.start()
        await supervisor.wait()
        events = await collect(supervisor)
        kept = [e.data for e in events[:-1]]
        assert kept[-1] == b"0019999\n" and len(kept) == EXITED_REPLAY_BYTES // (8 + ITEM_OVERHEAD_BYTES)
        assert supervisor._handle is None

    asyncio.run(go())
