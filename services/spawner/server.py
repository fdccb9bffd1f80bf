"""The spawner's gRPC layer: SpawnerService for users, RuntimeService for controllers.

Thin servicers: each RPC converts protobuf to domain values, calls `InstanceManager` / `ProgramStore`,
and converts back. `_errors_to_status` is the one place typed errors become gRPC status codes.

Two gRPC servers, so that neither side can reach the other's API: users reach SpawnerService (with
health and reflection) on `config.listen_address`; controllers reach RuntimeService (and the OTLP
span forwarder, see span_forwarder.py) only on the Unix socket `<socket_dir>/<runtime_socket_name>`,
mounted at /run/l4m, identified by their `l4m-instance-token` metadata. `create_server` builds both
around one `InstanceManager`, for `main()` and the tests alike.

Users are authenticated per call from their `authorization: Bearer <key>` metadata (`users.py`); health
and reflection stay open. The TCP listener speaks TLS when the config names a certificate and key.
`create_server` refuses a spawner with neither a keys file nor `insecure_local`, and `insecure_local`
on an address other than loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from l4m.common.serving import GrpcServer, Service, build_server
from l4m.common.users import Authenticator, Unauthenticated, User
from l4m.spawner.config import SpawnerConfig
from l4m.spawner.framed_runtime import FramedRuntimeServer
from l4m.spawner.instances import (
    ArgsTooLarge,
    InboxFull,
    Instance,
    InstanceManager,
    InstanceNotFound,
    InstanceRegistry,
    InvalidModelName,
    LaunchFailed,
    LimitTooHigh,
    NoScheduler,
    QuotaExceeded,
    RegistrationRefused,
    SchedulerUnavailable,
    TagTaken,
    TooManyChildren,
    TooManyInstances,
)
from l4m.spawner.metrics import SpawnerMetrics
from l4m.spawner.programs import (
    DigestMismatch,
    InvalidProgram,
    InvalidTag,
    ProgramNotFound,
    ProgramStore,
    ProgramTooLarge,
)
from l4m.spawner.registry_client import GrpcInstanceRegistry
from l4m.spawner.sandbox import ExitInfo, ExitReason, Limits, OutputStream, Sandbox
from l4m.spawner.span_forwarder import SpanForwarder
from l4m.spawner.supervisor import ExitEvent, InstanceState, MessageEvent, OutputEvent
from l4m.spawner.validate_upload import UploadValidator, ValidatorLimits
from l4m.spawner.variables import VariableError, VariableQuotaExceeded
from l4m.v1 import spawner_pb2, spawner_pb2_grpc
from l4m.wire.credentials import bearer_token, read_secret_file, tls_files
from l4m.wire.metadata import TOKEN_METADATA_KEY

_STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (ProgramNotFound, grpc.StatusCode.NOT_FOUND),
    (InstanceNotFound, grpc.StatusCode.NOT_FOUND),
    (InvalidProgram, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidTag, grpc.StatusCode.INVALID_ARGUMENT),
    (DigestMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    (VariableQuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (VariableError, grpc.StatusCode.INVALID_ARGUMENT),
    (LimitTooHigh, grpc.StatusCode.INVALID_ARGUMENT),
    (ArgsTooLarge, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidModelName, grpc.StatusCode.INVALID_ARGUMENT),
    (InboxFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ProgramTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManyInstances, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManyChildren, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TagTaken, grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (SchedulerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (RegistrationRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (LaunchFailed, grpc.StatusCode.UNAVAILABLE),
)
MAX_CONCURRENT_UPLOADS = 16
# One batched Attach response holds at most this many bytes of events (a single larger event goes alone),
# well under a gRPC client's default 4 MiB receive limit.
MAX_ATTACH_RESPONSE_BYTES = 1 << 20


def _attach_chunks(events: list[spawner_pb2.AttachResponse]) -> list[list[spawner_pb2.AttachResponse]]:
    """`events` in order, cut into runs of at most MAX_ATTACH_RESPONSE_BYTES each."""
    chunks: list[list[spawner_pb2.AttachResponse]] = [[]]
    size = 0
    for event in events:
        event_size = event.ByteSize() + 8  # its tag and length inside the batch
        if chunks[-1] and size + event_size > MAX_ATTACH_RESPONSE_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(event)
        size += event_size
    return chunks
_EXIT_REASON_TO_PB = {reason: getattr(spawner_pb2, f"EXIT_REASON_{reason.name}", 0) for reason in ExitReason}
_STATE_TO_PB = {state: getattr(spawner_pb2, f"INSTANCE_STATE_{state.name}") for state in InstanceState}


@contextlib.asynccontextmanager
async def _errors_to_status(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    try:
        yield
    except Exception as exc:
        for error_type, code in _STATUS_BY_ERROR:
            if isinstance(exc, error_type):
                await context.abort(code, str(exc))
        raise


# -- conversions -----------------------------------------------------------------------------------


def limits_from_pb(limits: spawner_pb2.Limits) -> Limits:
    """0 fields stay 0 (= "the default"); `resolve_limits` fills them and refuses any over the maximum."""
    return Limits(
        wall_time_s=limits.wall_time_ms / 1000,
        cpu_time_s=limits.cpu_time_ms / 1000,
        memory_bytes=limits.memory_bytes,
        max_processes=limits.max_processes,
        max_open_files=limits.max_open_files,
        max_output_bytes=limits.max_output_bytes,
        cpu_cores=0.0,
        tmp_bytes=0,
    )


def exit_to_pb(info: ExitInfo) -> spawner_pb2.InstanceExit:
    return spawner_pb2.InstanceExit(
        reason=_EXIT_REASON_TO_PB[info.reason],
        exit_code=info.exit_code or 0,
        signal=info.signal or 0,
        message=info.message,
    )


def event_to_pb(event: OutputEvent | MessageEvent | ExitEvent) -> spawner_pb2.AttachResponse:
    if isinstance(event, MessageEvent):
        return spawner_pb2.AttachResponse(message=spawner_pb2.InstanceMessage(text=event.text))
    if isinstance(event, ExitEvent):
        return spawner_pb2.AttachResponse(exit=exit_to_pb(event.info))
    stream = (
        spawner_pb2.LOG_STREAM_STDOUT
        if event.stream is OutputStream.STDOUT
        else spawner_pb2.LOG_STREAM_STDERR
    )
    line = event.data.decode("utf-8", errors="replace").removesuffix("\n")
    return spawner_pb2.AttachResponse(log=spawner_pb2.LogLine(stream=stream, line=line))


def instance_to_pb(instance: Instance) -> spawner_pb2.InstanceInfo:
    info = spawner_pb2.InstanceInfo(
        instance_id=instance.instance_id,
        program_sha256=instance.program_sha256,
        args=instance.args,
        state=_STATE_TO_PB[instance.state],
        parent_instance_id=instance.parent_id,
        launched_at_unix_ms=instance.launched_at_unix_ms,
        user=instance.owner.name,
        detached=instance.detached,
        shared_process=instance.shared_process,
    )
    if instance.exit_info is not None:
        info.exit.CopyFrom(exit_to_pb(instance.exit_info))
    return info


def _timeout_s(timeout_ms: int) -> float | None:
    return timeout_ms / 1000 if timeout_ms else None


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    return dict(context.invocation_metadata() or ()).get("traceparent", "")


# -- SpawnerService -----------------------------------------------------------------------------


class SpawnerServicer(spawner_pb2_grpc.SpawnerServiceServicer):
    """Every call is a user's: `_user` authenticates its API key first (UNAUTHENTICATED otherwise)."""

    def __init__(
        self, manager: InstanceManager, authenticator: Authenticator, validator: UploadValidator
    ) -> None:
        self.manager = manager
        self.store: ProgramStore = manager.store
        self.authenticator = authenticator
        self.validator = validator
        # Uploads receiving at once: each holds up to one message (a chunk) in memory; more wait.
        self._upload_slots = asyncio.Semaphore(MAX_CONCURRENT_UPLOADS)

    def _user(self, context: grpc.aio.ServicerContext) -> User:
        return self.authenticator.authenticate(bearer_token(context.invocation_metadata()))

    async def UploadProgram(self, request_iterator, context):  # noqa: N802 - gRPC method names
        async with _errors_to_status(context), self._upload_slots:
            user = self._user(context)
            upload = self.store.begin_upload()
            header = spawner_pb2.ProgramHeader()
            try:
                async for request in request_iterator:
                    if request.HasField("header"):
                        header = request.header
                    else:
                        upload.write(request.chunk)
            except BaseException:
                upload.abort()
                raise
            tags = (header.tag,) if header.tag else ()
            try:
                self.manager.check_tags(tags, user)
            except BaseException:
                upload.abort()
                raise
            # Validated in a bounded child process: this call waits, every other call is served.
            result = await self.store.finish_upload_with(self.validator.validate, upload, header.sha256, tags)
            self.manager.record_upload(result.program.sha256, user)
            return spawner_pb2.UploadProgramResponse(
                sha256=result.program.sha256,
                size_bytes=result.program.size_bytes,
                already_present=result.already_present,
            )

    async def ListPrograms(self, request, context):  # noqa: N802
        async with _errors_to_status(context):
            programs = [
                spawner_pb2.ProgramInfo(sha256=p.sha256, size_bytes=p.size_bytes, tags=p.tags)
                for p in self.manager.programs_of(self._user(context))
            ]
            return spawner_pb2.ListProgramsResponse(programs=programs)

    async def Launch(self, request, context):  # noqa: N802
        async with _errors_to_status(context):
            launch = self.manager.launch(
                request.program,
                tuple(request.args),
                limits_from_pb(request.limits),
                request.limits.max_tokens,
                traceparent=_traceparent(context),
                max_children=request.limits.max_children,
                user=self._user(context),
                detached=request.detached,
                model=request.model,
                share_process=request.share_process,
            )
            # Shielded: a caller that goes away mid-launch leaves a listed instance, not a half one.
            instance = await asyncio.shield(asyncio.ensure_future(launch))
            return spawner_pb2.LaunchResponse(instance_id=instance.instance_id)

    async def Attach(self, request, context):  # noqa: N802
        async with _errors_to_status(context):
            instance = self.manager.get(request.instance_id, self._user(context))
        with self.manager.attached(instance):
            if not request.batch_events:
                async for event in instance.supervisor.subscribe():
                    yield event_to_pb(event)
                return
            # Every event ready at once in one response (one gRPC message per burst, not per event).
            async for events in instance.supervisor.subscribe_batches():
                for chunk in _attach_chunks([event_to_pb(event) for event in events]):
                    yield chunk[0] if len(chunk) == 1 else spawner_pb2.AttachResponse(events=chunk)

    async def SendMessage(self, request, context):  # noqa: N802
        async with _errors_to_status(context):
            self.manager.send_to_instance(request.instance_id, request.text, self._user(context))
            return spawner_pb2.SendMessageResponse()

    async def Terminate(self, request, context):  # noqa: N802
        async with _errors_to_status(context):
            await self.manager.terminate(request.instance_id, user=self._user(context))
            return spawner_pb2.TerminateResponse()

    async def ListInstances(self, request, context):  # noqa: N802
        async with _errors_to_status(context):
            instances = self.manager.list_instances(self._user(context))
            return spawner_pb2.ListInstancesResponse(instances=[instance_to_pb(i) for i in instances])


# -- RuntimeService -----------------------------------------------------------------------------


class RuntimeServicer(spawner_pb2_grpc.RuntimeServiceServicer):
    def __init__(self, manager: InstanceManager) -> None:
        self.manager = manager

    async def _caller(self, context: grpc.aio.ServicerContext) -> Instance:
        token = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY, "")
        try:
            return self.manager.by_token(token)
        except InstanceNotFound:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or unknown {TOKEN_METADATA_KEY}")
            raise

    async def SendToUser(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        if not await instance.supervisor.publish_message(request.text):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the instance's output limit is used up")
        return spawner_pb2.SendToUserResponse()

    async def ReceiveFromUser(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        text = await self.manager.receive_from_user(instance, _timeout_s(request.timeout_ms))
        return spawner_pb2.ReceiveFromUserResponse(received=text is not None, text=text or "")

    async def GetVariable(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        async with _errors_to_status(context):
            snap = instance.tree.variables.get(request.name)
            return spawner_pb2.GetVariableResponse(exists=snap.exists, value=snap.value, version=snap.version)

    async def SetVariable(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        async with _errors_to_status(context):
            snap = await instance.tree.variables.set(request.name, request.value)
            return spawner_pb2.SetVariableResponse(version=snap.version)

    async def CompareAndSetVariable(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        async with _errors_to_status(context):
            result = await instance.tree.variables.compare_and_set(
                request.name, request.expected_version, request.value
            )
            return spawner_pb2.CompareAndSetVariableResponse(
                swapped=result.swapped, version=result.snapshot.version, value=result.snapshot.value
            )

    async def AppendVariable(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        async with _errors_to_status(context):
            snap = await instance.tree.variables.append(request.name, request.value)
            return spawner_pb2.AppendVariableResponse(version=snap.version)

    async def WatchVariable(self, request, context):  # noqa: N802
        instance = await self._caller(context)
        async for snap in instance.tree.variables.watch(request.name):
            yield spawner_pb2.WatchVariableResponse(
                exists=snap.exists, value=snap.value, version=snap.version
            )

    async def SpawnChild(self, request, context):  # noqa: N802
        parent = await self._caller(context)
        async with _errors_to_status(context):
            limits = limits_from_pb(request.limits) if request.HasField("limits") else None
            spawn = self.manager.spawn_child(
                parent,
                request.program,
                tuple(request.args),
                limits,
                _traceparent(context),
                max_tokens=request.limits.max_tokens,
            )
            child = await asyncio.shield(asyncio.ensure_future(spawn))
            return spawner_pb2.SpawnChildResponse(instance_id=child.instance_id)

    async def WaitChild(self, request, context):  # noqa: N802
        parent = await self._caller(context)
        async with _errors_to_status(context):
            info = await self.manager.wait_child(parent, request.instance_id, _timeout_s(request.timeout_ms))
            if info is None:
                return spawner_pb2.WaitChildResponse(exited=False)
            return spawner_pb2.WaitChildResponse(exited=True, exit=exit_to_pb(info))


# -- assembly -----------------------------------------------------------------------------------


def make_sandbox(config: SpawnerConfig) -> Sandbox:
    if config.sandbox_kind == "process":
        from l4m.spawner.process_command import SDK_WARM_MODULES, ProcessSandboxConfig
        from l4m.spawner.process_sandbox import ProcessSandbox

        # Warm sandboxes start under the spawner's maximum limits (a launch over them is refused) and
        # the /tmp size every launch gets; the runner is imported first.
        tmp_bytes = min(config.default_limits.tmp_bytes, config.max_limits.tmp_bytes)
        runner = (config.controller_runner,) if config.controller_runner else ()
        return ProcessSandbox(
            ProcessSandboxConfig(
                spawner_id=config.spawner_id,
                warm_pool_size=config.warm_pool_size,
                warm_pool_quiet_wait_s=config.warm_pool_quiet_wait_s,
                warm_max_limits=dataclasses.replace(config.max_limits, tmp_bytes=tmp_bytes),
                warm_socket_dir=config.socket_dir,
                warm_modules=tuple(dict.fromkeys((*runner, *SDK_WARM_MODULES))),
                warm_dir=config.state_dir / "warm",
                cpu_policy=config.controller_cpu_policy,
            )
        )
    if config.sandbox_kind == "docker":
        import docker
        from l4m.spawner.docker_image import ensure_controller_image
        from l4m.spawner.docker_sandbox import DockerSandbox, DockerSandboxConfig

        image = config.docker_image or ensure_controller_image(docker.from_env())
        return DockerSandbox(
            DockerSandboxConfig(image=image, spawner_id=config.spawner_id, cpu_policy=config.controller_cpu_policy)
        )
    raise ValueError(f"unknown sandbox kind {config.sandbox_kind!r} (expected process or docker)")


@dataclass
class SpawnerServer:
    """The user-facing server, the runtime server on the Unix socket, and the core behind both."""

    config: SpawnerConfig
    public: GrpcServer  # SpawnerService, health and reflection on `config.listen_address`
    runtime: GrpcServer  # RuntimeService (and the span forwarder) on the runtime socket
    manager: InstanceManager
    registry: InstanceRegistry
    span_forwarder: SpanForwarder | None = None
    framed_runtime: FramedRuntimeServer | None = None  # user messages as frames, beside the runtime socket
    _trap_watch: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        """The bound TCP port of `public`."""
        return self.public.port

    @property
    def runtime_socket(self) -> str:
        return str(self.config.socket_dir / self.config.runtime_socket_name)

    async def start(self) -> None:
        await self.runtime.start()
        # The sandbox uid must reach the runtime socket: it is writable by anyone, which is safe
        # because every call must carry an instance token. gRPC creates the file only at start.
        os.chmod(self.runtime_socket, 0o666)
        if self.framed_runtime is not None:
            await self.framed_runtime.start()  # mode 0666 too: its first frame must carry an instance token
        await self.public.start()
        if isinstance(self.registry, GrpcInstanceRegistry):
            self._trap_watch = asyncio.create_task(self.registry.forward_traps(self.manager))
        # After cleanup_orphans (create_server), which would count warm sandboxes as orphans.
        await self.manager.sandbox.open()
        await self.public.set_health(health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking launches, ends every instance (destroying it in the scheduler), closes all."""
        if self.public.health is not None:
            await self.public.health.enter_graceful_shutdown()
        await self.public.stop(grace_s)
        await self.manager.shutdown()
        await self.manager.sandbox.close()
        if self._trap_watch is not None:
            self._trap_watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._trap_watch
        if self.framed_runtime is not None:
            await self.framed_runtime.stop()
        await self.runtime.stop(grace_s)
        if self.span_forwarder is not None:
            await self.span_forwarder.close()
        close = getattr(self.registry, "close", None)
        if close is not None:
            await close()

    async def wait_for_termination(self) -> None:
        await self.public.server.wait_for_termination()


_SPAWNER_SERVICE = spawner_pb2.DESCRIPTOR.services_by_name["SpawnerService"].full_name


async def create_server(
    config: SpawnerConfig,
    sandbox: Sandbox | None = None,
    registry: InstanceRegistry | None = None,
    metrics: SpawnerMetrics | None = None,
) -> SpawnerServer:
    """Builds (does not start) both servers around a new core; the TCP port is bound already."""
    sandbox = sandbox or make_sandbox(config)
    await sandbox.cleanup_orphans()
    authenticator = make_authenticator(config)
    tls = tls_files(config.tls_cert, config.tls_key)
    if registry is None:
        registry = make_registry(config)
    store = ProgramStore(config.state_dir / "store", config.max_program_bytes)
    metrics = metrics or SpawnerMetrics(sandbox.kind)
    warm_pool_stats = getattr(sandbox, "warm_pool_stats", None)  # the process backend's pool
    metrics.bind_warm_pool(warm_pool_stats if warm_pool_stats is not None else lambda: None)
    manager = InstanceManager(config, store, sandbox, registry, metrics)

    validator = UploadValidator(
        ValidatorLimits(
            config.upload_validation_memory_bytes,
            config.upload_validation_timeout_s,
            config.max_concurrent_upload_validations,
        )
    )
    servicer = SpawnerServicer(manager, authenticator, validator)
    public = build_server(
        [(spawner_pb2_grpc.add_SpawnerServiceServicer_to_server, servicer)],
        [(config.listen_address, tls)],
        health_names=(_SPAWNER_SERVICE,),
    )

    runtime_services: list[Service] = [(spawner_pb2_grpc.add_RuntimeServiceServicer_to_server, RuntimeServicer(manager))]
    forwarder = None
    if config.controller_spans_endpoint:
        forwarder = SpanForwarder(
            config.controller_spans_endpoint,
            lambda token: _instance_id_of_token(manager, token),
            config.controller_spans_headers,
            lambda token: _process_id_of_token(manager, token),
        )
        runtime_services.append((trace_service_pb2_grpc.add_TraceServiceServicer_to_server, forwarder))
    config.socket_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(config.socket_dir, 0o755)
    runtime_socket = config.socket_dir / config.runtime_socket_name
    runtime_socket.unlink(missing_ok=True)
    runtime = build_server(runtime_services, [(f"unix://{runtime_socket}", None)], reflection=False)
    framed_runtime = None
    if config.runtime_framed_socket_name:
        framed_runtime = FramedRuntimeServer(manager, str(config.socket_dir / config.runtime_framed_socket_name))
    return SpawnerServer(config, public, runtime, manager, registry, forwarder, framed_runtime)


class ConfigError(ValueError):
    """A combination of settings the spawner refuses to start with; the message says which."""


def is_loopback_address(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def make_authenticator(config: SpawnerConfig) -> Authenticator:
    """Refuses a spawner that would let anyone in: it needs a keys file, or `insecure_local` on a
    loopback address."""
    if config.api_keys_file is None and not config.insecure_local:
        raise ConfigError("the spawner needs --api-keys-file (see `l4m keys add`) or --insecure-local")
    if config.insecure_local and not is_loopback_address(config.listen_address):
        raise ConfigError(
            f"--insecure-local lets callers in without a key, so it needs a loopback --listen address, "
            f"not {config.listen_address}"
        )
    return Authenticator(config.api_keys_file, config.insecure_local)


def make_registry(config: SpawnerConfig) -> InstanceRegistry:
    if not config.scheduler_registry_address:
        return NoScheduler()
    secret = read_secret_file(config.cluster_secret_file) if config.cluster_secret_file else ""
    return GrpcInstanceRegistry(config.scheduler_registry_address, secret, config.scheduler_tls_ca)


def _instance_id_of_token(manager: InstanceManager, token: str) -> str | None:
    try:
        return manager.by_token(token).instance_id
    except InstanceNotFound:
        return None


def _process_id_of_token(manager: InstanceManager, token: str) -> str | None:
    process = manager.shared.by_token(token)
    return process.process_id if process is not None else None
