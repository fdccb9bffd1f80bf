"""Instances: launch from the program store, register with the scheduler, supervise, report, forget.

`InstanceManager` is the spawner's core; `server.py` is a thin gRPC layer over it. Every instance
belongs to a launch tree (a user's launch and the children it spawns): the tree shares one
`VariableStore` and one child budget. An instance is registered with the scheduler (its token and
token budget) before its sandbox starts, and destroyed there when it ends, whatever the reason, so
the scheduler frees every page it held. The core never imports grpc: the scheduler is reached
through the small `InstanceRegistry` interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from l4m.spawner.config import SpawnerConfig
from l4m.spawner.programs import ProgramStore
from l4m.spawner.sandbox import ExitInfo, ExitReason, Limits, Sandbox, SandboxError, SandboxSpec
from l4m.spawner.supervisor import InstanceState, InstanceSupervisor
from l4m.spawner.variables import VariableStore


class InstanceError(Exception):
    """Base class of the manager's errors; server.py maps each subclass to one gRPC status."""


class InstanceNotFound(InstanceError):
    pass


class LaunchFailed(InstanceError):
    pass


class TooManyInstances(InstanceError):
    pass


class InstanceRegistry(Protocol):
    """The scheduler's side of an instance's life (see protos/l4m/v1/registry.proto)."""

    async def register(
        self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int
    ) -> None: ...

    async def destroy(self, instance_id: str, reason: str) -> None: ...


class NoScheduler:
    """For a spawner run without a scheduler (tests of the sandbox layer, local development)."""

    async def register(self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int) -> None:
        return None

    async def destroy(self, instance_id: str, reason: str) -> None:
        return None


@dataclass
class LaunchTree:
    tree_id: str
    variables: VariableStore = field(default_factory=VariableStore)
    num_children: int = 0


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
    parent_id: str = ""
    child_ids: list[str] = field(default_factory=list)
    inbox: asyncio.Queue[str] = field(default_factory=asyncio.Queue)

    @property
    def state(self) -> InstanceState:
        return self.supervisor.state

    @property
    def exit_info(self) -> ExitInfo | None:
        return self.supervisor.exit_info


def clamp_limits(requested: Limits | None, default: Limits, maximum: Limits) -> Limits:
    """Fields of `requested` that are 0 take the default; every field is capped at the maximum."""
    if requested is None:
        return default
    values = {}
    for name in Limits.__dataclass_fields__:
        value = getattr(requested, name) or getattr(default, name)
        values[name] = min(value, getattr(maximum, name))
    return Limits(**values)


class InstanceManager:
    def __init__(
        self, config: SpawnerConfig, store: ProgramStore, sandbox: Sandbox, registry: InstanceRegistry
    ) -> None:
        self.config = config
        self.store = store
        self.sandbox = sandbox
        self.registry = registry
        self._instances: dict[str, Instance] = {}
        self._by_token: dict[str, Instance] = {}

    # -- launching -------------------------------------------------------------------------------

    async def launch(
        self,
        program_ref: str,
        args: tuple[str, ...] = (),
        limits: Limits | None = None,
        max_tokens: int = 0,
        env: dict[str, str] | None = None,
        parent: Instance | None = None,
    ) -> Instance:
        """Resolves the program, registers the instance with the scheduler and starts its sandbox."""
        program = self.store.resolve(program_ref)
        if (
            sum(i.state is not InstanceState.EXITED for i in self._instances.values())
            >= self.config.max_instances
        ):
            raise TooManyInstances(f"the spawner already runs {self.config.max_instances} instances")
        instance_id = f"i-{uuid.uuid4().hex[:16]}"
        token = secrets.token_urlsafe(24)
        launched_at_unix_ms = int(time.time() * 1000)
        limits = clamp_limits(limits, self.config.default_limits, self.config.max_limits)
        max_tokens = max_tokens or self.config.default_max_tokens
        tree = parent.tree if parent is not None else LaunchTree(instance_id)
        spec = SandboxSpec(
            instance_id,
            program.path,
            tuple(args),
            self._sandbox_env(instance_id, token, env),
            self.config.socket_dir,
            limits,
        )
        supervisor = InstanceSupervisor(self.sandbox, spec)
        instance = Instance(
            instance_id, program.sha256, tuple(args), token, tree, supervisor, max_tokens, launched_at_unix_ms
        )
        if parent is not None:
            instance.parent_id = parent.instance_id
            parent.child_ids.append(instance_id)
        await self.registry.register(instance_id, token, max_tokens, launched_at_unix_ms)
        try:
            await supervisor.start()
        except SandboxError as exc:
            await self.registry.destroy(instance_id, f"launch failed: {exc}")
            raise LaunchFailed(str(exc)) from exc
        self._instances[instance_id] = instance
        self._by_token[token] = instance
        supervisor.add_exit_callback(lambda info: self._on_exit(instance, info))
        return instance

    def _sandbox_env(self, instance_id: str, token: str, extra: dict[str, str] | None) -> dict[str, str]:
        env = {
            "L4M_INSTANCE_ID": instance_id,
            "L4M_INSTANCE_TOKEN": token,
            "L4M_SCHEDULER_ADDR": f"unix:///run/l4m/{self.config.scheduler_socket_name}",
            "L4M_RUNTIME_ADDR": f"unix:///run/l4m/{self.config.runtime_socket_name}",
        }
        env.update(extra or {})
        return env

    async def _on_exit(self, instance: Instance, info: ExitInfo) -> None:
        self._by_token.pop(instance.token, None)
        # The scheduler frees the instance's pages and slots; a failure to reach it must not hide
        # the exit from the user (the scheduler also traps sessions whose instance it cannot see).
        with contextlib.suppress(Exception):
            await self.registry.destroy(instance.instance_id, f"{info.reason.value}: {info.message}")
        for child_id in instance.child_ids:
            child = self._instances.get(child_id)
            if child is not None and child.state is InstanceState.RUNNING:
                asyncio.ensure_future(
                    child.supervisor.terminate(
                        ExitReason.PARENT_EXITED, f"its parent {instance.instance_id} ended"
                    )
                )

    # -- lookups and control ---------------------------------------------------------------------

    def get(self, instance_id: str) -> Instance:
        instance = self._instances.get(instance_id)
        if instance is None:
            raise InstanceNotFound(f"no instance {instance_id!r}")
        return instance

    def by_token(self, token: str) -> Instance:
        """The running instance that holds `token` (the runtime's authentication)."""
        instance = self._by_token.get(token)
        if instance is None:
            raise InstanceNotFound("no running instance holds this token")
        return instance

    def list_instances(self) -> list[Instance]:
        return sorted(self._instances.values(), key=lambda i: i.launched_at_unix_ms)

    async def terminate(
        self, instance_id: str, reason: ExitReason = ExitReason.TERMINATED, message: str = ""
    ) -> ExitInfo:
        instance = self.get(instance_id)
        return await instance.supervisor.terminate(reason, message or f"{reason.value} on request")

    async def trap(self, instance_id: str, message: str) -> None:
        """The scheduler trapped the instance: stop its sandbox and report the trap as its exit."""
        with contextlib.suppress(InstanceNotFound):
            await self.terminate(instance_id, ExitReason.TRAPPED, message)

    def send_to_instance(self, instance_id: str, text: str) -> None:
        instance = self.get(instance_id)
        if instance.state is InstanceState.EXITED:
            raise InstanceNotFound(f"instance {instance_id!r} has exited")
        instance.inbox.put_nowait(text)

    async def receive_from_user(self, instance: Instance, timeout_s: float | None) -> str | None:
        try:
            return await asyncio.wait_for(instance.inbox.get(), timeout_s)
        except TimeoutError:
            return None

    async def spawn_child(
        self, parent: Instance, program_ref: str, args: tuple[str, ...], limits: Limits | None
    ) -> Instance:
        """A child in the parent's tree; unset limits inherit the parent's."""
        if parent.tree.num_children >= self.config.max_children_per_tree:
            raise TooManyInstances(
                f"the launch tree already spawned its {self.config.max_children_per_tree} children"
            )
        parent.tree.num_children += 1
        inherited = parent.supervisor.spec.limits
        merged = clamp_limits(limits, inherited, inherited) if limits is not None else inherited
        return await self.launch(
            program_ref or parent.program_sha256, args, merged, parent.max_tokens, parent=parent
        )

    async def wait_child(self, parent: Instance, child_id: str, timeout_s: float | None) -> ExitInfo | None:
        if child_id not in parent.child_ids:
            raise InstanceNotFound(f"{child_id!r} is not a child of {parent.instance_id!r}")
        try:
            return await asyncio.wait_for(self.get(child_id).supervisor.wait(), timeout_s)
        except TimeoutError:
            return None

    async def shutdown(self) -> None:
        running = [i for i in self._instances.values() if i.state is InstanceState.RUNNING]
        await asyncio.gather(
            *(i.supervisor.terminate(ExitReason.KILLED, "the spawner is shutting down") for i in running),
            return_exceptions=True,
        )
