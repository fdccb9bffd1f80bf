"""`GrpcExecutorLink`: the scheduler's side of one executor's `Execute` stream, with reconnect.

An executor on this host that serves the Execute stream as frames too (GetInfo's `framed_execute_path`,
executor.proto "The Execute stream over length-prefixed frames") gets its batches there: the same
stream, without gRPC's per-message cost. GetInfo and Reset stay on gRPC; a framed socket that cannot be
opened falls back to the gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc

from l4m.scheduler.executors import OnConnected, OnLost, OnResponse
from l4m.v1 import executor_pb2, executor_pb2_grpc
from l4m.wire import frames, limits
from l4m.wire.credentials import bearer_metadata, is_loopback_host, open_channel

log = logging.getLogger(__name__)

# A host that is down answers no SYN: each attempt (a fresh channel) waits for its GetInfo deadline; between
# attempts the link's own backoff, capped at `max_backoff_s`, so a returning host is taken back within
# seconds. The channel's own retries within one attempt stay under the same cap.
_RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 5000))
# The executor's limits (l4m.wire.limits, advertised in its GetInfo): the batcher keeps batches and their
# replies within them. Keepalive pings notice a host that vanished without a word (l4m.wire.limits).
_CHANNEL_OPTIONS = (*limits.grpc_options(limits.EXECUTOR_MAX_REQUEST_BYTES, limits.EXECUTOR_MAX_REPLY_BYTES),
                    *limits.EXECUTOR_KEEPALIVE_CLIENT_OPTIONS, *_RECONNECT_OPTIONS)


EXECUTOR_TRANSPORTS = ("auto", "grpc")


def is_on_this_host(address: str) -> bool:
    """Whether a gRPC executor address is on this host (a Unix socket or a loopback address): only then
    may the framed socket path its GetInfo reports name the same executor."""
    if address.startswith("unix:"):
        return True
    return is_loopback_host(address.rsplit(":", 1)[0].strip("[]"))


class FramedOpenError(Exception):
    """The executor refused or did not answer a framed Execute stream's opening."""


class FramedExecuteStream(frames.FrameProtocol):
    """The scheduler's end of a framed Execute stream: replies go to `on_response` in the callback that read
    them; `ended` resolves with the reason once the stream is over."""

    def __init__(self, on_response: OnResponse) -> None:
        super().__init__(limits.EXECUTOR_MAX_REPLY_BYTES)
        loop = asyncio.get_running_loop()
        self.on_response = on_response
        self.opened: asyncio.Future[None] = loop.create_future()
        self.ended: asyncio.Future[str] = loop.create_future()

    @classmethod
    async def open(cls, path: str, secret: str, on_response: OnResponse, timeout_s: float) -> FramedExecuteStream:
        loop = asyncio.get_running_loop()
        _, stream = await loop.create_unix_connection(lambda: cls(on_response), path)
        stream.write(frames.encode(frames.EXECUTE_OPEN, executor_pb2.FramedExecuteOpen(
            protocol_version=frames.PROTOCOL_VERSION, cluster_secret=secret)))
        try:
            await asyncio.wait_for(asyncio.shield(stream.opened), timeout_s)
        except BaseException:
            stream.opened.cancel()  # (its end, when the close comes, has no one to tell)
            stream.close()
            raise
        return stream

    def send(self, request: executor_pb2.ExecuteRequest) -> None:
        self.write(frames.encode(frames.EXECUTE, request))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def frame_received(self, kind: int, payload: bytes) -> None:
        if kind == frames.EXECUTED and self.opened.done():
            self.on_response(executor_pb2.ExecuteResponse.FromString(payload))
        elif kind == frames.STATUS:
            code, message = frames.parse_status(payload)
            if code == grpc.StatusCode.OK and not self.opened.done():
                self.opened.set_result(None)
                return
            self._stop(f"{code.name}: {message}")
        else:
            self._stop(f"the executor sent a frame of kind {kind}")

    def stream_ended(self, error: Exception | None) -> None:
        self._stop(f"the executor closed the framed stream{f' ({error})' if error else ''}")

    def _stop(self, reason: str) -> None:
        self.end_reading()
        if not self.opened.done():
            self.opened.set_exception(FramedOpenError(reason))
        if not self.ended.done():
            self.ended.set_result(reason)
        self.close()


class GrpcExecutorLink:
    """One executor address. While connected, batches go out on one `Execute` stream in `send` order.
    When the stream breaks the link reports the loss, then retries (GetInfo, Reset, then a new stream)
    with exponential backoff until `close`. Every call carries the cluster secret when one is given (an
    executor started with --cluster-secret-file refuses calls without it); TLS when `tls_ca` is given.

    Reset on every connect: the core starts each connection with empty tables (`Executor.connect`), while
    an executor that outlived a broken stream still holds the old allocations. Reset frees them on the
    executor, after any batch still queued there, so both sides start empty; nothing is assumed about
    whether the executor restarted. (Reconciling against a state RPC instead would have to keep pages of
    instances that were already trapped, for nothing: every instance on a lost stream is trapped.)"""

    def __init__(self, address: str, *, initial_backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 rpc_timeout_s: float = 10.0, secret: str = "", tls_ca: Path | None = None,
                 transport: str = "auto") -> None:
        if transport not in EXECUTOR_TRANSPORTS:
            raise ValueError(f"executor transport {transport!r} is not one of {', '.join(EXECUTOR_TRANSPORTS)}")
        self.address = address
        self._secret = secret
        # Frames where the executor offers them on this host (`auto`), or always the gRPC stream.
        self._may_use_frames = transport == "auto" and is_on_this_host(address)
        self.transport_in_use = ""  # "grpc" or "framed" while connected
        self._framed: FramedExecuteStream | None = None
        self._metadata = bearer_metadata(secret) if secret else ()
        self._tls_ca = tls_ca
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._rpc_timeout_s = rpc_timeout_s
        self._outbox: asyncio.Queue[executor_pb2.ExecuteRequest | None] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, on_connected: OnConnected, on_response: OnResponse, on_lost: OnLost) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(on_connected, on_response, on_lost))

    def send(self, request: executor_pb2.ExecuteRequest) -> None:
        if self._framed is not None:
            self._framed.send(request)
        elif self._outbox is not None:
            self._outbox.put_nowait(request)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _requests(self, outbox: asyncio.Queue[executor_pb2.ExecuteRequest | None]):  # type: ignore[no-untyped-def]
        while (request := await outbox.get()) is not None:
            yield request

    async def _open_framed(self, path: str, on_response: OnResponse) -> FramedExecuteStream | None:
        """The framed Execute stream where the executor offers one on this host; None: use gRPC's."""
        if not path or not self._may_use_frames:
            return None
        try:
            return await FramedExecuteStream.open(path, self._secret, on_response, self._rpc_timeout_s)
        except (OSError, FramedOpenError, TimeoutError) as error:
            log.warning("executor %s: its framed Execute stream at %s cannot be opened (%s); using gRPC's",
                        self.address, path, error or type(error).__name__)
            return None

    async def _run(self, on_connected: OnConnected, on_response: OnResponse, on_lost: OnLost) -> None:
        backoff_s = self._initial_backoff_s
        while True:
            reason = "the executor ended the stream"
            is_connected = False
            async with open_channel(self.address, self._tls_ca, _CHANNEL_OPTIONS) as channel:
                stub = executor_pb2_grpc.ExecutorServiceStub(channel)
                try:
                    info = await stub.GetInfo(
                        executor_pb2.ExecutorServiceGetInfoRequest(), timeout=self._rpc_timeout_s, wait_for_ready=True,
                        metadata=self._metadata,
                    )
                    freed = await stub.Reset(
                        executor_pb2.ExecutorServiceResetRequest(), timeout=self._rpc_timeout_s, metadata=self._metadata,
                    )
                    if freed.num_kv_pages_freed or freed.num_embed_slots_freed:
                        log.warning("executor %s still held %d kv pages and %d embed slots of an earlier connection; "
                                    "reset freed them", self.address, freed.num_kv_pages_freed,
                                    freed.num_embed_slots_freed)
                    framed = await self._open_framed(info.framed_execute_path, on_response)
                    if framed is not None:
                        self._framed, self.transport_in_use = framed, "framed"
                        is_connected = True
                        backoff_s = self._initial_backoff_s
                        on_connected(info)
                        try:
                            reason = await framed.ended
                        finally:
                            framed.close()
                    else:
                        outbox: asyncio.Queue[executor_pb2.ExecuteRequest | None] = asyncio.Queue()
                        call = stub.Execute(self._requests(outbox), metadata=self._metadata)
                        self._outbox, self.transport_in_use = outbox, "grpc"
                        is_connected = True
                        backoff_s = self._initial_backoff_s
                        on_connected(info)
                        async for response in call:
                            on_response(response)
                except grpc.aio.AioRpcError as error:
                    reason = f"{error.code().name}: {error.details()}"
                finally:
                    self._outbox, self._framed, self.transport_in_use = None, None, ""
            if is_connected:
                on_lost(reason)
            else:
                log.info("executor %s not reachable (%s); retrying in %.1fs", self.address, reason, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
