"""Registered instances: identity, owner, token, launch order, token budget, lifecycle and resource table."""

from __future__ import annotations

import enum
from collections import deque
from typing import Any, Protocol

from l4m.scheduler.batcher import Stream
from l4m.scheduler.errors import AlreadyRegistered
from l4m.scheduler.resources import ResourceTable
from l4m.v1 import l4m_pb2


class InstanceState(enum.StrEnum):
    REGISTERED = "registered"  # known, no session yet
    ACTIVE = "active"  # its session is open
    ENDED = "ended"  # session closed, trapped or destroyed; holds nothing


class EventSink(Protocol):
    """Where an instance's events go (the server's session writer; a list in tests)."""

    def send(self, response: l4m_pb2.SessionResponse) -> None: ...

    def end(self, trap: l4m_pb2.Trap | None) -> None: ...


class Instance:
    """One controller instance. Invariant: while ACTIVE, every physical id in `table` is held (one
    reference) on `executor`; once ENDED, `table` is empty and no command of it is queued.

    Parked (memory pressure, `Scheduler._preempt` / `_wait`): a *suspended* instance's unshared pages are
    in host swap slots (`table.swapped_kv_pages`); a *waiting* one needs `wait_num_pages` more pages than it
    can get. Either way its commands are kept in `held`, in the order they would have been sent, and none
    is translated or sent until it resumes. `wait_started` stays set from its first failed allocate until an
    allocate of it gets through (it is in the admission queue that long, across retries)."""

    __slots__ = (
        "instance_id",
        "token",
        "max_tokens",
        "launched_at_unix_ms",
        "launch_seq",
        "_state",
        "is_alive",
        "num_tokens_used",
        "streams",
        "executor",
        "table",
        "sink",
        "trace_context",
        "is_anonymous",
        "trap",
        "num_streams_closing",
        "user",
        "is_admin",
        "parent",
        "model",
        "companions",
        "companion_of",
        "is_suspended",
        "is_waiting",
        "held",
        "wait_started",
        "wait_num_pages",
        "wait_timer",
    )

    def __init__(
        self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int, launch_seq: int, *,
        user: str = "", is_admin: bool = False, parent: Instance | None = None,
    ) -> None:
        self.instance_id = instance_id
        # Owner of its exports. An anonymous instance (no user) is a user of its own.
        self.user = user or f"anonymous:{instance_id}"
        self.is_admin = is_admin
        # The instance that spawned it: every token it feeds is charged to each ancestor too.
        self.parent = parent
        self.model: Any = None  # the ServedModel its session serves (models.py), set when the session opens
        # Sessions of this controller on other models (`ctx.load_model`), each an instance of its own whose
        # parent is this one (its tokens charged here too), by model name; they end when this one ends.
        self.companions: dict[str, Instance] = {}
        self.companion_of: Instance | None = None
        self.token = token
        self.max_tokens = max_tokens
        self.launched_at_unix_ms = launched_at_unix_ms
        self.launch_seq = launch_seq
        self.state = InstanceState.REGISTERED
        self.num_tokens_used = 0
        self.streams: dict[int, Stream] = {}
        self.executor: Any = None
        self.table = ResourceTable()
        self.sink: EventSink | None = None
        self.trace_context: Any = None
        self.is_anonymous = False
        self.trap: l4m_pb2.Trap | None = None
        self.num_streams_closing = 0
        self.is_suspended = False
        self.is_waiting = False
        self.held: deque[Any] = deque()  # the Commands of a parked instance, in order
        self.wait_started: float | None = None
        self.wait_num_pages = 0
        self.wait_timer: Any = None  # the loop's TimerHandle of its admission timeout

    @property
    def state(self) -> InstanceState:
        return self._state

    @state.setter
    def state(self, state: InstanceState) -> None:
        self._state = state
        # A plain attribute, not a property: the hot path asks it ~6 times per command.
        self.is_alive = state is InstanceState.ACTIVE

    @property
    def is_parked(self) -> bool:
        """Suspended or waiting: its commands are held, not sent."""
        return self.is_suspended or self.is_waiting

    @property
    def launch_key(self) -> tuple[int, int]:
        """Orders instances by launch; the contention policy evicts the largest key first."""
        return (self.launched_at_unix_ms, self.launch_seq)

    def ancestors(self) -> list[Instance]:
        """Parent first, root last."""
        chain, node = [], self.parent
        while node is not None:
            chain.append(node)
            node = node.parent
        return chain

    def stream(self, stream_id: int) -> Stream:
        stream = self.streams.get(stream_id)
        if stream is None:
            stream = self.streams[stream_id] = Stream(self, stream_id)
        return stream


class InstanceRegistry:
    """Instances by id and by token."""

    def __init__(self) -> None:
        self._by_id: dict[str, Instance] = {}
        self._by_token: dict[str, Instance] = {}
        self._next_seq = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_id.values()))

    def can_register(self, instance_id: str, token: str) -> bool:
        return instance_id not in self._by_id and token not in self._by_token

    def register(self, instance_id: str, token: str, max_tokens: int, launched_at_unix_ms: int, *,
                 user: str = "", is_admin: bool = False, parent: Instance | None = None) -> Instance:
        if not self.can_register(instance_id, token):
            raise AlreadyRegistered(f"instance {instance_id!r} (or its token) is registered")
        self._next_seq += 1
        instance = Instance(instance_id, token, max_tokens, launched_at_unix_ms, self._next_seq,
                            user=user, is_admin=is_admin, parent=parent)
        self._by_id[instance_id] = instance
        self._by_token[token] = instance
        return instance

    def get(self, instance_id: str) -> Instance | None:
        return self._by_id.get(instance_id)

    def by_token(self, token: str) -> Instance | None:
        return self._by_token.get(token)

    def remove(self, instance_id: str) -> Instance | None:
        instance = self._by_id.pop(instance_id, None)
        if instance is not None:
            self._by_token.pop(instance.token, None)
        return instance

    def num_active(self) -> int:
        return sum(1 for i in self._by_id.values() if i.is_alive)
