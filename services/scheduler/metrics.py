"""Prometheus metrics of the scheduler, in a registry it owns (the cluster exposes it)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from l4m.common.metrics import DurationsByKind
from l4m.scheduler.batcher import EXECUTOR_KINDS

_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _CommandCounter(Collector):
    """`l4m_scheduler_commands_total{kind}` read from a plain dict at scrape time: a prometheus
    Counter takes a lock per increment, too much for every command on the hot path."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def collect(self):  # type: ignore[no-untyped-def]
        family = CounterMetricFamily("l4m_scheduler_commands", "L4M commands received", labels=["kind"])
        for kind, count in sorted(self.counts.items()):
            family.add_metric([kind], count)
        yield family


class _DurationCollector(Collector):
    """One histogram family from `DurationsByKind`, read at scrape time (no lock per observation)."""

    def __init__(self, name: str, documentation: str, by_kind: DurationsByKind) -> None:
        self.name, self.documentation, self.by_kind = name, documentation, by_kind

    def collect(self):  # type: ignore[no-untyped-def]
        yield self.by_kind.family(self.name, self.documentation)


class SchedulerMetrics:
    """Per-command counts are plain ints read at scrape time; per-batch observations go to
    prometheus directly; gauges are computed when scraped, so they cost nothing in between."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.commands_by_kind: dict[str, int] = {}
        self.registry.register(_CommandCounter(self.commands_by_kind))
        self.traps = Counter("l4m_scheduler_traps", "Instances trapped", ["kind"], registry=self.registry)
        self.batch_size = Histogram(
            "l4m_scheduler_batch_size", "Items per batch sent to an executor", ["kind"],
            buckets=_BATCH_SIZE_BUCKETS, registry=self.registry,
        )
        self.queue_depth = Gauge("l4m_scheduler_queue_depth", "Commands waiting in batch queues", registry=self.registry)
        self.kv_pages_used = Gauge("l4m_scheduler_kv_pages_used", "KV pages held, all executors", registry=self.registry)
        self.embed_slots_used = Gauge(
            "l4m_scheduler_embed_slots_used", "Embedding slots held, all executors", registry=self.registry
        )
        self.instances = Gauge("l4m_scheduler_instances", "Instances with an open session", registry=self.registry)
        self._batch_size_by_kind = {kind: self.batch_size.labels(kind) for kind in EXECUTOR_KINDS}
        # Replied commands only: what a controller waits for (queue + batch + executor), and the executor
        # round trip of the batches that carried them.
        self.command_seconds = DurationsByKind()
        self.executor_batch_seconds = DurationsByKind()
        self.registry.register(_DurationCollector(
            "l4m_scheduler_command_seconds",
            "Arrival of a replied command to its reply (queueing, batching and the executor), by kind",
            self.command_seconds,
        ))
        self.registry.register(_DurationCollector(
            "l4m_scheduler_executor_batch_seconds",
            "A replied batch's executor round trip: sent to answered, by kind", self.executor_batch_seconds,
        ))

    def bind_gauges(
        self,
        queue_depth: Callable[[], float],
        kv_pages_used: Callable[[], float],
        instances: Callable[[], float],
        embed_slots_used: Callable[[], float] = lambda: 0,
    ) -> None:
        self.queue_depth.set_function(queue_depth)
        self.kv_pages_used.set_function(kv_pages_used)
        self.embed_slots_used.set_function(embed_slots_used)
        self.instances.set_function(instances)

    def count_command(self, kind: str) -> None:
        counts = self.commands_by_kind
        counts[kind] = counts.get(kind, 0) + 1

    def observe_batch(self, kind: str, num_items: int) -> None:
        self._batch_size_by_kind[kind].observe(num_items)

    def observe_reply(self, kind: str, seconds: float) -> None:
        self.command_seconds.observe(kind, seconds)

    def observe_batch_reply(self, kind: str, seconds: float) -> None:
        self.executor_batch_seconds.observe(kind, seconds)

