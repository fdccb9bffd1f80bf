"""One L4M session: a bidirectional command stream to the scheduler, over `grpc.aio` or framed sessions.

On gRPC, commands go through one send queue (grpc.aio allows one writer at a time, and a queue lets
synchronous code such as `Context.fork()` send fire-and-forget commands) and a reader task answers the
futures of replied commands by `request_id`. On a framed session (`l4m.framed`) there are no such tasks:
`send` queues the frame on the connection (the commands of one event-loop turn are written together) and
the connection's read callback answers the futures. A `Trap` fails every pending future, and every later
command, with `Trapped`.

The session only needs an object with the `L4MServiceStub` methods (`GetInfo`, `Session`), so the
unit tests and `l4m.fake` put an in-process backend behind the very same code. grpc is imported only
where a gRPC channel opens: a framed session never imports it (docs/benchmarks.md, "Controller memory").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from l4m.errors import SessionClosed, Trapped
from l4m.v1 import l4m_pb2
from l4m.wire import limits
from l4m.wire.frames import framed_path
from l4m.wire.metadata import MODEL_METADATA_KEY, TOKEN_METADATA_KEY
from l4m.wire.status import code_name, is_eof

if TYPE_CHECKING:
    import grpc

# A synchronous GetInfo: (request, timeout_s, metadata) -> GetInfoResponse.
BlockingGetInfo = Callable[[l4m_pb2.GetInfoRequest, float, Any], l4m_pb2.GetInfoResponse]
DEFAULT_CALL_TIMEOUT_S = 30.0

# Commands answered by an event; every other command is fire-and-forget.
REPLIED_COMMANDS = frozenset(
    {"get_info", "forward_text", "forward", "sample_top_k", "import_kv_pages", "list_exports", "synchronize",
     "debug_query"}
)


def is_replied(command: str, message: Any) -> bool:
    """Whether the scheduler answers this command (a forward_text without outputs has no answer)."""
    if command == "forward_text":
        return bool(message.output_indices)
    return command in REPLIED_COMMANDS


def call_metadata(token: str | None = None, traceparent: str | None = None,
                  model: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata for L4M/runtime calls: the instance token, the W3C trace parent and the model the
    session serves, when known."""
    metadata = []
    if token:
        metadata.append((TOKEN_METADATA_KEY, token))
    if model:
        metadata.append((MODEL_METADATA_KEY, model))
    if traceparent:
        metadata.append(("traceparent", traceparent))
    return tuple(metadata)


def grpc_target(address: str) -> str:
    """`unix:///path` stays as is; `host:port` too (gRPC's own syntax)."""
    return address


_STREAM_END_HINTS = {  # by status code name
    "UNAVAILABLE": " -- is the scheduler still running?",
    "UNAUTHENTICATED": (
        " -- run the controller through the spawner (`l4m run`), which gives it a token, or start the "
        "scheduler with --allow-anonymous (`l4m up --allow-anonymous`) for local runs"
    ),
}


def _get_info_failure(error: Exception, code: str) -> str:
    """Why GetInfo failed: `error` a failed call (grpc's or a framed one) whose status code is named `code`."""
    hint = (" -- is the scheduler running at the address in L4M_SCHEDULER_ADDR?"
            if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "")
    return f"GetInfo failed ({code}): {error.details()}{hint}"  # type: ignore[attr-defined]


class Session:
    """An open L4M command stream plus the unary `GetInfo` call."""

    def __init__(
        self,
        stub: Any,
        metadata: Sequence[tuple[str, str]] = (),
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        channel: grpc.aio.Channel | None = None,
        blocking_get_info: BlockingGetInfo | None = None,
        model: str = "",
    ) -> None:
        self._stub = stub
        self.model = model  # the model this session serves; "" = the scheduler's default
        self._connect_to: Callable[[str], Awaitable[Session]] | None = None  # set by `connect`
        # A synchronous GetInfo, for what synchronous code must fetch once (the tokenizer). None: the
        # session cannot make one, so `Model.load` asks for everything up front.
        self._blocking_get_info = blocking_get_info
        self._metadata = tuple(metadata)
        self._call_timeout_s = call_timeout_s
        self._channel = channel
        self._call: Any = None
        self._direct = False  # a framed call: no writer and reader tasks (see the module's docstring)
        self._send_queue: asyncio.Queue[l4m_pb2.SessionRequest | None] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[l4m_pb2.SessionResponse]] = {}
        self._request_ids = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: Exception | None = None
        self._write_error: Exception | None = None
        # stream id -> request id of its latest fire-and-forget command not yet followed by a reply.
        self._unsynced_streams: dict[int, int] = {}
        self.num_commands_sent = 0
        self._sync_listeners: list[Callable[[int], None]] = []

    @classmethod
    async def connect(
        cls,
        address: str,
        token: str | None = None,
        traceparent: str | None = None,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        model: str = "",
    ) -> Session:
        """Open a channel to the scheduler at `address` (e.g. `unix:///run/l4m/scheduler.sock`), or a
        framed session where the address says `framed:PATH` (`l4m.framed`: the same session, a fraction
        of gRPC's CPU per message). The session serves `model` ("": the scheduler's default)."""
        path = framed_path(address)
        metadata = call_metadata(token, traceparent, model)

        async def connect_to(other_model: str) -> Session:
            return await cls.connect(address, token, traceparent, call_timeout_s, other_model)

        if path is not None:
            from l4m.framed import FramedStub

            stub = FramedStub(path)
            session = cls(stub, metadata, call_timeout_s, None, stub.get_info_blocking, model)
            session._connect_to = connect_to
            return session
        import grpc

        from l4m.v1 import l4m_pb2_grpc

        # The scheduler's limits (l4m.wire.limits): it accepts commands of MAX_COMMAND_BYTES and answers each
        # within MAX_RESPONSE_BYTES.
        options = limits.grpc_options(limits.MAX_COMMAND_BYTES, limits.MAX_RESPONSE_BYTES)
        channel = grpc.aio.insecure_channel(grpc_target(address), options=options)

        def blocking_get_info(request: l4m_pb2.GetInfoRequest, timeout: float, metadata: Any) -> Any:
            with grpc.insecure_channel(grpc_target(address), options=options) as blocking_channel:
                return l4m_pb2_grpc.L4MServiceStub(blocking_channel).GetInfo(
                    request, timeout=timeout, metadata=metadata
                )

        session = cls(l4m_pb2_grpc.L4MServiceStub(channel), metadata, call_timeout_s, channel, blocking_get_info, model)
        session._connect_to = connect_to
        return session

    async def connect_to(self, model: str) -> Session:
        """Another session of this instance, to the same scheduler, serving `model` (`ctx.load_model`)."""
        if self._connect_to is None:
            raise SessionClosed("this session was not opened by Session.connect: it cannot open another")
        return await self._connect_to(model)

    async def get_info(self, omit_tokenizer_json: bool = False, model: str | None = None) -> l4m_pb2.GetInfoResponse:
        """Model and capacities (a unary call with a deadline; needs no open stream): of `model`, by
        default the session's own."""
        try:
            return await self._stub.GetInfo(
                l4m_pb2.GetInfoRequest(omit_tokenizer_json=omit_tokenizer_json,
                                       model=self.model if model is None else model),
                timeout=self._call_timeout_s,
                metadata=self._metadata,
            )
        except Exception as error:
            code = code_name(error)
            if code is None:
                raise
            raise SessionClosed(_get_info_failure(error, code)) from error

    @property
    def can_get_info_blocking(self) -> bool:
        return self._blocking_get_info is not None

    def get_info_blocking(self) -> l4m_pb2.GetInfoResponse:
        """`get_info()` (everything, the tokenizer included) for synchronous code: blocks the event loop
        for the call (tens of ms for SmolLM2's tokenizer), on a channel of its own that is closed after."""
        if self._blocking_get_info is None:
            raise SessionClosed("this session cannot make blocking calls")
        try:
            return self._blocking_get_info(l4m_pb2.GetInfoRequest(model=self.model), self._call_timeout_s,
                                           self._metadata)
        except Exception as error:
            code = code_name(error)
            if code is None:
                raise
            raise SessionClosed(_get_info_failure(error, code)) from error

    def open(self) -> None:
        """Open the command stream and start the writer and reader tasks."""
        if self._call is not None:
            return
        self._call = self._stub.Session(metadata=self._metadata)
        attach = getattr(self._call, "attach", None)
        if attach is not None:
            self._direct = True
            attach(self._dispatch, self._stream_ended)
            return
        self._tasks = [asyncio.create_task(self._write_loop()), asyncio.create_task(self._read_loop())]

    def send(self, command: str, message: Any, stream_id: int = 0) -> asyncio.Future[l4m_pb2.SessionResponse] | None:
        """Queue one command; returns the future of its reply, or None for fire-and-forget commands."""
        if self._failure is not None:
            raise self._failure
        self.open()
        request_id = next(self._request_ids)
        request = l4m_pb2.SessionRequest(stream_id=stream_id, request_id=request_id)
        getattr(request, command).CopyFrom(message)
        future = None
        if is_replied(command, message):
            future = asyncio.get_running_loop().create_future()
            self._pending[request_id] = future
        else:
            self._unsynced_streams[stream_id] = request_id
        if self._direct:
            self._call.send_nowait(request)
        else:
            self._send_queue.put_nowait(request)
        self.num_commands_sent += 1
        return future

    async def request(self, command: str, message: Any, stream_id: int = 0) -> l4m_pb2.SessionResponse:
        """Send a replied command and wait for its reply."""
        future = self.send(command, message, stream_id)
        assert future is not None, f"{command} has no reply"
        return await future

    def add_sync_listener(self, listener: Callable[[int], None]) -> None:
        """Call `listener(stream_id)` whenever a reply shows that a stream's fire-and-forget commands ran."""
        self._sync_listeners.append(listener)

    def is_stream_synced(self, stream_id: int) -> bool:
        """True when every command sent on `stream_id` was followed by a replied one that came back."""
        return stream_id not in self._unsynced_streams

    async def synchronize(self, stream_id: int = 0) -> None:
        await self.request("synchronize", l4m_pb2.SynchronizeCommand(), stream_id)

    def check(self) -> None:
        """Raise the session's failure (a trap, a lost stream), if any."""
        if self._failure is not None:
            raise self._failure

    @property
    def failure(self) -> Exception | None:
        return self._failure

    async def close(self) -> None:
        """End the stream (the scheduler frees what the instance held) and the channel."""
        if self._call is not None and self._failure is None:
            if self._direct:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._call.done_writing(), timeout=5)
            else:
                self._send_queue.put_nowait(None)
                with contextlib.suppress(Exception):  # a writer that cannot finish is cancelled below
                    await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout=5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._call is not None:
            self._call.cancel()
        if self._failure is None:
            self._failure = SessionClosed("the session was closed; open a new one to send more commands")
        self._fail_pending(self._failure)
        if self._channel is not None:
            await self._channel.close()

    async def _write_loop(self) -> None:
        # The scheduler sends the stream's initial metadata once it accepted the session. Writing before
        # that races a refusal (no token, unknown token, no executor): grpcio may then report the failed
        # write's INTERNAL instead of the refusal's status, which says what is wrong.
        try:
            await self._call.initial_metadata()
        except Exception:  # noqa: BLE001 - the read loop reports the stream's end
            return
        while True:
            request = await self._send_queue.get()
            if request is None:
                await self._call.done_writing()
                return
            try:
                await self._call.write(request)
            except Exception as error:
                # The stream is over; the read loop reports why (a trap, a status) to every waiter.
                self._write_error = error
                return

    async def _read_loop(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if is_eof(response):
                    self._stream_ended(response)
                    return
                self._dispatch(response)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if code_name(error) is not None:  # the stream's status
                self._stream_ended(error)
            else:
                self._fail(SessionClosed(f"the L4M stream failed: {type(error).__name__}: {error}"))

    def _stream_ended(self, end: Any) -> None:
        """The stream's end: an EOF, grpc.aio's or `l4m.wire.status`'s (the scheduler closed it with OK), or
        the error of its status (grpc's AioRpcError, or a framed call's StatusError)."""
        if is_eof(end):
            detail = f" (sending failed: {self._write_error})" if self._write_error else ""
            self._fail(SessionClosed(f"the scheduler ended the L4M stream{detail}"))
        else:
            self._fail(SessionClosed(f"the L4M stream ended ({end.code().name}): {end.details()}"
                                     f"{_STREAM_END_HINTS.get(end.code().name, '')}"))

    def _dispatch(self, response: l4m_pb2.SessionResponse) -> None:
        if response.WhichOneof("event") == "trap":
            trap = response.trap
            self._fail(Trapped(trap.kind, trap.reason, trap.offending_request_id))
            return
        # Streams run in order: a reply means every earlier command of its stream is done.
        if self._unsynced_streams.get(response.stream_id, 1 << 64) < response.request_id:
            del self._unsynced_streams[response.stream_id]
            for listener in self._sync_listeners:
                listener(response.stream_id)
        future = self._pending.pop(response.request_id, None)
        if future is not None and not future.done():
            future.set_result(response)

    def _fail(self, error: Exception) -> None:
        if self._failure is None or (isinstance(error, Trapped) and not isinstance(self._failure, Trapped)):
            self._failure = error
        self._fail_pending(self._failure)

    def _fail_pending(self, error: Exception) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
