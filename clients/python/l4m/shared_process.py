"""One controller process for several instances of one program (`LaunchRequest.share_process`).

The spawner starts `python -m l4m.controller PROGRAM` with L4M_SHARED_PROCESS_TOKEN set (and no instance
token of its own). `serve` loads PROGRAM once, opens the process's control connection on the framed runtime
socket with that token (spawner.proto, "Shared controller processes") and runs each instance the spawner
sends (`SharedProcessSlot`) as an asyncio task of this process, until the spawner closes the connection
and the last instance has ended. Each instance is what a process of its own would be: its own L4M session
and runtime connection (its own token), its own `ctx.args`, the same exit statuses (reported in a
`SharedProcessExit` with the last line it wrote to stderr). A stop (`SharedProcessSlot.stop`) cancels its
task, which reports `EXIT_TERMINATED`.

What an instance's code writes to `sys.stdout` and `sys.stderr` goes to that instance's output
(`SharedProcessReport`), told apart by the task context it runs in (`current_instance`); the tasks it
creates inherit it. Writes from elsewhere (a thread of its own, C code writing to the file descriptors)
are the process's, and the spawner gives them to every instance it runs. The instances share the
program's module-level state: they are one user's launches of one program, which is what may share.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import io
import sys

from google.protobuf.message import DecodeError

from l4m.controller import (
    EXIT_SESSION_ERROR,
    EXIT_TERMINATED,
    ControllerConfig,
    Main,
    failure_status,
    result_status,
    run_loaded,
    run_span,
)
from l4m.framed import connect_unix
from l4m.v1 import spawner_pb2
from l4m.wire import frames, limits
from l4m.wire.status import StatusCode

PROCESS_TOKEN_ENV = "L4M_SHARED_PROCESS_TOKEN"
STDERR_TAIL_BYTES = 4096  # of each instance's stderr, kept for its exit message
MAX_REPORT_BYTES = 1024 * 1024  # of output in one report (the spawner reads frames of up to 4 MiB)

# The instance whose code is running (None: the process's own code).
current_instance: contextvars.ContextVar[str | None] = contextvars.ContextVar("l4m_instance", default=None)


class _InstanceWriter(io.TextIOBase):
    """Stands for sys.stdout or sys.stderr: an instance's writes become reports, the rest goes to `fallback`."""

    def __init__(self, process: SharedProcess, field: str, fallback: io.TextIOBase) -> None:
        super().__init__()
        self._process, self._field, self._fallback = process, field, fallback

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not self._process.report_current(self._field, text):
            return self._fallback.write(text)
        return len(text)

    def flush(self) -> None:
        self._fallback.flush()

    def fileno(self) -> int:
        return self._fallback.fileno()

    @property
    def buffer(self) -> _InstanceBytesWriter:
        return _InstanceBytesWriter(self._process, self._field, self._fallback)


class _InstanceBytesWriter:
    """`sys.stdout.buffer` of an `_InstanceWriter`: bytes, routed the same way."""

    def __init__(self, process: SharedProcess, field: str, fallback: io.TextIOBase) -> None:
        self._process, self._field, self._fallback = process, field, fallback

    def write(self, data: bytes) -> int:
        if not self._process.report_current(self._field, bytes(data)):
            return self._fallback.buffer.write(data)  # type: ignore[attr-defined]
        return len(data)

    def flush(self) -> None:
        self._fallback.flush()


class SharedProcess(frames.FrameProtocol):
    """The control connection, and the instances it started."""

    def __init__(self, main: Main, program: str, config: ControllerConfig, is_tracing: bool = False) -> None:
        super().__init__(limits.RUNTIME_MAX_REQUEST_BYTES)
        self.main, self.program, self.config, self.is_tracing = main, program, config, is_tracing
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._tails: dict[str, bytearray] = {}
        self._opened = False
        self._end_of_connection = asyncio.get_running_loop().create_future()  # the connection's end: None, or why it failed

    # -- the connection ------------------------------------------------------------------------------
    def frame_received(self, kind: int, payload: bytes) -> None:
        if not self._opened:
            code, message = frames.read_status(payload) if kind == frames.STATUS else (StatusCode.UNKNOWN, "")
            if code != StatusCode.OK:
                self._fail(f"the spawner refused this shared process ({code.name}): {message}")
                return
            self._opened = True
            return
        if kind == frames.STATUS:  # a refusal, before the spawner closes the connection
            code, message = frames.read_status(payload)
            self._fail(f"the spawner ended this shared process's connection ({code.name}): {message}")
            return
        if kind != frames.SHARED_SLOT:
            self._fail(f"a frame of kind {kind} on the shared process's connection")
            return
        try:
            slot = spawner_pb2.SharedProcessSlot.FromString(payload)
        except DecodeError as error:
            self._fail(f"a frame does not parse as l4m.v1.SharedProcessSlot ({error})")
            return
        if slot.stop:
            task = self.tasks.get(slot.instance_id)
            if task is not None:
                task.cancel()
        elif slot.instance_id not in self.tasks:
            self._tails[slot.instance_id] = bytearray()
            context = contextvars.copy_context()
            context.run(current_instance.set, slot.instance_id)
            self.tasks[slot.instance_id] = asyncio.get_running_loop().create_task(self._run(slot), context=context)

    def stream_ended(self, error: Exception | None) -> None:
        if not self._end_of_connection.done():
            self._end_of_connection.set_result(None if error is None else f"the control connection broke: {error}")

    def _fail(self, why: str) -> None:
        self.end_reading()
        if not self._end_of_connection.done():
            self._end_of_connection.set_result(why)
        if self.transport is not None:
            self.transport.close()

    # -- the instances ---------------------------------------------------------------------------------
    async def _run(self, slot: spawner_pb2.SharedProcessSlot) -> None:
        config = dataclasses.replace(self.config, instance_token=slot.instance_token, instance_id=slot.instance_id,
                                     traceparent=slot.traceparent or None)
        # Traced, each instance's run is its `controller.run` span, child of its launch (as in a process of its own).
        span = run_span(config, self.program) if self.is_tracing else contextlib.nullcontext(config)
        try:
            with span as traced_config:
                status = result_status(await run_loaded(self.main, self.program, tuple(slot.args), traced_config))
        except asyncio.CancelledError:
            print("l4m.controller: stopped", file=sys.stderr)
            status = EXIT_TERMINATED
        except SystemExit as exit_:  # sys.exit() in one instance ends that instance, as it would its own process
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if exit_.code is not None and not isinstance(exit_.code, int):
                print(exit_.code, file=sys.stderr)
        except Exception as error:
            status = failure_status(error)
        tail = self._tails.pop(slot.instance_id, b"")
        lines = [line for line in bytes(tail).decode("utf-8", errors="replace").splitlines() if line.strip()]
        exit_report = spawner_pb2.SharedProcessExit(exit_code=status, message=lines[-1].strip()[:500] if lines else "")
        self.write(frames.encode(frames.SHARED_REPORT, spawner_pb2.SharedProcessReport(
            instance_id=slot.instance_id, exit=exit_report)))
        del self.tasks[slot.instance_id]

    def report_current(self, field: str, text: str | bytes) -> bool:
        """`report_output` for the instance whose code is running; False for the process's own code."""
        instance_id = current_instance.get()
        return instance_id is not None and self.report_output(instance_id, field, text)

    def report_output(self, instance_id: str, field: str, text: str | bytes) -> bool:
        """Sends what an instance wrote; False once it has ended (the caller writes it to the process's own)."""
        tail = self._tails.get(instance_id)
        if tail is None:
            return False
        data = text.encode("utf-8", errors="replace") if isinstance(text, str) else text
        if field == "stderr":
            tail += data
            del tail[:-STDERR_TAIL_BYTES]
        for start in range(0, len(data), MAX_REPORT_BYTES):  # a frame stays well under the runtime's limit
            piece = data[start:start + MAX_REPORT_BYTES]
            self.write(frames.encode(frames.SHARED_REPORT,
                                     spawner_pb2.SharedProcessReport(instance_id=instance_id, **{field: piece})))
        return True

    async def serve(self, path: str, token: str) -> int:
        """Runs instances until the spawner closes the connection and the last one has ended."""
        loop = asyncio.get_running_loop()
        try:
            await connect_unix(loop, lambda: self, path)
        except OSError as error:
            print(f"l4m.controller: cannot connect to framed:{path}: {error}", file=sys.stderr)
            return EXIT_SESSION_ERROR
        opening = spawner_pb2.FramedRuntimeOpen(protocol_version=frames.PROTOCOL_VERSION, process_token=token)
        self.write(frames.encode(frames.RUNTIME_OPEN, opening))
        why = await self._end_of_connection
        if why is not None:  # nobody is left to report to: what runs is stopped
            for task in self.tasks.values():
                task.cancel()
        while self.tasks:
            await asyncio.wait(list(self.tasks.values()))
        if self.transport is not None:
            self.transport.close()
        if why is not None:
            print(f"l4m.controller: {why}", file=sys.__stderr__)
            return EXIT_SESSION_ERROR
        return 0


async def serve(main: Main, program: str, config: ControllerConfig, token: str, is_tracing: bool = False) -> int:
    path = frames.framed_path(config.runtime_framed_address or "")
    if path is None:
        print("l4m.controller: a shared process needs L4M_RUNTIME_FRAMED_ADDR (a framed: address)", file=sys.stderr)
        return EXIT_SESSION_ERROR
    process = SharedProcess(main, program, config, is_tracing)
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout = _InstanceWriter(process, "stdout", stdout)  # type: ignore[assignment]
    sys.stderr = _InstanceWriter(process, "stderr", stderr)  # type: ignore[assignment]
    try:
        return await process.serve(path, token)
    finally:
        sys.stdout, sys.stderr = stdout, stderr


def process_config(config: ControllerConfig) -> ControllerConfig:
    """The settings every instance of the process shares (each brings its own token, id and traceparent)."""
    return dataclasses.replace(config, instance_token=None, instance_id="", traceparent=None)
