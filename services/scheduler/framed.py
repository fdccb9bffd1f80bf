"""L4M sessions over length-prefixed frames on a Unix socket (`--listen-framed`; l4m.proto, "L4M sessions
over length-prefixed frames", and `l4m.wire.frames`).

The same session as `L4MServicer.Session` (server.py), without gRPC's per-message cost: the first frame
opens the session with the instance token (`admit_session`, the gRPC path's own check), then every
request frame goes to `Scheduler.submit` and every event is written as it is produced (`FramedSink`).
The session ends with a status frame: OK when the controller closed it, the trap's status otherwise.

Each connection is a `FrameProtocol`: the frames one read brings in are submitted in order in that read's
callback (a controller that writes a fork group's steps together costs one wake-up); a trap drops the rest
of that instance's frames, no one else's.

Flow control: while what the session wrote is above the transport's high-water mark (the controller does
not read its replies), the connection is not read, so it holds no more than that plus one read's frames in
the scheduler. A frame larger than max_command_bytes is refused from its header.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError

from l4m.common.framed import OPEN_TIMEOUT_S, FramedListener, FramedServerConnection
from l4m.scheduler.core import Scheduler
from l4m.scheduler.errors import InvalidCommand, RegistrationError
from l4m.scheduler.instances import Instance
from l4m.scheduler.models import UnknownModel
from l4m.scheduler.server import REGISTRATION_STATUS, TRAP_STATUS, SessionRefused, admit_session
from l4m.v1 import l4m_pb2
from l4m.wire import frames, limits

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK
_parse_request = l4m_pb2.SessionRequest.FromString


class FramedSink:
    """An instance's events, written to its connection as they come."""

    __slots__ = ("transport",)

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def send(self, response: l4m_pb2.SessionResponse) -> None:
        if not self.transport.is_closing():
            self.transport.write(frames.encode(frames.RESPONSE, response))

    def end(self, trap: l4m_pb2.Trap | None) -> None:
        if not self.transport.is_closing():
            if trap is None:
                self.transport.write(frames.status_frame(_OK))
            else:
                self.transport.write(frames.status_frame(TRAP_STATUS.get(trap.kind, grpc.StatusCode.ABORTED),
                                                         trap.reason))
            self.transport.close()  # what is buffered is still sent


class FramedConnection(FramedServerConnection):
    """One connection: its first frame (GetInfo, or the session's opening), then the session's requests."""

    def __init__(self, server: FramedServer) -> None:
        super().__init__(server, limits.MAX_COMMAND_BYTES)
        self.scheduler = server.scheduler
        self.instance: Instance | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.instance is not None:
            self.scheduler.close_session(self.instance)  # frees whatever the instance still holds

    def frame_received(self, kind: int, payload: bytes) -> None:
        instance = self.instance
        if instance is None:
            self._first_frame(kind, payload)
            return
        if not instance.is_alive:  # trapped or destroyed: what it sent after that is dropped
            self.end_reading()
            return
        if kind != frames.REQUEST:
            self.end_reading()
            self.scheduler.trap(instance, InvalidCommand(
                f"a frame of kind {kind} on an open session; only SessionRequest ({frames.REQUEST}) frames may follow"))
            return
        try:
            request = _parse_request(payload)
        except DecodeError as error:
            self.end_reading()
            self.scheduler.trap(instance, InvalidCommand(
                f"a message on the framed session does not parse as l4m.v1.SessionRequest ({error})"))
            return
        self.scheduler.submit(instance, request)
        if not instance.is_alive:  # that request trapped it: the rest of what it sent is dropped
            self.end_reading()

    def stream_ended(self, error: Exception | None) -> None:
        instance = self.instance
        if instance is None:
            if isinstance(error, frames.FrameError):
                self.refuse(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            else:
                self.close()
        elif isinstance(error, frames.FrameError):
            self.scheduler.trap(instance, InvalidCommand(str(error)))
        elif error is None:  # the controller closed its side: what it sent still runs, then the session ends
            self.scheduler.finish_session(instance)
        # a broken connection: connection_lost frees the instance

    def _first_frame(self, kind: int, payload: bytes) -> None:
        self.opened()
        self.end_reading()  # nothing more is read from a connection unless its session opens here
        try:
            if kind == frames.GET_INFO:
                request = l4m_pb2.GetInfoRequest.FromString(payload)
                if not self.scheduler.is_ready:
                    raise SessionRefused(grpc.StatusCode.UNAVAILABLE, "no executor is connected yet")
                try:
                    info = self.scheduler.get_info(request.omit_tokenizer_json, request.model)
                except UnknownModel as error:
                    raise SessionRefused(grpc.StatusCode.NOT_FOUND, str(error)) from None
                self.write(frames.encode(frames.INFO, info))
                self.close()
                return
            if kind != frames.OPEN:
                raise SessionRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"the first frame is of kind {kind}, not FramedSessionOpen ({frames.OPEN}) "
                                     f"or GetInfoRequest ({frames.GET_INFO})")
            opening = l4m_pb2.FramedSessionOpen.FromString(payload)
            if opening.protocol_version != frames.PROTOCOL_VERSION:
                raise SessionRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"protocol_version {opening.protocol_version[:40]!r} is not "
                                     f"{frames.PROTOCOL_VERSION!r}")
            instance, model = admit_session(self.scheduler, opening.instance_token or None, opening.model)
            assert self.transport is not None
            try:
                instance = self.scheduler.open_session(instance, FramedSink(self.transport), opening.traceparent or None,
                                                       model)
            except ValueError as error:
                raise SessionRefused(grpc.StatusCode.FAILED_PRECONDITION, str(error)) from None
            except RegistrationError as error:  # a companion session (another model) past --max-instances
                raise SessionRefused(REGISTRATION_STATUS[type(error)], str(error)) from None
        except DecodeError as error:
            self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the first frame does not parse as {frames.KIND_NAMES[kind]} ({error})")
            return
        except SessionRefused as refusal:
            self.refuse(refusal.code, refusal.message)
            return
        self.instance = instance
        self.write(frames.status_frame(_OK))
        self.resume_reading_frames()  # the session is open: its requests are read


class FramedServer(FramedListener):
    """The framed listener of one scheduler (a Unix socket anyone may connect to, mode 0666: the instance
    token in the first frame, not the file mode, is what admits a session, as on the gRPC Unix socket)."""

    def __init__(self, scheduler: Scheduler, path: str, open_timeout_s: float = OPEN_TIMEOUT_S) -> None:
        super().__init__(path, lambda _: FramedConnection(self), 0o666, open_timeout_s)
        self.scheduler = scheduler
