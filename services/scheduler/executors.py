"""Executors as the scheduler core sees them: a link (the transport), and per-executor state.

The link is the only side effect: `GrpcExecutorLink` (links.py) owns one `Execute` stream; the
in-process `SimulatedLink` (simulated.py) stands in for it in unit tests and the benchmark. A link
sends batches in call order (the executor runs them in arrival order) and reports replies,
(re)connection and loss through the callbacks `start` receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from l4m.scheduler.batcher import EXECUTOR_KINDS, BatchQueue, Command
from l4m.scheduler.resources import ExecutorResources
from l4m.v1 import executor_pb2

OnConnected = Callable[[executor_pb2.ExecutorServiceGetInfoResponse], None]
OnResponse = Callable[[executor_pb2.ExecuteResponse], None]
OnLost = Callable[[str], None]


class ExecutorLink(Protocol):
    address: str

    def start(self, on_connected: OnConnected, on_response: OnResponse, on_lost: OnLost) -> None:
        """Connect (and reconnect after loss, with backoff) in the background."""

    def send(self, request: executor_pb2.ExecuteRequest) -> None:
        """Queue a batch; batches reach the executor in call order. Dropped while disconnected."""

    async def close(self) -> None: ...


class InflightBatch:
    """A sent batch that will be answered: its commands, aligned with its items."""

    __slots__ = ("kind", "commands", "span", "sent_at")

    def __init__(self, kind: str, commands: list[Command], span: Any, sent_at: float) -> None:
        self.kind = kind
        self.commands = commands
        self.span = span
        self.sent_at = sent_at


class Executor:
    """One executor: its link, its pools and batch queues (while connected), batches in flight."""

    def __init__(self, index: int, link: ExecutorLink) -> None:
        self.index = index
        self.link = link
        self.info: executor_pb2.ExecutorServiceGetInfoResponse | None = None
        self.resources: ExecutorResources | None = None
        self.queues: dict[str, BatchQueue] = {}
        self.inflight: dict[int, InflightBatch] = {}
        self.num_forward_in_flight = 0
        self.instances: set[Any] = set()
        self._next_correlation_id = 0
        # Physical ids handed out by the allocate batch being built (not yet sent): when a trap frees
        # one of them, the executor is not told to deallocate it, since it never saw it allocated.
        self.unsent_kv_pages: set[int] = set()
        self.unsent_embed_slots: set[int] = set()

    @property
    def is_connected(self) -> bool:
        return self.resources is not None

    def next_correlation_id(self) -> int:
        self._next_correlation_id += 1
        return self._next_correlation_id

    def connect(self, info: executor_pb2.ExecutorServiceGetInfoResponse) -> list[BatchQueue]:
        """Fresh pools and queues for a (re)connected executor: its cache starts empty."""
        self.info = info
        self.resources = ExecutorResources(info.num_kv_pages, info.num_embed_slots)
        max_batch_tokens = info.max_batch_tokens or (1 << 30)
        self.queues = {kind: BatchQueue(kind, self, max_batch_tokens) for kind in EXECUTOR_KINDS}
        return list(self.queues.values())

    def disconnect(self) -> list[BatchQueue]:
        queues = list(self.queues.values())
        self.resources = None
        self.queues = {}
        self.inflight.clear()
        self.num_forward_in_flight = 0
        self.instances.clear()
        return queues
