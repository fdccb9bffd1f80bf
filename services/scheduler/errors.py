"""Typed failures of the scheduler core. Each one traps exactly one instance with a `TrapKind`;
`server.py` is the one place that maps a trap kind to a gRPC status code."""

from __future__ import annotations

from l4m.v1 import l4m_pb2


class TrapError(Exception):
    """A command (or the system) stops an instance; `reason` names the offending field and value."""

    trap_kind: int = l4m_pb2.TRAP_KIND_INVALID_COMMAND

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidCommand(TrapError):
    """Malformed command, or one naming something the instance does not own."""

    trap_kind = l4m_pb2.TRAP_KIND_INVALID_COMMAND


class ResourceExhausted(TrapError):
    """No room for the instance and nobody newer to evict."""

    trap_kind = l4m_pb2.TRAP_KIND_RESOURCE_EXHAUSTED


class TokenBudgetExceeded(TrapError):
    """The instance fed more tokens than the spawner allowed it, its ancestors or its user."""

    trap_kind = l4m_pb2.TRAP_KIND_TOKEN_BUDGET


class PermissionDenied(TrapError):
    """The instance lacks the role the command needs (admin), or the thing it names is another user's."""

    trap_kind = l4m_pb2.TRAP_KIND_PERMISSION_DENIED


class Unsupported(TrapError):
    """The model lacks a capability the command needs (e.g. vision)."""

    trap_kind = l4m_pb2.TRAP_KIND_UNSUPPORTED


class NoExecutor(TrapError):
    """No executor is connected that could hold the instance's resources."""

    trap_kind = l4m_pb2.TRAP_KIND_EXECUTOR_LOST


class Evicted(TrapError):
    """Stopped to make room for an older instance (contention policy)."""

    trap_kind = l4m_pb2.TRAP_KIND_EVICTED


class Destroyed(TrapError):
    """The spawner destroyed the instance."""

    trap_kind = l4m_pb2.TRAP_KIND_DESTROYED


class ExecutorLost(TrapError):
    """The executor holding the instance's resources went away (or failed its batch)."""

    trap_kind = l4m_pb2.TRAP_KIND_EXECUTOR_LOST


class RegistrationError(Exception):
    """A RegisterInstance the scheduler refuses; `server.py` maps each subclass to a status code."""


class AlreadyRegistered(RegistrationError):
    """The instance id or its token is registered already."""


class UnknownParent(RegistrationError):
    """parent_instance_id names no registered instance."""


class TooManyInstances(RegistrationError):
    """The scheduler holds `max_instances` registrations already."""
