"""gRPC servicers of the scheduler: L4MService (controllers) and InstanceRegistryService (spawner).

Two planes, two gRPC servers: `create_server` serves the data plane (L4MService, health, reflection)
on `--listen`/`--listen-unix`, the addresses sandboxes reach; `create_registry_server` serves the
control plane (InstanceRegistryService) on `--registry-listen` alone, every call authenticated by the
cluster secret. One gRPC server cannot keep a service off one of its ports, hence two.

Thin: each RPC authenticates, hands protobuf to the core (`core.Scheduler`) and maps traps and
refusals to status codes (`TRAP_STATUS` and `REGISTRATION_STATUS`, the one place each). Health
(grpc.health.v1) turns SERVING once an executor is connected; server reflection is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from l4m.common.serving import GrpcServer, build_server
from l4m.scheduler.config import SchedulerConfig
from l4m.scheduler.core import Scheduler
from l4m.scheduler.errors import (
    AlreadyRegistered,
    InvalidCommand,
    RegistrationError,
    TooManyInstances,
    TrapError,
    UnknownParent,
)
from l4m.scheduler.instances import Instance
from l4m.scheduler.links import GrpcExecutorLink
from l4m.scheduler.models import ServedModel, UnknownModel
from l4m.v1 import l4m_pb2, l4m_pb2_grpc, registry_pb2, registry_pb2_grpc
from l4m.wire import limits
from l4m.wire.credentials import bearer_token, secrets_equal
from l4m.wire.metadata import MODEL_METADATA_KEY, TOKEN_METADATA_KEY

log = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16
TRAP_STATUS = {
    l4m_pb2.TRAP_KIND_INVALID_COMMAND: grpc.StatusCode.INVALID_ARGUMENT,
    l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    l4m_pb2.TRAP_KIND_EVICTED: grpc.StatusCode.ABORTED,
    l4m_pb2.TRAP_KIND_EXECUTOR_LOST: grpc.StatusCode.UNAVAILABLE,
    l4m_pb2.TRAP_KIND_DESTROYED: grpc.StatusCode.ABORTED,
    l4m_pb2.TRAP_KIND_TOKEN_BUDGET: grpc.StatusCode.RESOURCE_EXHAUSTED,
    l4m_pb2.TRAP_KIND_UNSUPPORTED: grpc.StatusCode.FAILED_PRECONDITION,
    l4m_pb2.TRAP_KIND_PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
}
REGISTRATION_STATUS: dict[type[RegistrationError], grpc.StatusCode] = {
    AlreadyRegistered: grpc.StatusCode.ALREADY_EXISTS,
    UnknownParent: grpc.StatusCode.NOT_FOUND,
    TooManyInstances: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Controllers' messages (l4m.wire.limits, advertised in GetInfo): validation bounds each command's reply to fit.
_MESSAGE_OPTIONS = limits.grpc_options(limits.MAX_RESPONSE_BYTES, limits.MAX_COMMAND_BYTES)
_END = object()


class _QueueSink:
    """An instance's events, for the session's writer."""

    __slots__ = ("queue",)

    def __init__(self) -> None:
        self.queue: asyncio.Queue[object] = asyncio.Queue()

    def send(self, response: l4m_pb2.SessionResponse) -> None:
        self.queue.put_nowait(response)

    def end(self, trap: l4m_pb2.Trap | None) -> None:
        self.queue.put_nowait(_END)


class SessionRefused(Exception):
    """A session the scheduler will not open, with the status that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def admit_session(scheduler: Scheduler, token: str | None, model_name: str = "") -> tuple[Instance, ServedModel]:
    """The instance a new session (gRPC or framed) speaks for (the one its token names, or a new anonymous
    one where the scheduler allows them) and the model it serves. Raises SessionRefused."""
    if not scheduler.is_ready:
        raise SessionRefused(grpc.StatusCode.UNAVAILABLE, "no executor is connected yet")
    try:
        model = scheduler.served_model(model_name)
    except UnknownModel as error:
        raise SessionRefused(grpc.StatusCode.NOT_FOUND, str(error)) from None
    return _admit_instance(scheduler, token), model


def _admit_instance(scheduler: Scheduler, token: str | None) -> Instance:
    if token:
        instance = scheduler.instances.by_token(token)
        if instance is None:
            raise SessionRefused(grpc.StatusCode.UNAUTHENTICATED, f"unknown {TOKEN_METADATA_KEY}")
        return instance
    if not scheduler.config.allow_anonymous:
        raise SessionRefused(grpc.StatusCode.UNAUTHENTICATED, f"missing {TOKEN_METADATA_KEY} metadata")
    try:
        return scheduler.register_anonymous()
    except RegistrationError as error:
        raise SessionRefused(REGISTRATION_STATUS[type(error)], str(error)) from None


class L4MServicer(l4m_pb2_grpc.L4MServiceServicer):
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    async def GetInfo(self, request: l4m_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> l4m_pb2.GetInfoResponse:
        try:
            return self.scheduler.get_info(request.omit_tokenizer_json, request.model)
        except TrapError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, error.reason)
            raise
        except UnknownModel as error:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(error))
            raise

    async def Session(self, request_iterator: AsyncIterator[l4m_pb2.SessionRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[l4m_pb2.SessionResponse]:
        scheduler = self.scheduler
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        try:
            instance, model = admit_session(scheduler, metadata.get(TOKEN_METADATA_KEY),
                                            metadata.get(MODEL_METADATA_KEY, ""))
        except SessionRefused as refusal:
            await context.abort(refusal.code, refusal.message)
        sink = _QueueSink()
        try:
            instance = scheduler.open_session(instance, sink, metadata.get("traceparent"), model)
        except ValueError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except RegistrationError as error:  # a companion session (another model) past --max-instances
            await context.abort(REGISTRATION_STATUS[type(error)], str(error))
        # Tells the controller the session is accepted: it waits for this before its first write, so a
        # refusal above reaches it as its own status (see the Session rpc's comment).
        await context.send_initial_metadata(())
        reader = asyncio.create_task(self._read(request_iterator, instance))
        try:
            queue = sink.queue
            while (event := await queue.get()) is not _END:
                yield event
        finally:
            reader.cancel()
            scheduler.close_session(instance)
        if instance.trap is not None:
            await context.abort(TRAP_STATUS.get(instance.trap.kind, grpc.StatusCode.ABORTED), instance.trap.reason)

    async def _read(self, request_iterator: AsyncIterator[l4m_pb2.SessionRequest], instance: object) -> None:
        submit = self.scheduler.submit
        with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
            try:
                async for request in request_iterator:
                    submit(instance, request)  # type: ignore[arg-type]
            except DecodeError as error:
                # Bytes that are not a SessionRequest: a malformed command like any other, so it traps
                # (INVALID_ARGUMENT with the reason) instead of leaving the session without a reader.
                self.scheduler.trap(instance, InvalidCommand(  # type: ignore[arg-type]
                    f"a message on the Session stream does not parse as l4m.v1.SessionRequest ({error})"))
                return
        # The controller closed its side: what it sent still runs, then the session ends.
        self.scheduler.finish_session(instance)  # type: ignore[arg-type]


class RegistryServicer(registry_pb2_grpc.InstanceRegistryServiceServicer):
    """The spawner's service. Every call must carry the cluster secret: whoever holds it can create
    and destroy instances, so a call without it learns nothing and changes nothing."""

    def __init__(self, scheduler: Scheduler, cluster_secret: str) -> None:
        if not cluster_secret:
            raise ValueError("the registry needs a cluster secret")
        self.scheduler = scheduler
        self._cluster_secret = cluster_secret

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        if not secrets_equal(bearer_token(context.invocation_metadata()), self._cluster_secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "the instance registry needs the cluster secret as 'authorization: Bearer' metadata")

    async def RegisterInstance(self, request: registry_pb2.RegisterInstanceRequest,
                               context: grpc.aio.ServicerContext) -> registry_pb2.RegisterInstanceResponse:
        await self._authenticate(context)
        if not request.instance_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "instance_id is empty")
        if len(request.token.encode()) < MIN_TOKEN_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"token is shorter than {MIN_TOKEN_BYTES} bytes")
        try:
            self.scheduler.register_instance(
                request.instance_id, request.token, request.max_tokens, request.launched_at_unix_ms,
                user=request.user, is_admin=request.is_admin, parent_instance_id=request.parent_instance_id,
                user_max_tokens_per_minute=request.user_max_tokens_per_minute,
            )
        except RegistrationError as error:
            await context.abort(REGISTRATION_STATUS[type(error)], str(error))
        return registry_pb2.RegisterInstanceResponse()

    async def DestroyInstance(self, request: registry_pb2.DestroyInstanceRequest,
                              context: grpc.aio.ServicerContext) -> registry_pb2.DestroyInstanceResponse:
        await self._authenticate(context)
        pages, slots = self.scheduler.destroy_instance(request.instance_id, request.reason)
        return registry_pb2.DestroyInstanceResponse(num_kv_pages_freed=pages, num_embed_slots_freed=slots)

    async def WatchInstanceEvents(self, request: registry_pb2.WatchInstanceEventsRequest,
                                  context: grpc.aio.ServicerContext) -> AsyncIterator[registry_pb2.WatchInstanceEventsResponse]:
        await self._authenticate(context)
        queue: asyncio.Queue[registry_pb2.WatchInstanceEventsResponse] = asyncio.Queue()

        def watch(instance_id: str, trap: l4m_pb2.Trap) -> None:
            queue.put_nowait(registry_pb2.WatchInstanceEventsResponse(instance_id=instance_id, trap=trap))

        self.scheduler.watchers.append(watch)
        try:
            while True:
                yield await queue.get()
        finally:
            self.scheduler.watchers.remove(watch)


def build_scheduler(config: SchedulerConfig) -> Scheduler:
    links = [
        GrpcExecutorLink(address, initial_backoff_s=config.reconnect_initial_s, max_backoff_s=config.reconnect_max_s,
                         rpc_timeout_s=config.executor_rpc_timeout_s, secret=config.cluster_secret,
                         tls_ca=config.executor_tls_ca, transport=config.executor_transport)
        for address in config.executor_addresses
    ]
    return Scheduler(config, links)  # type: ignore[arg-type]


@dataclass
class SchedulerServer:
    """The data-plane gRPC server, the core behind it (its metrics, its close) and the task that
    reports the core's readiness as health."""

    grpc_server: GrpcServer
    scheduler: Scheduler
    health_task: asyncio.Task[None]

    @property
    def port(self) -> int:
        """The bound port of `config.listen` (0 for a Unix socket)."""
        return self.grpc_server.port

    async def stop(self, grace_s: float | None) -> None:
        """Stops serving and reporting health; the core stays open (`scheduler.close()`)."""
        await self.grpc_server.stop(grace_s)
        self.health_task.cancel()


async def create_server(config: SchedulerConfig, scheduler: Scheduler | None = None) -> SchedulerServer:
    """Start the scheduler core and the data-plane gRPC server on `config.listen` (and
    `config.listen_unix`). No InstanceRegistryService here (see `create_registry_server`)."""
    scheduler = scheduler or build_scheduler(config)
    scheduler.start()
    listeners = [(config.listen, config.tls)]
    if config.listen_unix:
        listeners.append((f"unix:{config.listen_unix}", None))
    server = build_server(
        [(l4m_pb2_grpc.add_L4MServiceServicer_to_server, L4MServicer(scheduler))],
        listeners,
        options=_MESSAGE_OPTIONS,
        # Health reports on reflection and on itself too, as it always has.
        health_names=(
            l4m_pb2.DESCRIPTOR.services_by_name["L4MService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
    )
    await server.start()
    return SchedulerServer(server, scheduler, asyncio.create_task(_report_health(scheduler, server)))


async def create_registry_server(config: SchedulerConfig, scheduler: Scheduler) -> GrpcServer:
    """Start the control-plane server (InstanceRegistryService only) on `config.registry_listen`; its
    `port` is 0 for a Unix socket. Needs `config.cluster_secret`."""
    if not config.registry_listen:
        raise ValueError("config.registry_listen is not set")
    server = build_server(
        [(registry_pb2_grpc.add_InstanceRegistryServiceServicer_to_server,
          RegistryServicer(scheduler, config.cluster_secret))],
        [(config.registry_listen, config.tls)],
        reflection=False,
    )
    await server.start()
    return server


async def _report_health(scheduler: Scheduler, server: GrpcServer) -> None:
    """NOT_SERVING until an executor is connected, SERVING while one is."""
    last = None
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if scheduler.is_ready else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != last:
            await server.set_health(status)
            last = status
        await asyncio.sleep(0.05 if status != health_pb2.HealthCheckResponse.SERVING else 1.0)
