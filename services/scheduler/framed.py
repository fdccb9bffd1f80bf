"""L4M sessions over length-prefixed frames on a Unix socket (`--listen-framed`; l4m.proto, "L4M sessions
over length-prefixed frames", and `l4m.wire.frames`).

The same session as `L4MServicer.Session` (server.py), without gRPC's per-message cost: the first frame
opens the session with the instance token (`admit_session`, the gRPC path's own check), then every
request frame goes to `Scheduler.submit` and every event is written as it is produced (`FramedSink`).
The session ends with a status frame: OK when the controller closed it, the trap's status otherwise.

Flow control: before reading the next request the session waits until what it wrote has drained below
the transport's high-water mark, so a controller that does not read its replies stops being read, and
holds no more than that in the scheduler. A frame larger than max_command_bytes is refused from its header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import grpc
from google.protobuf.message import DecodeError

from l4m.scheduler.core import Scheduler
from l4m.scheduler.errors import InvalidCommand
from l4m.scheduler.instances import Instance
from l4m.scheduler.server import TRAP_STATUS, SessionRefused, admit_session
from l4m.v1 import l4m_pb2
from l4m.wire import frames, limits

log = logging.getLogger(__name__)

# How long a new connection may take to send its first frame.
OPEN_TIMEOUT_S = 10.0
_OK = grpc.StatusCode.OK


def _status_frame(code: grpc.StatusCode, message: str = "") -> bytes:
    return frames.encode(frames.STATUS, l4m_pb2.FramedSessionStatus(code=code.value[0], message=message))


class FramedSink:
    """An instance's events, written to its connection as they come."""

    __slots__ = ("writer", "ended")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.ended = asyncio.Event()

    def send(self, response: l4m_pb2.SessionResponse) -> None:
        if not self.writer.is_closing():
            self.writer.write(frames.encode(frames.RESPONSE, response))

    def end(self, trap: l4m_pb2.Trap | None) -> None:
        if not self.writer.is_closing():
            if trap is None:
                self.writer.write(_status_frame(_OK))
            else:
                self.writer.write(_status_frame(TRAP_STATUS.get(trap.kind, grpc.StatusCode.ABORTED), trap.reason))
            self.writer.close()  # what is buffered is still sent
        self.ended.set()


class FramedServer:
    """The framed listener of one scheduler (a Unix socket anyone may connect to: the instance token in
    the first frame, not the file mode, is what admits a session, as on the gRPC Unix socket)."""

    def __init__(self, scheduler: Scheduler, path: str) -> None:
        self.scheduler = scheduler
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path)
        os.chmod(self.path, 0o666)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        instance: Instance | None = None
        try:
            instance = await self._open(reader, writer)
            if instance is not None:
                await self._read_commands(reader, writer, instance)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception:  # a bug here must not take the listener down
            log.exception("framed session failed")
        finally:
            if instance is not None:
                self.scheduler.close_session(instance)  # frees whatever the instance still holds
            writer.close()
            self._writers.discard(writer)

    async def _open(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Instance | None:
        """The first frame: GetInfo (answered, then closed) or a session to open; None when there is none."""
        try:
            frame = await asyncio.wait_for(frames.read_frame(reader, limits.MAX_COMMAND_BYTES), OPEN_TIMEOUT_S)
        except TimeoutError:
            writer.write(_status_frame(grpc.StatusCode.DEADLINE_EXCEEDED,
                                       f"no first frame within {OPEN_TIMEOUT_S:.0f} s"))
            return None
        except frames.FrameError as error:
            writer.write(_status_frame(grpc.StatusCode.INVALID_ARGUMENT, str(error)))
            return None
        if frame is None:
            return None
        kind, payload = frame
        try:
            if kind == frames.GET_INFO:
                request = l4m_pb2.GetInfoRequest.FromString(payload)
                if not self.scheduler.is_ready:
                    raise SessionRefused(grpc.StatusCode.UNAVAILABLE, "no executor is connected yet")
                writer.write(frames.encode(frames.INFO, self.scheduler.get_info(request.omit_tokenizer_json)))
                return None
            if kind != frames.OPEN:
                raise SessionRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"the first frame is of kind {kind}, not FramedSessionOpen ({frames.OPEN}) "
                                     f"or GetInfoRequest ({frames.GET_INFO})")
            opening = l4m_pb2.FramedSessionOpen.FromString(payload)
            if opening.protocol_version != frames.PROTOCOL_VERSION:
                raise SessionRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"protocol_version {opening.protocol_version[:40]!r} is not "
                                     f"{frames.PROTOCOL_VERSION!r}")
            instance = admit_session(self.scheduler, opening.instance_token or None)
            sink = FramedSink(writer)
            try:
                self.scheduler.open_session(instance, sink, opening.traceparent or None)
            except ValueError as error:
                raise SessionRefused(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
        except DecodeError as error:
            writer.write(_status_frame(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"the first frame does not parse as {frames.KIND_NAMES[kind]} ({error})"))
            return None
        except SessionRefused as refusal:
            writer.write(_status_frame(refusal.code, refusal.message))
            return None
        writer.write(_status_frame(_OK))
        return instance

    async def _read_commands(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             instance: Instance) -> None:
        scheduler = self.scheduler
        submit = scheduler.submit
        sink: FramedSink = instance.sink  # type: ignore[assignment]
        while instance.is_alive:
            await writer.drain()  # waits only while the controller does not read what was written
            try:
                frame = await frames.read_frame(reader, limits.MAX_COMMAND_BYTES)
            except frames.FrameError as error:
                scheduler.trap(instance, InvalidCommand(str(error)))
                return
            if frame is None:  # the controller closed its side: what it sent still runs, then the session ends
                scheduler.finish_session(instance)
                with contextlib.suppress(asyncio.CancelledError):
                    await sink.ended.wait()
                return
            kind, payload = frame
            if kind != frames.REQUEST:
                scheduler.trap(instance, InvalidCommand(
                    f"a frame of kind {kind} on an open session; only SessionRequest ({frames.REQUEST}) frames may follow"))
                return
            try:
                request = l4m_pb2.SessionRequest.FromString(payload)
            except DecodeError as error:
                scheduler.trap(instance, InvalidCommand(
                    f"a message on the framed session does not parse as l4m.v1.SessionRequest ({error})"))
                return
            submit(instance, request)
