"""Executors as the scheduler core sees them: a link (the transport), and per-executor state.

The link is the only side effect: `GrpcExecutorLink` (links.py) owns one `Execute` stream; the
in-process `SimulatedLink` (simulated.py) stands in for it in unit tests and the benchmark. A link
sends batches in call order (the executor runs them in arrival order) and reports replies,
(re)connection and loss through the callbacks `start` receives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from l4m.scheduler.batcher import BatchQueue, Command
from l4m.scheduler.errors import ExecutorLost
from l4m.scheduler.kinds import EXECUTOR_KINDS, KINDS
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
    """A sent batch: its commands and their (translated) items, aligned, and its place in the scheduler's
    dispatch order (`seq`: an instance whose last dispatch is this batch sent nothing after it). In an
    unanswered fire-and-forget batch, the command of an instance that ended is None (see
    `Executor.forget_instance`)."""

    __slots__ = ("kind", "commands", "items", "span", "sent_at", "seq")

    def __init__(self, kind: str, commands: list[Command | None], span: Any, sent_at: float, seq: int = 0,
                 items: list[Any] | None = None) -> None:
        self.kind = kind
        self.commands = commands
        self.items = items if items is not None else [c.item for c in commands if c is not None]
        self.span = span
        self.sent_at = sent_at
        self.seq = seq


class Executor:
    """One executor: its link, its pools and batch queues (while connected), batches in flight."""

    def __init__(self, index: int, link: ExecutorLink) -> None:
        self.index = index
        self.link = link
        self.info: executor_pb2.ExecutorServiceGetInfoResponse | None = None
        self.resources: ExecutorResources | None = None
        self.queues: dict[str, BatchQueue] = {}
        self.inflight: dict[int, InflightBatch] = {}
        # Fire-and-forget batches (answered only when rejected) not known to have run yet, by correlation
        # id in send order. The executor answers in send order, so any reply settles every older one.
        self.unanswered: dict[int, InflightBatch] = {}
        self.num_forward_in_flight = 0
        self.instances: set[Any] = set()
        self._next_correlation_id = 0

    @property
    def is_connected(self) -> bool:
        return self.resources is not None

    def pools(self) -> ExecutorResources:
        """Its pools, while connected (the core acts only on connected executors' pools)."""
        if self.resources is None:
            raise ExecutorLost(f"executor {self.index} ({self.link.address}) is not connected")
        return self.resources

    def next_correlation_id(self) -> int:
        self._next_correlation_id += 1
        return self._next_correlation_id

    def settle_unanswered(self, correlation_id: int) -> None:
        """A reply to `correlation_id` came: every fire-and-forget batch sent before it ran."""
        unanswered = self.unanswered
        while unanswered and (oldest := next(iter(unanswered))) < correlation_id:
            del unanswered[oldest]

    def forget_instance(self, instance: Any) -> None:
        """An instance ended: its unanswered commands no longer need blaming. A deallocate batch stays
        whole (were it rejected, its other items must still be sent); any other batch of ended instances
        only is dropped."""
        for correlation_id, batch in list(self.unanswered.items()):
            commands = batch.commands
            for index, command in enumerate(commands):
                if command is not None and command.stream.instance is instance:
                    commands[index] = None
            if not KINDS[batch.kind].frees_when_translated and not any(commands):
                del self.unanswered[correlation_id]

    def connect(self, info: executor_pb2.ExecutorServiceGetInfoResponse) -> list[BatchQueue]:
        """Fresh pools and queues for a (re)connected executor: its cache starts empty (the link reset it)."""
        self.info = info
        self.resources = ExecutorResources(info.num_kv_pages, info.num_embed_slots, info.num_swap_slots)
        max_batch_tokens = info.max_batch_tokens or (1 << 30)
        self.queues = {kind: BatchQueue(kind, self, max_batch_tokens, is_forward=KINDS[kind].is_forward)
                       for kind in EXECUTOR_KINDS}
        return list(self.queues.values())

    def disconnect(self) -> list[BatchQueue]:
        queues = list(self.queues.values())
        self.resources = None
        self.queues = {}
        self.inflight.clear()
        self.unanswered.clear()
        self.num_forward_in_flight = 0
        self.instances.clear()
        return queues
