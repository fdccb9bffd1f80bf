"""`GrpcExecutorLink`: the scheduler's side of one executor's `Execute` stream, with reconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import grpc

from l4m.scheduler.executors import OnConnected, OnLost, OnResponse
from l4m.v1 import executor_pb2, executor_pb2_grpc
from l4m.wire import limits
from l4m.wire.credentials import bearer_metadata, open_channel

log = logging.getLogger(__name__)

# The executor's limits (l4m.wire.limits, advertised in its GetInfo): the batcher keeps batches and their
# replies within them.
_CHANNEL_OPTIONS = limits.grpc_options(limits.EXECUTOR_MAX_REQUEST_BYTES, limits.EXECUTOR_MAX_REPLY_BYTES)


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
                 rpc_timeout_s: float = 10.0, secret: str = "", tls_ca: Path | None = None) -> None:
        self.address = address
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
        if self._outbox is not None:
            self._outbox.put_nowait(request)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _requests(self, outbox: asyncio.Queue[executor_pb2.ExecuteRequest | None]):  # type: ignore[no-untyped-def]
        while (request := await outbox.get()) is not None:
            yield request

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
                    outbox: asyncio.Queue[executor_pb2.ExecuteRequest | None] = asyncio.Queue()
                    call = stub.Execute(self._requests(outbox), metadata=self._metadata)
                    self._outbox = outbox
                    is_connected = True
                    backoff_s = self._initial_backoff_s
                    on_connected(info)
                    async for response in call:
                        on_response(response)
                except grpc.aio.AioRpcError as error:
                    reason = f"{error.code().name}: {error.details()}"
                finally:
                    self._outbox = None
            if is_connected:
                on_lost(reason)
            else:
                log.info("executor %s not reachable (%s); retrying in %.1fs", self.address, reason, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
