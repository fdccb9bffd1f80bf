"""Shared controller processes: several instances of one user's program in one sandboxed process.

A launch with `LaunchRequest.share_process` may join a running process that runs the same program for the
same user with the same model and limits (`ShareKey`), up to the spawner's `max_instances_per_process`;
otherwise it starts one, through the spawner's sandbox backend like any launch (its warm pool included).
Each instance stays an instance of its own: its id, token, registration with the scheduler, quotas, Attach
stream, messages, limits' timers and exit report are the manager's and the supervisor's as for any other.
What changes is its `SandboxHandle`: a `SlotHandle`, whose output and exit come from the process's control
connection (spawner.proto, "Shared controller processes"; `l4m.shared_process` on the other side).

What they share is the process: its sandbox, its limits (one launch's: memory, CPU time, processes, files)
and its fate. When the process ends, every instance still in it ends with the process's exit reason (a
memory limit, a crash), its message naming the process. An instance told to stop (a limit, Terminate, a
trap) is cancelled inside the process; one that has not ended `STOP_GRACE_S` later gets the process killed,
and with it the instances beside it. That is the bargain the user chose with `share_process`; instances of
other users or other programs never share.

A process takes no more instances once it is empty (the spawner then closes its connection and it exits),
once half its wall time or half its CPU time limit has passed (an instance that joins late still gets its
whole wall time, and the process's CPU rlimit counts all its instances), or when its control connection has
ended. A report that names an instance the spawner did not start in that process ends its connection, and
a process whose connection ends while it runs instances is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError

from l4m.spawner.sandbox import (
    ExitFacts,
    ExitInfo,
    ExitReason,
    Limits,
    OutputChunk,
    OutputStream,
    Sandbox,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    derive_exit_info,
)
from l4m.v1 import spawner_pb2
from l4m.wire import frames

if TYPE_CHECKING:
    from l4m.spawner.framed_runtime import FramedRuntimeConnection

log = logging.getLogger(__name__)

PROCESS_TOKEN_ENV = "L4M_SHARED_PROCESS_TOKEN"
STOP_GRACE_S = 2.0  # an instance told to stop has this long to end before its process is killed
EXIT_GRACE_S = 5.0  # a process told to end (its connection closed) has this long before it is killed
DISCONNECT_GRACE_S = 0.5  # a process whose connection ended under its instances is killed this much later


@dataclass(frozen=True)
class ShareKey:
    """What instances must have in common to share a process."""

    user: str
    program_sha256: str
    model: str
    limits: Limits


class SlotHandle(SandboxHandle):
    """One instance in a shared process."""

    def __init__(self, process: SharedProcess, spec: SandboxSpec, is_warm: bool) -> None:
        self.instance_id = spec.instance_id
        self.process = process
        self.limits = spec.limits
        self.is_warm = is_warm
        self._chunks: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self._exit: asyncio.Future[ExitInfo] = asyncio.get_running_loop().create_future()
        self._kill: tuple[ExitReason, str] | None = None  # the first reason it was stopped for
        self.is_first = False  # the launch that started its process

    async def output(self) -> AsyncIterator[OutputChunk]:
        while (chunk := await self._chunks.get()) is not None:
            yield chunk

    async def wait(self) -> ExitInfo:
        return await asyncio.shield(self._exit)

    async def kill(self, reason: ExitReason, message: str) -> None:
        if self._exit.done():
            return
        if self._kill is None:
            self._kill = (reason, message)
            self.process.stop(self)

    @property
    def has_ended(self) -> bool:
        return self._exit.done()

    def add_output(self, stream: OutputStream, data: bytes) -> None:
        if not self._exit.done() and data:
            self._chunks.put_nowait(OutputChunk(stream, data))

    def ended(self, exit_code: int, message: str) -> None:
        """Its own end, as the process reported it: read as a process of its own would be."""
        reason, kill_message = self._kill or (None, "")
        self._finish(derive_exit_info(ExitFacts(self.limits, exit_code=exit_code, kill_reason=reason,
                                                kill_message=kill_message, stderr_tail=message.encode())))

    def process_ended(self, info: ExitInfo) -> None:
        """Its process ended first: its own stop reason if it had one, the process's otherwise."""
        if self._kill is not None:
            self._finish(ExitInfo(self._kill[0], self._kill[1], info.exit_code, info.signal, "spawner"))
        else:
            self._finish(dataclasses.replace(
                info, message=f"its shared process {self.process.process_id} ended: {info.message}"))

    def _finish(self, info: ExitInfo) -> None:
        if not self._exit.done():
            self._chunks.put_nowait(None)
            self._exit.set_result(info)


class SharedProcess:
    """One sandboxed process and the instances in it."""

    def __init__(self, processes: SharedProcesses, key: ShareKey, capacity: int) -> None:
        self.processes = processes
        self.key = key
        self.capacity = capacity
        self.process_id = f"p-{uuid.uuid4().hex[:16]}"
        self.token = secrets.token_urlsafe(24)
        self.slots: dict[str, SlotHandle] = {}
        self.handle: SandboxHandle | None = None
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.connection: FramedRuntimeConnection | None = None
        self.is_connected_once = False
        self.accepting = True
        self.has_ended = False
        self._pending: list[bytes] = []  # frames for the process before it connected
        self._created_at = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- joining ---------------------------------------------------------------------------------------
    def can_join(self) -> bool:
        if not self.accepting or self.has_ended or len(self.slots) >= self.capacity:
            return False
        limits = self.key.limits
        if time.monotonic() - self._created_at > limits.wall_time_s / 2:
            return False
        cpu_time_s = self.handle.cpu_time_s() if self.handle is not None else None
        return cpu_time_s is None or cpu_time_s <= limits.cpu_time_s / 2

    def add(self, spec: SandboxSpec) -> SlotHandle:
        slot = SlotHandle(self, spec, is_warm=True)  # joining a running process is a warm start
        slot.is_first = not self.slots and self.handle is None
        self.slots[spec.instance_id] = slot
        self._send(spawner_pb2.SharedProcessSlot(
            instance_id=spec.instance_id, instance_token=spec.env.get("L4M_INSTANCE_TOKEN", ""), args=spec.args,
            traceparent=spec.env.get("TRACEPARENT", "")))
        return slot

    def stop(self, slot: SlotHandle) -> None:
        self._send(spawner_pb2.SharedProcessSlot(instance_id=slot.instance_id, stop=True))
        self._kill_later(STOP_GRACE_S, f"instance {slot.instance_id} in it did not stop within {STOP_GRACE_S:g} s "
                                       "of being told to", unless=lambda: slot.has_ended)

    def _kill_later(self, delay_s: float, message: str, unless: Callable[[], bool] = lambda: False) -> None:
        """Kills the process `delay_s` from now (KILLED, `message`) unless it has ended by then, or `unless()`."""

        async def kill() -> None:
            await asyncio.sleep(delay_s)
            if not self.has_ended and not unless() and self.handle is not None:
                await self.handle.kill(ExitReason.KILLED, message)

        self._spawn(kill())

    def _send(self, slot: spawner_pb2.SharedProcessSlot) -> None:
        frame = frames.encode(frames.SHARED_SLOT, slot)
        if self.connection is not None:
            self.connection.write(frame)
        elif not self.is_connected_once:
            self._pending.append(frame)

    # -- the process's connection ----------------------------------------------------------------------
    def connected(self, connection: FramedRuntimeConnection) -> None:
        self.connection, self.is_connected_once = connection, True
        connection.write(b"".join(self._pending))
        self._pending.clear()
        if not self.slots:
            self._retire()

    def report(self, payload: bytes) -> str | None:
        """Hands a report to its instance; why the connection must end, if it must."""
        try:
            report = spawner_pb2.SharedProcessReport.FromString(payload)
        except DecodeError as error:
            return f"a frame does not parse as l4m.v1.SharedProcessReport ({error})"
        slot = self.slots.get(report.instance_id)
        if slot is None:
            return f"a report on {report.instance_id!r}, which the spawner did not start in this process or has ended"
        field = report.WhichOneof("report")
        if field == "stdout":
            slot.add_output(OutputStream.STDOUT, report.stdout)
        elif field == "stderr":
            slot.add_output(OutputStream.STDERR, report.stderr)
        elif field == "exit":
            del self.slots[report.instance_id]
            slot.ended(report.exit.exit_code, report.exit.message)
            if not self.slots:
                self._retire()
        return None

    def disconnected(self) -> None:
        self.connection = None
        self.accepting = False
        self.processes.forget(self)
        if self.slots:
            # A process that crashed closed its connection as it exited: its own exit is the one to report.
            self._kill_later(DISCONNECT_GRACE_S, "its control connection to the spawner ended")

    def _retire(self) -> None:
        """No instance left: no more join; its connection closes, and the process exits (or is killed)."""
        self.accepting = False
        self.processes.forget(self)
        if self.connection is not None:
            self.connection.close()
        self._kill_later(EXIT_GRACE_S, "it did not exit when its last instance had ended")

    # -- its life ----------------------------------------------------------------------------------------
    async def run(self, handle: SandboxHandle) -> None:
        """Hands the process's own output to every instance in it; when it ends, ends them all."""
        self.handle = handle
        try:
            async for chunk in handle.output():
                for slot in list(self.slots.values()):
                    slot.add_output(chunk.stream, chunk.data)
        except BaseException:
            # Cancelled (the spawner is stopping) or broken: the process must not outlive us.
            await handle.kill(ExitReason.KILLED, "the spawner stopped watching the shared process")
            raise
        finally:
            info = await handle.wait()
            self.has_ended = True
            self.accepting = False
            self.processes.forget(self)
            self.processes.unregister(self)
            if self.connection is not None:
                self.connection.close()
            for slot in list(self.slots.values()):
                slot.process_ended(info)
            self.slots.clear()
            for task in self._tasks:
                task.cancel()

    def _spawn(self, coroutine: object) -> None:
        task = asyncio.ensure_future(coroutine)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class SharedProcesses:
    """The spawner's shared processes: the ones that take instances, by key, and all of them by token."""

    def __init__(self, sandbox: Sandbox, capacity: int, process_env: Callable[[str, ShareKey], dict[str, str]],
                 runner_module: str) -> None:
        self.sandbox = sandbox
        self.capacity = capacity
        self._process_env = process_env
        self._runner_module = runner_module
        self._open: dict[ShareKey, list[SharedProcess]] = {}
        self._by_token: dict[str, SharedProcess] = {}
        self._runs: set[asyncio.Task[None]] = set()

    def by_token(self, token: str) -> SharedProcess | None:
        return self._by_token.get(token)

    def forget(self, process: SharedProcess) -> None:
        """Takes the process out of those that take instances."""
        processes = self._open.get(process.key)
        if processes and process in processes:
            processes.remove(process)
            if not processes:
                del self._open[process.key]

    def unregister(self, process: SharedProcess) -> None:
        self._by_token.pop(process.token, None)

    def sandbox_for(self, key: ShareKey) -> SharedSandbox:
        return SharedSandbox(self, key)

    async def start(self, key: ShareKey, spec: SandboxSpec) -> SlotHandle:
        process = next((p for p in self._open.get(key, ()) if p.can_join()), None)
        if process is None:
            process = SharedProcess(self, key, self.capacity)
            self._open.setdefault(key, []).append(process)
            self._by_token[process.token] = process
            self._start_process(process, spec)
        slot = process.add(spec)
        try:
            await asyncio.shield(process.started)
        except BaseException:
            process.slots.pop(spec.instance_id, None)
            raise
        if process.handle is not None and slot.is_first:
            slot.is_warm = process.handle.is_warm  # the process's start is this launch's
        return slot

    def _start_process(self, process: SharedProcess, spec: SandboxSpec) -> None:
        process_spec = SandboxSpec(process.process_id, spec.program_path, (), self._process_env(process.token, process.key),
                                   spec.socket_dir, spec.limits, runner_module=self._runner_module)

        async def start_and_run() -> None:
            try:
                handle = await self.sandbox.start(process_spec)
            except BaseException as error:
                self.forget(process)
                self.unregister(process)
                process.has_ended = True
                if not process.started.done():
                    process.started.set_exception(
                        error if isinstance(error, SandboxError) else SandboxError(f"{type(error).__name__}: {error}"))
                raise
            process.handle = handle
            process.started.set_result(None)
            await process.run(handle)

        task = asyncio.ensure_future(start_and_run())
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)
        task.add_done_callback(_log_failure)

    async def close(self) -> None:
        """Kills every shared process (the spawner is stopping) and waits for them to end."""
        for process in list(self._by_token.values()):
            if process.handle is not None:
                with contextlib.suppress(Exception):
                    await process.handle.kill(ExitReason.KILLED, "the spawner is shutting down")
        if self._runs:
            await asyncio.gather(*self._runs, return_exceptions=True)


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None and not isinstance(task.exception(), SandboxError):
        log.error("a shared controller process failed", exc_info=task.exception())


class SharedSandbox(Sandbox):
    """What one launch that may share starts through: `start` joins or starts a shared process."""

    kind = "shared"

    def __init__(self, processes: SharedProcesses, key: ShareKey) -> None:
        self.processes, self.key = processes, key
        self.process_id = ""

    async def start(self, spec: SandboxSpec) -> SandboxHandle:
        slot = await self.processes.start(self.key, spec)
        self.process_id = slot.process.process_id
        return slot

    async def cleanup_orphans(self) -> int:
        return 0

    def enforcement(self) -> dict[str, str]:
        return self.processes.sandbox.enforcement()
