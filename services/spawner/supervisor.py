"""One instance's life from launch to its single exit report, the same on every backend.

The supervisor owns the limits the spawner itself enforces: wall time (a timer), output bytes
(counted as output is read; the first byte past the limit kills the instance) and sandbox-wide CPU
time where the backend can measure it (polled, no sooner than the sandbox could have used up its
budget on every core: see `_poll_cpu_time`). It splits output into lines, replays what was
already said to late subscribers, reports one ExitInfo to every subscriber and exit callback, and
always waits for the handle, which releases what the sandbox held (cgroups, uid, container).

Every output line and every message costs its bytes plus `ITEM_OVERHEAD_BYTES`, both against the
output limit and in the replay buffer, so empty lines or messages are not free: the replay buffer holds
at most `max_replay_bytes` of that charge while the instance runs (1 MiB: at most ~16,000 empty items)
and `EXITED_REPLAY_BYTES` once it has exited (the tail of what it said, then its exit).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from l4m.spawner.sandbox import (
    ExitInfo,
    ExitReason,
    OutputChunk,
    OutputStream,
    Sandbox,
    SandboxHandle,
    SandboxSpec,
)

DEFAULT_MAX_LINE_BYTES = 64 * 1024
DEFAULT_MAX_REPLAY_BYTES = 1024 * 1024
# What one output line or message costs beyond its payload: the event object, its bytes/str header and
# its slot in the replay deque take ~100 bytes (measured with tracemalloc); 64 is charged, so that the
# replay buffer's real size stays within ~2.5x its charge even when it holds nothing but empty items.
ITEM_OVERHEAD_BYTES = 64
# An exited instance keeps this much of its replay (the tail, by the same charge) for late attaches.
EXITED_REPLAY_BYTES = 64 * 1024


class InstanceState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    EXITED = "exited"


@dataclass(frozen=True, slots=True)
class OutputEvent:
    """A line of output (with its newline), or a fragment of one longer than the line limit."""

    stream: OutputStream
    data: bytes


@dataclass(frozen=True, slots=True)
class MessageEvent:
    """A message the controller sent to its user through the runtime (not through its output)."""

    text: str


@dataclass(frozen=True)
class ExitEvent:
    info: ExitInfo


InstanceEvent = OutputEvent | MessageEvent | ExitEvent
ExitCallback = Callable[[ExitInfo], Awaitable[None] | None]
# Rewrites the backend's ExitInfo before anyone sees it (the manager turns a runner's trap exit into
# TRAPPED); counts output bytes as they are read (metrics).
ExitRefiner = Callable[[ExitInfo], ExitInfo]
OutputCounter = Callable[[int], None]


class _LineSplitter:
    def __init__(self, max_line_bytes: int) -> None:
        self._max_line_bytes = max_line_bytes
        self._buffers: dict[OutputStream, bytearray] = collections.defaultdict(bytearray)

    def feed(self, chunk: OutputChunk) -> list[OutputEvent]:
        buffer = self._buffers[chunk.stream]
        buffer += chunk.data
        events: list[OutputEvent] = []
        while True:
            end = buffer.find(b"\n")
            if end < 0 and len(buffer) < self._max_line_bytes:
                return events
            cut = end + 1 if 0 <= end < self._max_line_bytes else self._max_line_bytes
            events.append(OutputEvent(chunk.stream, bytes(buffer[:cut])))
            del buffer[:cut]

    def flush(self) -> list[OutputEvent]:
        events = [OutputEvent(stream, bytes(buffer)) for stream, buffer in self._buffers.items() if buffer]
        self._buffers.clear()
        return events


class InstanceSupervisor:
    """Launches one sandbox and watches it until it exits. Create one per instance."""

    def __init__(
        self,
        sandbox: Sandbox,
        spec: SandboxSpec,
        *,
        cpu_poll_interval_s: float = 0.25,
        max_cpu_parallelism: int = os.cpu_count() or 1,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_replay_bytes: int = DEFAULT_MAX_REPLAY_BYTES,
        refine_exit: ExitRefiner | None = None,
        count_output_bytes: OutputCounter | None = None,
    ) -> None:
        self.spec = spec
        self._refine_exit = refine_exit
        self._count_output_bytes = count_output_bytes
        self._sandbox = sandbox
        self._cpu_poll_interval_s = cpu_poll_interval_s
        self._max_cpu_parallelism = max(1, max_cpu_parallelism)  # CPU seconds a sandbox can use per second
        self._splitter = _LineSplitter(max_line_bytes)
        self._max_replay_bytes = max_replay_bytes
        self._history: collections.deque[InstanceEvent] = collections.deque()
        self._history_bytes = 0
        self._subscribers: set[asyncio.Queue[InstanceEvent]] = set()
        self._kills: set[asyncio.Future[None]] = set()  # output-limit kills started from publish_message_nowait
        self._exit_callbacks: list[ExitCallback] = []
        self._handle: SandboxHandle | None = None
        self._is_warm = False
        self._run_task: asyncio.Task[ExitInfo] | None = None
        self.state = InstanceState.STARTING
        self.exit_info: ExitInfo | None = None
        self.num_output_bytes = 0
        self.started_at_monotonic_s = 0.0
        self.first_output_at_monotonic_s: float | None = None

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    @property
    def sandbox(self) -> Sandbox:
        """What it starts its sandbox through."""
        return self._sandbox

    @property
    def is_warm(self) -> bool:
        """Whether the sandbox came from a warm pool (False until started)."""
        return self._is_warm

    def add_exit_callback(self, callback: ExitCallback) -> None:
        """`callback(exit_info)` runs once when the instance has exited and been cleaned up."""
        self._exit_callbacks.append(callback)

    async def start(self) -> None:
        """Launches the sandbox; raises SandboxError if it cannot start."""
        self.started_at_monotonic_s = time.monotonic()
        self._handle = await self._sandbox.start(self.spec)
        self._is_warm = self._handle.is_warm
        self.state = InstanceState.RUNNING
        self._run_task = asyncio.create_task(self._run(self._handle), name=f"instance-{self.instance_id}")

    async def wait(self) -> ExitInfo:
        if self._run_task is None:
            raise RuntimeError("the instance was never started")
        return await asyncio.shield(self._run_task)

    async def terminate(
        self, reason: ExitReason = ExitReason.TERMINATED, message: str = "terminated on request"
    ) -> ExitInfo:
        """Kills the instance (the first reason given wins) and waits for its exit report."""
        if self._handle is not None and self.state is InstanceState.RUNNING:
            await self._handle.kill(reason, message)
        return await self.wait()

    async def subscribe(self) -> AsyncIterator[InstanceEvent]:
        """Output seen so far (up to the replay limit), then live output, then one ExitEvent."""
        async for events in self.subscribe_batches():
            for event in events:
                yield event

    async def subscribe_batches(self) -> AsyncIterator[list[InstanceEvent]]:
        """What `subscribe` yields, in lists: each holds every event that was ready when it was taken (the
        replayed output in one, then whatever arrived while the last list was being handed on)."""
        queue: asyncio.Queue[InstanceEvent] = asyncio.Queue()
        backlog = list(self._history)
        if self.exit_info is None:
            self._subscribers.add(queue)
        try:
            if self.exit_info is not None:
                if not backlog or not isinstance(backlog[-1], ExitEvent):
                    backlog.append(ExitEvent(self.exit_info))
                yield backlog
                return
            if backlog:
                yield backlog
            while True:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                yield events
                if isinstance(events[-1], ExitEvent):
                    return
        finally:
            self._subscribers.discard(queue)

    async def publish_message(self, text: str) -> bool:
        """Forwards a controller's message to subscribers; its bytes plus `ITEM_OVERHEAD_BYTES` count
        against the output limit.

        Returns False (and kills the instance) when the message would go past the limit."""
        verdict = self._charge_message(text)
        if verdict == "over the limit":
            await self._kill_for_output()
        return verdict == "published"

    def publish_message_nowait(self, text: str) -> str:
        """`publish_message` for a caller that cannot wait (a frame handler): "published", "not running",
        or "over the limit" (the kill then runs as a task of its own)."""
        verdict = self._charge_message(text)
        if verdict == "over the limit":
            task = asyncio.ensure_future(self._kill_for_output())
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)
        return verdict

    def _charge_message(self, text: str) -> str:
        """"published", "not running", or "over the limit" (charged, not published: the caller kills)."""
        if self.state is not InstanceState.RUNNING or self._handle is None:
            return "not running"
        size = len(text.encode())
        charge = size + ITEM_OVERHEAD_BYTES
        self.num_output_bytes += charge
        if self.num_output_bytes > self.spec.limits.max_output_bytes:
            return "over the limit"
        if self._count_output_bytes is not None:
            self._count_output_bytes(size)
        self._publish(MessageEvent(text))
        return "published"

    async def _kill_for_output(self) -> None:
        assert self._handle is not None
        await self._handle.kill(ExitReason.OUTPUT_LIMIT, _over_limit_message(self.spec.limits.max_output_bytes))

    # -- internals -------------------------------------------------------------------------------

    async def _run(self, handle: SandboxHandle) -> ExitInfo:
        limits = self.spec.limits
        watchers = [asyncio.create_task(self._kill_after_wall_time(handle, limits.wall_time_s))]
        if handle.cpu_time_s() is not None:
            watchers.append(asyncio.create_task(self._poll_cpu_time(handle, limits.cpu_time_s)))
        try:
            await self._pump_output(handle, limits.max_output_bytes)
        except BaseException:
            # Cancelled (the spawner is stopping) or broken: the sandbox must not outlive us.
            await handle.kill(ExitReason.KILLED, "the spawner stopped watching the instance")
            raise
        finally:
            # Always reaped, so its cgroups, uid or container are released.
            info = await handle.wait()
            for watcher in watchers:
                watcher.cancel()
        if self._refine_exit is not None:
            info = self._refine_exit(info)
        for event in self._splitter.flush():
            self._publish(event)
        self.state = InstanceState.EXITED
        self.exit_info = info
        self._publish(ExitEvent(info))
        self._keep_exited_summary()
        for callback in self._exit_callbacks:
            result = callback(info)
            if inspect.isawaitable(result):
                await result
        return info

    async def _pump_output(self, handle: SandboxHandle, max_output_bytes: int) -> None:
        is_over_limit = False
        async for chunk in handle.output():
            if self.first_output_at_monotonic_s is None:
                self.first_output_at_monotonic_s = time.monotonic()
            room = max_output_bytes - self.num_output_bytes
            charge = output_charge(chunk.data)
            self.num_output_bytes += charge
            data = chunk.data if charge <= room else affordable_prefix(chunk.data, room)
            if self._count_output_bytes is not None:
                self._count_output_bytes(len(data))
            if charge > room and not is_over_limit:
                # The first byte past the limit kills, also when the output before it ended exactly
                # at the limit (room == 0 here).
                is_over_limit = True
                await handle.kill(ExitReason.OUTPUT_LIMIT, _over_limit_message(max_output_bytes))
            if not data:
                continue  # drain what was in flight after the kill
            for event in self._splitter.feed(OutputChunk(chunk.stream, data)):
                self._publish(event)

    async def _kill_after_wall_time(self, handle: SandboxHandle, wall_time_s: float) -> None:
        await asyncio.sleep(wall_time_s)
        await handle.kill(ExitReason.WALL_TIME_LIMIT, f"ran past its wall time limit of {wall_time_s:g} s")

    async def _poll_cpu_time(self, handle: SandboxHandle, cpu_time_s: float) -> None:
        # rlimit cpu stops each process at the limit; this catches a sandbox that shares the work
        # among many processes, each under the limit, together over it. A read costs the event loop a
        # file read, and a burst of short instances used to make hundreds a second: since a sandbox
        # uses at most `max_cpu_parallelism` CPU seconds per second, the next read waits until it could
        # have gone over (at least the poll interval), so it kills no later than a read every interval.
        used = handle.cpu_time_s() or 0.0
        while True:
            room_s = cpu_time_s + self._cpu_poll_interval_s - used
            await asyncio.sleep(max(self._cpu_poll_interval_s, room_s / self._max_cpu_parallelism))
            measured = handle.cpu_time_s()
            used = measured if measured is not None else used
            if used > cpu_time_s + self._cpu_poll_interval_s:
                await handle.kill(
                    ExitReason.CPU_TIME_LIMIT,
                    f"its processes used {used:.1f} s of CPU, over the limit of {cpu_time_s:g} s",
                )
                return

    def _keep_exited_summary(self) -> None:
        """An exited instance keeps only the tail of its replay (`EXITED_REPLAY_BYTES`) and its exit,
        and lets go of its sandbox handle: a summary, not its whole history."""
        self._trim_history(EXITED_REPLAY_BYTES)
        self._handle = None

    def _trim_history(self, max_bytes: int) -> None:
        while self._history_bytes > max_bytes and not isinstance(self._history[0], ExitEvent):
            self._history_bytes -= _event_bytes(self._history.popleft())

    def _publish(self, event: InstanceEvent) -> None:
        self._history.append(event)
        self._history_bytes += _event_bytes(event)
        self._trim_history(self._max_replay_bytes)
        for queue in self._subscribers:
            queue.put_nowait(event)


def output_charge(data: bytes) -> int:
    """What output counts against the output limit: its bytes plus ITEM_OVERHEAD_BYTES per line."""
    return len(data) + ITEM_OVERHEAD_BYTES * data.count(b"\n")


def affordable_prefix(data: bytes, room: int) -> bytes:
    """The longest prefix of `data` whose `output_charge` fits in `room` (a partial last line costs
    its bytes only: it has no newline yet)."""
    start = spent = 0
    while start < len(data):
        newline = data.find(b"\n", start)
        if newline < 0:
            break
        line_charge = newline + 1 - start + ITEM_OVERHEAD_BYTES
        if spent + line_charge > room:
            return data[: start + max(0, min(room - spent, newline - start))]
        spent += line_charge
        start = newline + 1
    return data[: start + max(0, min(room - spent, len(data) - start))]


def _over_limit_message(max_output_bytes: int) -> str:
    return (
        f"wrote more than its output limit of {max_output_bytes} bytes "
        f"(each line and message counts {ITEM_OVERHEAD_BYTES} bytes more than its text)"
    )


def _event_bytes(event: InstanceEvent) -> int:
    if isinstance(event, OutputEvent):
        return len(event.data) + ITEM_OVERHEAD_BYTES
    if isinstance(event, MessageEvent):
        return len(event.text.encode()) + ITEM_OVERHEAD_BYTES
    return 0
