"""Instances: launch from the program store, register with the scheduler, supervise, report, forget.

`InstanceManager` is the spawner's core; `server.py` is a thin gRPC layer over it. Every instance
belongs to a launch tree (a user's launch and the children it spawns): the tree shares one
`VariableStore` and one child budget. An instance is registered with the scheduler (its token and
token budget) before its sandbox starts, and destroyed there when it ends, whatever the reason, so
the scheduler frees every page it held. Every instance has an owner (`User`, the launching user; a
child's is its parent's): lookups on a user's behalf see only its own instances and programs (an admin
all), and a user's instances alive at once, the sum of their memory limits and the sum of their wall
time limits are capped (`QuotaExceeded`). Limits over the spawner's maxima are refused
(`LimitTooHigh`), never clamped. An exited instance keeps a bounded summary (its exit, counts and the
tail of its output, see supervisor.py); its tree's variables go when the tree's last instance exits,
and only the newest `max_exited_instances` exits are kept. An instance that is not
detached is terminated when its last Attach stream ends or when nobody attaches within
`unattached_grace_s` of its launch. The core never imports grpc: the scheduler is reached
through the small `InstanceRegistry` interface.

Controllers run through the SDK's runner (`python -m l4m.controller PROGRAM ARGS`, the
`controller_runner` of the config). The runner exits with `RUNNER_EXIT_TRAPPED` when the scheduler
trapped the session; such an exit is reported as TRAPPED even when it beats the scheduler's own trap
event to the spawner.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import Span

from l4m.common.users import ADMIN, User
from l4m.spawner import tracing
from l4m.spawner.config import MiB, SpawnerConfig
from l4m.spawner.metrics import SpawnerMetrics
from l4m.spawner.programs import ProgramInfo, ProgramNotFound, ProgramStore, normalize_tag
from l4m.spawner.sandbox import (
    SANDBOX_SOCKET_DIR,
    ExitInfo,
    ExitReason,
    Limits,
    Sandbox,
    SandboxError,
    SandboxSpec,
)
from l4m.spawner.shared import PROCESS_TOKEN_ENV, SharedProcesses, ShareKey
from l4m.spawner.supervisor import ITEM_OVERHEAD_BYTES, InstanceState, InstanceSupervisor
from l4m.spawner.users import ProgramOwners
from l4m.spawner.variables import VariableStore

log = logging.getLogger(__name__)

# The SDK runner's (l4m.controller) status and stderr line for a trapped session.
RUNNER_EXIT_TRAPPED = 3
RUNNER_TRAP_MARKER = "l4m.controller: trapped:"
CONTROLLER_SERVICE_NAME = "l4m.controller"
# A trapped runner exits by itself at once (status 3), flushing its spans on the way; it is killed
# only if it is still running after this long.
TRAP_GRACE_S = 1.0
CLIENT_GONE_MESSAGE = "its client went away"


class InstanceError(Exception):
    """Base class of the manager's errors; server.py maps each subclass to one gRPC status."""


class InstanceNotFound(InstanceError):
    pass


class LaunchFailed(InstanceError):
    pass


class TooManyInstances(InstanceError):
    pass


class TooManyChildren(InstanceError):
    pass


class TagTaken(InstanceError):
    """An upload would move a tag that names another user's program."""


class QuotaExceeded(InstanceError):
    """A user's own quota (not the spawner's capacity) refuses the launch; the message names it."""


class LimitTooHigh(InstanceError):
    """A launch asked for a limit over the spawner's maximum; the message names the field, the value
    asked for and the maximum."""


class ArgsTooLarge(InstanceError):
    """A launch's arguments are larger than the spawner keeps per instance."""


class InvalidModelName(InstanceError):
    """A launch names its model with something that cannot be a model name."""


MAX_MODEL_NAME_BYTES = 256


def check_model_name(model: str) -> None:
    """A model name goes into the controller's environment (L4M_MODEL): bounded, printable, one line."""
    if len(model.encode()) > MAX_MODEL_NAME_BYTES:
        raise InvalidModelName(f"the model name is {len(model.encode())} bytes; at most {MAX_MODEL_NAME_BYTES}")
    if not model.isprintable():
        raise InvalidModelName(f"the model name {model[:40]!r} has non-printable characters")


class InboxFull(InstanceError):
    """Messages to an instance wait unread past its inbox limit."""


class SchedulerUnavailable(InstanceError):
    """The scheduler could not be reached to register an instance (nothing was started)."""


class RegistrationRefused(InstanceError):
    """The scheduler answered, but would not register the instance."""


class InstanceRegistry(Protocol):
    """The scheduler's side of an instance's life (see protos/l4m/v1/registry.proto)."""

    async def register(
        self,
        instance_id: str,
        token: str,
        max_tokens: int,
        launched_at_unix_ms: int,
        *,
        user: str = "",
        is_admin: bool = False,
        parent_instance_id: str = "",
        user_max_tokens_per_minute: int = 0,
    ) -> None: ...

    async def destroy(self, instance_id: str, reason: str) -> None: ...


class NoScheduler:
    """For a spawner run without a scheduler (tests of the sandbox layer, local development)."""

    async def register(
        self,
        instance_id: str,
        token: str,
        max_tokens: int,
        launched_at_unix_ms: int,
        *,
        user: str = "",
        is_admin: bool = False,
        parent_instance_id: str = "",
        user_max_tokens_per_minute: int = 0,
    ) -> None:
        return None

    async def destroy(self, instance_id: str, reason: str) -> None:
        return None


@dataclass
class LaunchTree:
    tree_id: str
    max_children: int
    variables: VariableStore = field(default_factory=VariableStore)
    num_children: int = 0
    num_alive: int = 0  # started and not exited; the variables are dropped when it falls to 0


@dataclass
class Instance:
    instance_id: str
    program_sha256: str
    args: tuple[str, ...]
    token: str
    tree: LaunchTree
    supervisor: InstanceSupervisor
    max_tokens: int
    launched_at_unix_ms: int
    owner: User = ADMIN  # the launching user; a child's is its parent's
    detached: bool = False  # runs on when no client is attached
    parent_id: str = ""
    model: str = ""  # the model its session serves (L4M_MODEL); "" = the scheduler's default
    num_attached: int = 0  # Attach streams open now
    was_attached: bool = False
    child_ids: list[str] = field(default_factory=list)
    inbox: asyncio.Queue[str] = field(default_factory=asyncio.Queue)
    inbox_bytes: int = 0  # charged for the messages in `inbox` (each its bytes + ITEM_OVERHEAD_BYTES)
    trap_message: str | None = None  # set when the scheduler reported a trap
    span: Span | None = None  # spawner.instance, ended at the exit
    shared_process: str = ""  # the shared process it runs in (LaunchRequest.share_process); "" = its own

    @property
    def state(self) -> InstanceState:
        return self.supervisor.state

    @property
    def exit_info(self) -> ExitInfo | None:
        return self.supervisor.exit_info


def check_limits(requested: Limits, maximum: Limits) -> None:
    """Raises LimitTooHigh naming the first field of `requested` over `maximum` (0 asks for nothing)."""
    for name in Limits.__dataclass_fields__:
        value, cap = getattr(requested, name), getattr(maximum, name)
        if value > cap:
            value_text, cap_text = _number(value), _number(cap)
            raise LimitTooHigh(
                f"the requested limit {name} = {value_text} is over the spawner's maximum of {cap_text}; "
                f"ask for at most {cap_text} (0 takes the default)"
            )


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def resolve_limits(requested: Limits | None, default: Limits, maximum: Limits) -> Limits:
    """Fields of `requested` that are 0 take the default; a field over the maximum is refused
    (LimitTooHigh), never clamped."""
    if requested is None:
        return default
    check_limits(requested, maximum)
    values = {name: getattr(requested, name) or getattr(default, name) for name in Limits.__dataclass_fields__}
    return Limits(**values)


def child_limits(requested: Limits | None, parent: Limits, maximum: Limits) -> Limits:
    """A child's limits: 0 fields inherit the parent's, and a child gets at most its parent's (a
    larger request is capped there, as documented for `ctx.spawn`); a field over the spawner's
    maximum is refused like a launch's."""
    if requested is None:
        return parent
    check_limits(requested, maximum)
    values = {
        name: min(getattr(requested, name) or getattr(parent, name), getattr(parent, name))
        for name in Limits.__dataclass_fields__
    }
    return Limits(**values)


def child_token_budget(requested: int, parent_budget: int) -> int:
    """The smaller of the two budgets, where 0 means unlimited."""
    if not requested or not parent_budget:
        return requested or parent_budget
    return min(requested, parent_budget)


class InstanceManager:
    def __init__(
        self,
        config: SpawnerConfig,
        store: ProgramStore,
        sandbox: Sandbox,
        registry: InstanceRegistry,
        metrics: SpawnerMetrics | None = None,
        owners: ProgramOwners | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.owners = owners or ProgramOwners(config.state_dir / "program-owners.json")
        self.sandbox = sandbox
        self.registry = registry
        self.metrics = metrics or SpawnerMetrics(sandbox.kind)
        self._instances: dict[str, Instance] = {}
        self._by_token: dict[str, Instance] = {}
        self._exited_ids: collections.deque[str] = collections.deque()
        self._starting: dict[str, list[Limits]] = collections.defaultdict(list)  # user -> launches under way
        self._grace_tasks: set[asyncio.Task[None]] = set()
        self.shared = SharedProcesses(sandbox, config.max_instances_per_process, self._shared_process_env,
                                      config.controller_runner)

    # -- launching -------------------------------------------------------------------------------

    async def launch(
        self,
        program_ref: str,
        args: tuple[str, ...] = (),
        limits: Limits | None = None,
        max_tokens: int = 0,
        *,
        traceparent: str = "",
        max_children: int = 0,
        parent: Instance | None = None,
        user: User = ADMIN,
        detached: bool = False,
        model: str = "",
        share_process: bool = False,
    ) -> Instance:
        """Resolves the program, registers the instance with the scheduler and starts its sandbox.

        Everything is undone when a step fails: no registration or sandbox outlives a failed launch.
        `traceparent` is the caller's W3C trace context; `max_children` caps the tree this launch
        roots (0: the spawner's maximum). `user` owns the instance (a child: its parent's user); a
        launch that is not `detached` ends when its clients go away (see `attached`). `model` names the
        model the controller's session serves ("": the scheduler's default; a child: its parent's).
        `share_process` lets it run in a shared process (`shared.py`) where the spawner can: never a child,
        nor with --max-instances-per-process 1, nor without the framed runtime socket or the SDK's runner."""
        if parent is not None:
            user, model = parent.owner, parent.model
        check_model_name(model)
        num_args_bytes = sum(len(arg.encode()) for arg in args)
        if num_args_bytes > self.config.max_args_bytes:
            # Kept with the instance, exited ones too: bounded like the rest of its summary.
            raise ArgsTooLarge(
                f"the arguments are {num_args_bytes} bytes; at most {self.config.max_args_bytes} are allowed"
            )
        program = self.resolve_program(program_ref, user)
        resolved = resolve_limits(limits, self.config.default_limits, self.config.max_limits)
        self._check_capacity(user, resolved)
        instance_id = f"i-{uuid.uuid4().hex[:16]}"
        attributes = {
            "l4m.instance_id": instance_id,
            "l4m.program_sha256": program.sha256,
            "l4m.sandbox": self.sandbox.kind,
        }
        if parent is not None:
            attributes["l4m.parent_instance_id"] = parent.instance_id
        started_at = time.monotonic()
        launch_span = tracing.start_launch_span(traceparent, attributes)
        self._starting[user.name].append(resolved)
        self.metrics.launch_started()
        try:
            with trace.use_span(launch_span, end_on_exit=True):
                if parent is not None:
                    tree = parent.tree
                else:
                    cap = self.config.max_children_per_tree
                    tree = LaunchTree(
                        instance_id,
                        min(max_children, cap) if max_children else cap,
                        VariableStore(self.config.max_variable_bytes_per_tree),
                    )
                share_key = None
                if share_process and parent is None and self.may_share():
                    share_key = ShareKey(user.name, program.sha256, model, resolved)
                instance = self._new_instance(
                    instance_id,
                    program.sha256,
                    program.path,
                    args,
                    resolved,
                    max_tokens or self.config.default_max_tokens,
                    tree,
                    tracing.traceparent_for_controller(launch_span, traceparent),
                    model,
                    share_key,
                )
                instance.owner, instance.detached, instance.model = user, detached, model
                if parent is not None:
                    instance.parent_id = parent.instance_id
                instance.span = tracing.start_instance_span(launch_span, attributes)
                await self._register_and_start(instance)
                if share_key is not None:
                    instance.shared_process = instance.supervisor.sandbox.process_id  # type: ignore[attr-defined]
        except BaseException as exc:
            self.metrics.launch_failed(type(exc).__name__)
            raise
        finally:
            self._starting[user.name].remove(resolved)
            if not self._starting[user.name]:
                del self._starting[user.name]
        self.metrics.launch_succeeded(time.monotonic() - started_at, instance.supervisor.is_warm)
        if parent is not None:
            parent.child_ids.append(instance_id)
        self._instances[instance_id] = instance
        self._by_token[instance.token] = instance
        instance.tree.num_alive += 1
        instance.supervisor.add_exit_callback(lambda info: self._on_exit(instance, info))
        if parent is None and not detached:
            self._end_if_never_attached(instance)
        return instance

    def resolve_program(self, program_ref: str, user: User) -> ProgramInfo:
        """The program `program_ref` names, if `user` uploaded it (an admin: any); another user's
        program is not found, exactly like an unknown one."""
        program = self.store.resolve(program_ref)
        if not self.owners.may_use(program.sha256, user):
            ref = program_ref.strip()
            if ref.lower() == program.sha256:  # the store's own words for an unknown digest or tag
                raise ProgramNotFound(f"no program with sha256 {ref.lower()!r}")
            raise ProgramNotFound(f"no program is tagged {normalize_tag(ref)!r}")
        return program

    def check_tags(self, tags: tuple[str, ...], user: User) -> None:
        """Tags are one namespace: a user may not move a tag that points at a program it cannot use."""
        current = self.store.tags()
        for tag in tags:
            sha256 = current.get(normalize_tag(tag))
            if sha256 is not None and not self.owners.may_use(sha256, user):
                raise TagTaken(f"the tag {normalize_tag(tag)!r} names another user's program; choose another")

    def record_upload(self, sha256: str, user: User) -> None:
        self.owners.add(sha256, user.name)

    def programs_of(self, user: User) -> list[ProgramInfo]:
        return [p for p in self.store.list_programs() if self.owners.may_use(p.sha256, user)]

    def _check_capacity(self, user: User, limits: Limits) -> None:
        """The spawner's own capacity, then the user's quotas over its instances alive or starting:
        their number, the sum of their memory limits and the sum of their wall time limits."""
        alive = [i for i in self._instances.values() if i.state is not InstanceState.EXITED]
        num_starting = sum(len(launches) for launches in self._starting.values())
        if num_starting + len(alive) >= self.config.max_instances:
            raise TooManyInstances(f"the spawner already runs {self.config.max_instances} instances")
        own = [i.supervisor.spec.limits for i in alive if i.owner.name == user.name]
        own += self._starting.get(user.name, [])
        quota = user.max_instances or self.config.max_instances_per_user
        if len(own) >= quota:
            raise QuotaExceeded(
                f"user {user.name!r} already runs {len(own)} instances, its quota of instances alive at once "
                f"(max instances per user: {quota})"
            )
        memory = sum(other.memory_bytes for other in own)
        if memory + limits.memory_bytes > self.config.max_memory_bytes_per_user:
            raise QuotaExceeded(
                f"user {user.name!r}'s live instances hold {memory // MiB} MiB of memory limits; "
                f"{limits.memory_bytes // MiB} MiB more would pass its quota "
                f"(max memory per user: {self.config.max_memory_bytes_per_user // MiB} MiB)"
            )
        wall_time_s = sum(other.wall_time_s for other in own)
        if wall_time_s + limits.wall_time_s > self.config.max_wall_time_s_per_user:
            raise QuotaExceeded(
                f"user {user.name!r}'s live instances hold {wall_time_s:g} s of wall time limits; "
                f"{limits.wall_time_s:g} s more would pass its quota "
                f"(max wall time per user: {self.config.max_wall_time_s_per_user:g} s)"
            )

    def _new_instance(
        self,
        instance_id: str,
        program_sha256: str,
        program_path: Path,
        args: tuple[str, ...],
        limits: Limits,
        max_tokens: int,
        tree: LaunchTree,
        traceparent: str,
        model: str = "",
        share_key: ShareKey | None = None,
    ) -> Instance:
        token = secrets.token_urlsafe(24)
        env = self._sandbox_env(instance_id, token, traceparent, model)
        spec = SandboxSpec(
            instance_id,
            program_path,
            tuple(args),
            env,
            self.config.socket_dir,
            limits,
            runner_module=self.config.controller_runner,
        )
        instance: Instance | None = None
        supervisor = InstanceSupervisor(
            self.sandbox if share_key is None else self.shared.sandbox_for(share_key),
            spec,
            refine_exit=lambda info: self._refine_exit(instance, info),
            count_output_bytes=self.metrics.count_output_bytes,
        )
        launched_at_unix_ms = int(time.time() * 1000)
        instance = Instance(
            instance_id, program_sha256, tuple(args), token, tree, supervisor, max_tokens, launched_at_unix_ms
        )
        return instance

    async def _register_and_start(self, instance: Instance) -> None:
        """Registers the instance with the scheduler, then starts its sandbox; undoes the first when
        the second fails."""
        self._open_scheduler_socket()
        is_registered = False
        try:
            owner = instance.owner
            await self.registry.register(
                instance.instance_id,
                instance.token,
                instance.max_tokens,
                instance.launched_at_unix_ms,
                user=owner.name,
                is_admin=owner.is_admin,
                parent_instance_id=instance.parent_id,
                user_max_tokens_per_minute=(
                    owner.max_tokens_per_minute or self.config.max_tokens_per_minute_per_user
                ),
            )
            is_registered = True
            await instance.supervisor.start()
        except BaseException as exc:
            if is_registered:
                with contextlib.suppress(Exception):
                    await self.registry.destroy(instance.instance_id, f"launch failed: {exc}")
            if instance.span is not None:
                tracing.end_instance_span(instance.span, ExitInfo(ExitReason.LAUNCH_FAILED, str(exc)))
            if isinstance(exc, SandboxError):
                raise LaunchFailed(str(exc)) from exc
            raise

    def _open_scheduler_socket(self) -> None:
        """Lets sandbox uids connect to the scheduler's socket in the shared directory.

        A server creates its Unix socket with its umask (typically 0755) and connecting needs write
        permission, so without this only root could reach the scheduler. Safe for the same reason
        as the runtime socket: every session must present a registered instance token. Checked per
        launch because the scheduler may have (re)created its socket since the last one."""
        path = self.config.socket_dir / self.config.scheduler_socket_name
        with contextlib.suppress(OSError):
            if path.stat().st_mode & 0o777 != 0o666:
                os.chmod(path, 0o666)

    def _scheduler_address(self) -> str:
        """Where a controller reaches the scheduler: its framed-session socket when there is one."""
        if self.config.scheduler_framed_socket_name:
            return f"framed://{SANDBOX_SOCKET_DIR}/{self.config.scheduler_framed_socket_name}"
        return f"unix://{SANDBOX_SOCKET_DIR}/{self.config.scheduler_socket_name}"

    def _sandbox_env(self, instance_id: str, token: str, traceparent: str, model: str = "") -> dict[str, str]:
        env = {
            "L4M_INSTANCE_ID": instance_id,
            "L4M_INSTANCE_TOKEN": token,
            "L4M_SCHEDULER_ADDR": self._scheduler_address(),
            "L4M_RUNTIME_ADDR": f"unix://{SANDBOX_SOCKET_DIR}/{self.config.runtime_socket_name}",
        }
        if model:
            env["L4M_MODEL"] = model
        if self.config.runtime_framed_socket_name:
            env["L4M_RUNTIME_FRAMED_ADDR"] = f"framed://{SANDBOX_SOCKET_DIR}/{self.config.runtime_framed_socket_name}"
        if traceparent:
            env["TRACEPARENT"] = traceparent
        if self.config.controller_spans_endpoint:
            # The sandbox has no network: its spans go to the runtime socket, which forwards them
            # to the spawner's own OTLP endpoint after checking the token sent as a header.
            env.update(
                {
                    "OTEL_TRACES_EXPORTER": "otlp",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": env["L4M_RUNTIME_ADDR"],
                    "OTEL_EXPORTER_OTLP_HEADERS": f"l4m-instance-token={token}",
                    "OTEL_SERVICE_NAME": CONTROLLER_SERVICE_NAME,
                }
            )
        return env

    def may_share(self) -> bool:
        """Whether launches may share processes here: the operator allows it (--max-instances-per-process over
        1), and a process can hear of its instances (the framed runtime socket) and run them (the SDK's runner)."""
        return (self.config.max_instances_per_process > 1 and bool(self.config.runtime_framed_socket_name)
                and bool(self.config.controller_runner))

    def _shared_process_env(self, process_token: str, key: ShareKey) -> dict[str, str]:
        """A shared process's environment: an instance's, less what each instance brings (id, token, trace
        context), plus its process token, which also authenticates its spans (span_forwarder.py)."""
        env = self._sandbox_env("", process_token, "", key.model)
        for name in ("L4M_INSTANCE_ID", "L4M_INSTANCE_TOKEN"):
            env.pop(name, None)
        env[PROCESS_TOKEN_ENV] = process_token
        return env

    def _refine_exit(self, instance: Instance | None, info: ExitInfo) -> ExitInfo:
        """A runner that exited because its session was trapped reports TRAPPED, with the reason."""
        is_runner_trap = (
            self.config.controller_runner
            and info.reason is ExitReason.CRASHED
            and info.exit_code == RUNNER_EXIT_TRAPPED
            and RUNNER_TRAP_MARKER in info.message
        )
        if not is_runner_trap:
            return info
        reason = info.message.split(RUNNER_TRAP_MARKER, 1)[1].strip()
        if instance is not None and instance.trap_message is not None:
            reason = instance.trap_message
        return dataclasses.replace(info, reason=ExitReason.TRAPPED, message=reason, enforced_by="scheduler")

    async def _on_exit(self, instance: Instance, info: ExitInfo) -> None:
        self._by_token.pop(instance.token, None)
        # What nobody can read any more goes now; the summary (exit, tail of output) stays.
        instance.inbox, instance.inbox_bytes = asyncio.Queue(), 0
        instance.tree.num_alive -= 1
        if not instance.tree.num_alive:
            instance.tree.variables.clear()
        self.metrics.instance_exited(info.reason.value)
        if instance.span is not None:
            tracing.end_instance_span(instance.span, info)
        for child_id in instance.child_ids:
            child = self._instances.get(child_id)
            if child is not None and child.state is InstanceState.RUNNING:
                asyncio.ensure_future(
                    child.supervisor.terminate(
                        ExitReason.PARENT_EXITED, f"its parent {instance.instance_id} ended"
                    )
                )
        # The scheduler frees the instance's pages and slots; a failure to reach it must not hide
        # the exit from the user (the scheduler also traps sessions whose instance it cannot see).
        try:
            await self.registry.destroy(instance.instance_id, f"{info.reason.value}: {info.message}")
        except Exception as exc:  # noqa: BLE001 - logged; the exit report must go on
            log.warning("could not destroy %s in the scheduler: %s", instance.instance_id, exc)
        self._forget_old_exits(instance.instance_id)

    def _forget_old_exits(self, instance_id: str) -> None:
        """Keeps the last `max_exited_instances` exits listable; older ones are forgotten."""
        self._exited_ids.append(instance_id)
        while len(self._exited_ids) > self.config.max_exited_instances:
            self._instances.pop(self._exited_ids.popleft(), None)

    # -- lookups and control ---------------------------------------------------------------------

    def get(self, instance_id: str, user: User = ADMIN) -> Instance:
        """The instance, if `user` may see it: another user's instance is not found, exactly like an
        unknown id, so that ids do not reveal what others run."""
        instance = self._instances.get(instance_id)
        if instance is None or not user.can_see(instance.owner.name):
            raise InstanceNotFound(f"no instance {instance_id!r}")
        return instance

    def by_token(self, token: str) -> Instance:
        """The running instance that holds `token` (the runtime's authentication)."""
        instance = self._by_token.get(token)
        if instance is None:
            raise InstanceNotFound("no running instance holds this token")
        return instance

    def list_instances(self, user: User = ADMIN) -> list[Instance]:
        visible = (i for i in self._instances.values() if user.can_see(i.owner.name))
        return sorted(visible, key=lambda i: i.launched_at_unix_ms)

    async def terminate(
        self,
        instance_id: str,
        reason: ExitReason = ExitReason.TERMINATED,
        message: str = "",
        user: User = ADMIN,
    ) -> ExitInfo:
        instance = self.get(instance_id, user)
        return await instance.supervisor.terminate(reason, message or f"{reason.value} on request")

    # -- clients coming and going ----------------------------------------------------------------

    @contextlib.contextmanager
    def attached(self, instance: Instance) -> Iterator[None]:
        """One client's Attach stream. When the last one ends while a non-detached instance still
        runs (Ctrl-C, a dropped connection), the instance is terminated: nobody is left to read it."""
        instance.num_attached += 1
        instance.was_attached = True
        try:
            yield
        finally:
            instance.num_attached -= 1
            if not instance.num_attached:
                self._end_if_unwatched(instance)

    def _end_if_unwatched(self, instance: Instance) -> None:
        if instance.detached or instance.num_attached or instance.state is not InstanceState.RUNNING:
            return
        task = asyncio.ensure_future(instance.supervisor.terminate(ExitReason.TERMINATED, CLIENT_GONE_MESSAGE))
        self._grace_tasks.add(task)
        task.add_done_callback(self._grace_tasks.discard)

    def _end_if_never_attached(self, instance: Instance) -> None:
        """A launch nobody attaches to within the grace period is ended (its client died between
        Launch and Attach, or never meant to read it: that is what `detached` is for)."""

        async def watch() -> None:
            await asyncio.sleep(self.config.unattached_grace_s)
            if not instance.was_attached:
                self._end_if_unwatched(instance)

        task = asyncio.ensure_future(watch())
        self._grace_tasks.add(task)
        task.add_done_callback(self._grace_tasks.discard)

    async def trap(self, instance_id: str, message: str) -> None:
        """The scheduler trapped the instance: stop its sandbox and report the trap as its exit."""
        instance = self._instances.get(instance_id)
        if instance is None or instance.state is InstanceState.EXITED:
            return  # another spawner's instance, or one already gone
        instance.trap_message = message
        if instance.state is InstanceState.RUNNING:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(instance.supervisor.wait(), TRAP_GRACE_S)
        await instance.supervisor.terminate(ExitReason.TRAPPED, message)

    def send_to_instance(self, instance_id: str, text: str, user: User = ADMIN) -> None:
        """Queues a user's message; the unread ones (each its bytes + ITEM_OVERHEAD_BYTES) are capped at
        `max_inbox_bytes` (InboxFull)."""
        instance = self.get(instance_id, user)
        if instance.state is InstanceState.EXITED:
            raise InstanceNotFound(f"instance {instance_id!r} has exited")
        charge = len(text.encode()) + ITEM_OVERHEAD_BYTES
        if instance.inbox_bytes + charge > self.config.max_inbox_bytes:
            raise InboxFull(
                f"instance {instance_id!r} has {instance.inbox.qsize()} messages unread "
                f"({instance.inbox_bytes} bytes, each counting {ITEM_OVERHEAD_BYTES} more than its text); "
                f"its inbox holds at most {self.config.max_inbox_bytes} bytes"
            )
        instance.inbox_bytes += charge
        instance.inbox.put_nowait(text)

    async def receive_from_user(self, instance: Instance, timeout_s: float | None) -> str | None:
        inbox = instance.inbox
        try:
            text = await asyncio.wait_for(inbox.get(), timeout_s)
        except TimeoutError:
            return None
        if inbox is instance.inbox:  # not replaced by the exit meanwhile
            instance.inbox_bytes -= len(text.encode()) + ITEM_OVERHEAD_BYTES
        return text

    async def spawn_child(
        self,
        parent: Instance,
        program_ref: str,
        args: tuple[str, ...],
        limits: Limits | None,
        traceparent: str = "",
        max_tokens: int = 0,
    ) -> Instance:
        """A child in the parent's tree, owned by the parent's user and counted against the tree's
        `max_children`. Unset limits inherit the parent's and none can exceed them (a larger request
        gets the parent's; one over the spawner's maximum is refused, LimitTooHigh); the token budget
        is the child's request when smaller than the parent's, and the scheduler also charges the
        child's tokens to every ancestor (it is registered with its parent), so a tree never feeds
        more than its root's budget."""
        tree = parent.tree
        if tree.num_children >= tree.max_children:
            raise TooManyChildren(
                f"the launch tree of {tree.tree_id} may spawn at most {tree.max_children} children "
                f"and has spawned {tree.num_children}"
            )
        merged = child_limits(limits, parent.supervisor.spec.limits, self.config.max_limits)
        tree.num_children += 1
        try:
            return await self.launch(
                program_ref or parent.program_sha256,
                args,
                merged,
                child_token_budget(max_tokens, parent.max_tokens),
                traceparent=traceparent,
                parent=parent,
            )
        except BaseException:
            tree.num_children -= 1  # a child that never ran does not use up the tree's budget
            raise

    async def wait_child(self, parent: Instance, child_id: str, timeout_s: float | None) -> ExitInfo | None:
        if child_id not in parent.child_ids:
            raise InstanceNotFound(f"{child_id!r} is not a child of {parent.instance_id!r}")
        try:
            return await asyncio.wait_for(self.get(child_id).supervisor.wait(), timeout_s)
        except TimeoutError:
            return None

    async def shutdown(self) -> None:
        for task in list(self._grace_tasks):
            task.cancel()
        running = [i for i in self._instances.values() if i.state is InstanceState.RUNNING]
        await asyncio.gather(
            *(i.supervisor.terminate(ExitReason.KILLED, "the spawner is shutting down") for i in running),
            return_exceptions=True,
        )
        await self.shared.close()
