"""Thin grpc.aio servicer for `ExecutorService`: protobuf -> engine -> protobuf.

Batches run on ONE worker thread, in arrival order across all streams, so the event loop stays free
and fire-and-forget batches keep their order. A stream pipelines: requests are read and queued while
earlier batches compute; replies go out in the same order.

Only the scheduler talks to an executor: with a cluster secret configured, Execute, GetInfo and Reset
answer UNAUTHENTICATED to a call without it (health and reflection stay open, for probes).

Reset (the scheduler calls it on every connect) frees every page and slot on the worker thread, after
the batches already queued there, and retires every Execute stream opened before it: a batch of an
older stream that has not run yet is dropped, so nothing an old stream sent lands after the reset.

With `--listen-framed PATH` the executor also serves the Execute stream as frames on that Unix socket
(`l4m.common.framed_execute`; GetInfo reports the path): the same batches, the same worker thread and
Reset generations, a fraction of gRPC's CPU per batch.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from l4m.common.framed_execute import FramedExecuteServer
from l4m.common.serving import GrpcServer, build_server
from l4m.executor.convert import batch_from_pb, error_to_pb, info_to_pb, reply_to_pb
from l4m.executor.engine import Engine, EngineConfig
from l4m.executor.errors import CapabilityError, ExecutorError
from l4m.executor.weights import load_model
from l4m.memory import release_free_memory
from l4m.v1 import executor_pb2, executor_pb2_grpc
from l4m.wire import limits
from l4m.wire.credentials import TlsFiles, bearer_token, secrets_equal
from l4m.wire.tracecontext import parent_context

log = logging.getLogger(__name__)
SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["ExecutorService"].full_name


@dataclass(frozen=True)
class ExecutorConfig:
    """Everything `python -m l4m.executor` needs; built once in `main()`."""

    listen: str  # "127.0.0.1:0", "[::]:50061" or "unix:/path/executor.sock"
    model_path: str
    engine: EngineConfig
    # Execute, GetInfo and Reset need it as `authorization: Bearer` metadata; "" = open (a test or dev setup).
    cluster_secret: str = ""
    tls: TlsFiles | None = None  # TLS on a TCP listener
    listen_framed: str = ""  # a Unix socket path for the framed Execute stream; "" = none
    model_name: str = ""  # what GetInfo and sessions call the model; "" = the model's own name


def device_thread() -> ThreadPoolExecutor:
    """The one OS thread that runs every torch call of an executor: loading the model and every batch.

    Each thread that enters a parallel region gets its own OpenMP team; a model loaded on the main thread
    and run on a worker leaves two teams of threads on the cores (on 2 cores, in-process A/B runs of batch-1
    decode steps measured up to ~20 % slower with two teams; the machine's noise is of the same order)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="executor-device")


class ExecutorServicer(executor_pb2_grpc.ExecutorServiceServicer):
    def __init__(self, engine: Engine, worker: ThreadPoolExecutor | None = None, cluster_secret: str = "",
                 framed_execute_path: str = "") -> None:
        self.engine = engine
        self._worker = worker or device_thread()
        self._cluster_secret = cluster_secret
        self.framed_execute_path = framed_execute_path  # reported by GetInfo
        # Bumped by each Reset; an Execute stream runs batches only while the generation it opened in is
        # current.
        self._generation = 0

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        """Whoever can Execute can read and write every instance's pages: only the scheduler may."""
        if self._cluster_secret and not secrets_equal(bearer_token(context.invocation_metadata()),
                                                      self._cluster_secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "the executor needs the cluster secret as 'authorization: Bearer' metadata")

    def _run_batch(
        self, request: executor_pb2.ExecuteRequest, generation: int
    ) -> executor_pb2.ExecuteResponse | None:
        """Runs on the worker thread; every failure becomes this batch's error reply. A batch of a stream
        opened before the last Reset is dropped (None)."""
        if generation != self._generation:
            return None
        cid = request.correlation_id
        try:
            batch = batch_from_pb(request)
            parent = parent_context(request.trace_context.traceparent, request.trace_context.tracestate)
            return reply_to_pb(cid, batch, self.engine.execute(batch, parent))
        except CapabilityError as exc:
            return error_to_pb(cid, exc, is_unsupported=True)
        except ExecutorError as exc:
            return error_to_pb(cid, exc, is_unsupported=False)
        except Exception as exc:  # a bug must not kill the stream; report it on this batch
            log.exception("batch %d failed", cid)
            return error_to_pb(cid, ExecutorError(f"internal error: {type(exc).__name__}: {exc}"), False)

    async def GetInfo(
        self, request: executor_pb2.ExecutorServiceGetInfoRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorServiceGetInfoResponse:
        await self._authenticate(context)
        info = await asyncio.get_running_loop().run_in_executor(self._worker, self.engine.get_info)
        response = info_to_pb(info)
        response.framed_execute_path = self.framed_execute_path
        return response

    async def Reset(
        self, request: executor_pb2.ExecutorServiceResetRequest, context: grpc.aio.ServicerContext
    ) -> executor_pb2.ExecutorServiceResetResponse:
        await self._authenticate(context)
        self._generation += 1
        num_pages, num_slots = await asyncio.get_running_loop().run_in_executor(self._worker, self.engine.reset)
        log.info("reset: freed %d kv pages and %d embed slots; earlier Execute streams retired", num_pages, num_slots)
        return executor_pb2.ExecutorServiceResetResponse(num_kv_pages_freed=num_pages, num_embed_slots_freed=num_slots)

    async def Execute(
        self, request_iterator: AsyncIterator[executor_pb2.ExecuteRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[executor_pb2.ExecuteResponse]:
        await self._authenticate(context)
        loop = asyncio.get_running_loop()
        pending: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
        generation = self._generation

        async def read() -> None:
            try:
                async for request in request_iterator:
                    if generation != self._generation:
                        break  # a Reset retired this stream
                    await pending.put(loop.run_in_executor(self._worker, self._run_batch, request, generation))
            finally:
                await pending.put(None)

        reader = asyncio.create_task(read())
        try:
            while (future := await pending.get()) is not None:
                reply = await future
                if reply is not None:
                    yield reply
        finally:
            reader.cancel()

    def open_framed_stream(self) -> _FramedStream:
        """The runner of a framed Execute stream accepted now (it runs in the current Reset generation)."""
        return _FramedStream(self, asyncio.get_running_loop(), self._generation)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


class _FramedStream:
    """A framed Execute stream's batches: on the worker thread, in order, while its generation is current."""

    __slots__ = ("servicer", "loop", "generation")

    def __init__(self, servicer: ExecutorServicer, loop: asyncio.AbstractEventLoop, generation: int) -> None:
        self.servicer, self.loop, self.generation = servicer, loop, generation

    def run(self, request: executor_pb2.ExecuteRequest) -> asyncio.Future[executor_pb2.ExecuteResponse | None]:
        servicer = self.servicer
        return self.loop.run_in_executor(servicer._worker, servicer._run_batch, request, self.generation)

    @property
    def is_retired(self) -> bool:
        return self.generation != self.servicer._generation


@dataclass
class ExecutorServer:
    """The executor's gRPC server and the engine behind it (its metrics read the engine)."""

    grpc_server: GrpcServer
    engine: Engine
    framed_server: FramedExecuteServer | None = None

    @property
    def port(self) -> int:
        """The bound TCP port; 0 for a Unix socket."""
        return self.grpc_server.port

    async def stop(self, grace_s: float | None) -> None:
        if self.framed_server is not None:
            await self.framed_server.stop()
        await self.grpc_server.stop(grace_s)


async def create_server(config: ExecutorConfig, engine: Engine | None = None) -> ExecutorServer:
    """Load the model (unless `engine` is given), then build and start the server, SERVING."""
    worker = device_thread()
    if engine is None:
        engine = await asyncio.get_running_loop().run_in_executor(
            worker, lambda: Engine(load_model(config.model_path, config.model_name), config.engine)
        )
        # The loaded float32 tensors the engine did not keep are free but resident in the C heap: ~680 MiB
        # for SmolLM2 on the 4-bit blocks (RSS 1,197 -> 517 MiB), handed back to the kernel here.
        release_free_memory()
    framed_path = os.path.abspath(config.listen_framed) if config.listen_framed else ""
    servicer = ExecutorServicer(engine, worker, config.cluster_secret, framed_path)
    try:
        server = build_server(
            [(executor_pb2_grpc.add_ExecutorServiceServicer_to_server, servicer)],
            [(config.listen, config.tls)],
            # The limits GetInfo advertises (l4m.wire.limits): batches are bounded so that their replies fit.
            options=[*limits.grpc_options(limits.EXECUTOR_MAX_REPLY_BYTES, limits.EXECUTOR_MAX_REQUEST_BYTES),
                     *limits.EXECUTOR_KEEPALIVE_SERVER_OPTIONS],  # the scheduler's pings
            health_names=(SERVICE_NAME,),
        )
    except OSError as error:
        raise RuntimeError(f"could not bind {config.listen}") from error
    await server.start()
    framed_server = None
    if framed_path:
        framed_server = FramedExecuteServer(framed_path, servicer.open_framed_stream, config.cluster_secret)
        try:
            await framed_server.start()
        except OSError as error:
            await server.stop(None)
            raise RuntimeError(f"could not bind the framed socket {framed_path}: {error}") from error
    await server.set_health(health_pb2.HealthCheckResponse.SERVING)
    return ExecutorServer(server, engine, framed_server)
