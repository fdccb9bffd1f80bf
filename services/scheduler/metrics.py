"""The scheduler's counters and Prometheus metrics, in a registry it owns (the cluster exposes it).

One source: every count the scheduler keeps lives here; the Prometheus families read them at scrape
time and the debug_query "stats" answer is built from `SchedulerMetrics.counts()`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from l4m.common.metrics import DurationHistogram, DurationsByKind
from l4m.scheduler.kinds import EXECUTOR_KINDS

if TYPE_CHECKING:
    from l4m.scheduler.instances import Instance

_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class _CountsByKind(Collector):
    """A counter family (`<name>_total{kind}`) read from a plain dict at scrape time: a prometheus
    Counter takes a lock per increment, too much for every command on the hot path."""

    def __init__(self, name: str, documentation: str, counts: dict[str, int]) -> None:
        self.name, self.documentation, self.counts = name, documentation, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.documentation, labels=["kind"])
        for kind, count in sorted(self.counts.items()):
            family.add_metric([kind], count)
        yield family


class _DurationCollector(Collector):
    """One histogram family from `DurationsByKind`, read at scrape time (no lock per observation)."""

    def __init__(self, name: str, documentation: str, by_kind: DurationsByKind) -> None:
        self.name, self.documentation, self.by_kind = name, documentation, by_kind

    def collect(self) -> Iterator[Metric]:
        yield self.by_kind.family(self.name, self.documentation)


class _HistogramCollector(Collector):
    """One unlabelled histogram family from a `DurationHistogram`, read at scrape time."""

    def __init__(self, name: str, documentation: str, histogram: DurationHistogram) -> None:
        self.name, self.documentation, self.histogram = name, documentation, histogram

    def collect(self) -> Iterator[Metric]:
        yield self.histogram.family(self.name, self.documentation)


class _Count(Collector):
    """A plain counter (`<name>_total`) read from a callable at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=self.read())


# Seconds an instance waits in the admission queue: from sub-millisecond to the default timeout's 60 s.
_WAIT_BUCKETS = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Session opening to first token: a GPU prefill of a short prompt (ms) to a long CPU prefill behind a queue.
_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SchedulerMetrics:
    """Counts are plain ints and dicts (read at scrape time, and by `counts()`); batch sizes go to a
    prometheus histogram as well; gauges are computed when scraped, so they cost nothing in between."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.commands_by_kind: dict[str, int] = {}
        self.traps_by_kind: dict[str, int] = {}  # by TrapKind name
        self.batches_by_kind: dict[str, int] = {}
        self.items_by_kind: dict[str, int] = {}  # items sent, in all batches of the kind
        self.max_instances_per_batch: dict[str, int] = {}
        self.multi_instance_batches: dict[str, int] = {}  # batches that carried items of several instances
        self.num_batch_errors = 0  # batches the executor rejected (or errors naming no batch)
        self.num_batches_resent = 0  # rejected batches sent again without their offending item
        # Memory pressure (contention.py): instances preempted (their unshared pages swapped out, or none
        # when they held only shared ones), and resumed (swapped back in, their commands going on).
        self.num_preemptions = 0
        self.num_resumes = 0
        self.num_pages_swapped_out = 0  # pages copied to host swap, all preemptions together
        self.registry.register(_Count("l4m_scheduler_preemptions",
                                      "Instances preempted under memory pressure (their pages swapped to host)",
                                      lambda: self.num_preemptions))
        self.registry.register(_Count("l4m_scheduler_resumes", "Preempted instances resumed (pages swapped back in)",
                                      lambda: self.num_resumes))
        self.registry.register(_Count("l4m_scheduler_kv_pages_swapped_out", "KV pages copied to host swap",
                                      lambda: self.num_pages_swapped_out))
        # Persistent exports evicted (least recently used first) before anyone is preempted, and the kv pages
        # that freed (pages an importer or another export still holds stay).
        self.num_exports_evicted = 0
        self.num_export_pages_evicted = 0
        self.registry.register(_Count("l4m_scheduler_exports_evicted",
                                      "Persistent, unpinned exports evicted under memory pressure",
                                      lambda: self.num_exports_evicted))
        self.registry.register(_Count("l4m_scheduler_export_kv_pages_evicted",
                                      "KV pages freed by evicting exports under memory pressure",
                                      lambda: self.num_export_pages_evicted))
        self.kv_pages_swapped = Gauge("l4m_scheduler_kv_pages_swapped",
                                      "KV pages of preempted instances in host swap now, all executors",
                                      registry=self.registry)
        self.suspended_instances = Gauge("l4m_scheduler_suspended_instances",
                                         "Instances preempted now (their commands held)", registry=self.registry)
        self.admission_queue_depth = Gauge(
            "l4m_scheduler_admission_queue_depth",
            "Instances waiting for kv pages that neither the free pool nor preemption could give them",
            registry=self.registry)
        self.admission_wait_seconds = Histogram(
            "l4m_scheduler_admission_wait_seconds",
            "Time an instance waited in the admission queue, first failed allocation to the one that got through",
            buckets=_WAIT_BUCKETS, registry=self.registry)
        self.registry.register(_CountsByKind("l4m_scheduler_commands", "L4M commands received", self.commands_by_kind))
        self.registry.register(_CountsByKind("l4m_scheduler_traps", "Instances trapped", self.traps_by_kind))
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
        # Generation (`observe_sampled`): tokens sampled for instances, time to first token and between tokens.
        # Per instance, while its session is open: when it opened (until its first token), then when its
        # last token was answered; `forget_instance` drops both when it ends.
        self.num_generated_tokens = 0
        self.time_to_first_token = DurationHistogram(_FIRST_TOKEN_BUCKETS)
        self.inter_token = DurationHistogram()
        self._opened_at: dict[Instance, float] = {}
        self._last_token_at: dict[Instance, float] = {}
        self.registry.register(_Count(
            "l4m_scheduler_generated_tokens",
            "Tokens sampled for instances: the outputs carrying a sampled token (not a distribution) of every "
            "forward_text reply, continuation steps included", lambda: self.num_generated_tokens))
        self.registry.register(_HistogramCollector(
            "l4m_scheduler_time_to_first_token_seconds",
            "Per instance, once: its L4M session opening to the first forward_text reply carrying a sampled token "
            "(the controller's own work before its first forward, queueing, prefill)", self.time_to_first_token))
        self.registry.register(_HistogramCollector(
            "l4m_scheduler_inter_token_seconds",
            "Per sampled token after an instance's first reply carrying one: the gap between two consecutive such "
            "replies of the instance divided by the tokens of the later one (continuation replies carry several), "
            "observed once per token; a controller's pauses between generations count too", self.inter_token))

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

    def bind_pressure_gauges(self, kv_pages_swapped: Callable[[], float], suspended_instances: Callable[[], float],
                             admission_queue_depth: Callable[[], float]) -> None:
        self.kv_pages_swapped.set_function(kv_pages_swapped)
        self.suspended_instances.set_function(suspended_instances)
        self.admission_queue_depth.set_function(admission_queue_depth)

    def count_command(self, kind: str) -> None:
        counts = self.commands_by_kind
        counts[kind] = counts.get(kind, 0) + 1

    def count_trap(self, trap_kind_name: str) -> None:
        counts = self.traps_by_kind
        counts[trap_kind_name] = counts.get(trap_kind_name, 0) + 1

    def observe_batch(self, kind: str, num_items: int, num_instances: int) -> None:
        """A batch of `num_items` items from `num_instances` instances was sent."""
        self.batches_by_kind[kind] = self.batches_by_kind.get(kind, 0) + 1
        self.items_by_kind[kind] = self.items_by_kind.get(kind, 0) + num_items
        if num_instances > self.max_instances_per_batch.get(kind, 0):
            self.max_instances_per_batch[kind] = num_instances
        if num_instances > 1:
            self.multi_instance_batches[kind] = self.multi_instance_batches.get(kind, 0) + 1
        self._batch_size_by_kind[kind].observe(num_items)

    def observe_reply(self, kind: str, seconds: float) -> None:
        self.command_seconds.observe(kind, seconds)

    def observe_batch_reply(self, kind: str, seconds: float) -> None:
        self.executor_batch_seconds.observe(kind, seconds)

    def session_opened(self, instance: Instance, now: float) -> None:
        """An instance's session opened: its time to first token starts."""
        self._opened_at[instance] = now

    def observe_sampled(self, instance: Instance, num_tokens: int, now: float) -> None:
        """A forward_text reply carrying `num_tokens` (> 0) sampled tokens reached `instance` at `now`. Two dict
        look-ups and plain additions: the reply path of every decode step."""
        self.num_generated_tokens += num_tokens
        last = self._last_token_at.get(instance)
        if last is None:
            opened = self._opened_at.pop(instance, None)
            if opened is None:  # no open session known (it ended): nothing to time, nothing to keep
                return
            self.time_to_first_token.observe(now - opened)
        else:
            self.inter_token.observe_many((now - last) / num_tokens, num_tokens)
        self._last_token_at[instance] = now

    def forget_instance(self, instance: Instance) -> None:
        """The instance ended: its timing state goes."""
        self._opened_at.pop(instance, None)
        self._last_token_at.pop(instance, None)

    @property
    def num_timed_instances(self) -> int:
        """Instances whose generation timing is kept now (those with an open session)."""
        return len(self._opened_at.keys() | self._last_token_at.keys())

    def counts(self) -> dict[str, Any]:
        """The counters as the debug_query "stats" answer names them (copies)."""
        return {
            "commands": sum(self.commands_by_kind.values()),
            "batches": dict(self.batches_by_kind),
            "items": dict(self.items_by_kind),
            "max_instances_per_batch": dict(self.max_instances_per_batch),
            "multi_instance_batches": dict(self.multi_instance_batches),
            "traps": dict(self.traps_by_kind),
            "batch_errors": self.num_batch_errors,
            "batches_resent": self.num_batches_resent,
            "preemptions": self.num_preemptions,
            "resumes": self.num_resumes,
            "kv_pages_swapped_out": self.num_pages_swapped_out,
            "exports_evicted": self.num_exports_evicted,
            "export_kv_pages_evicted": self.num_export_pages_evicted,
            "generated_tokens": self.num_generated_tokens,
        }
