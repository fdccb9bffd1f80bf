"""The spawner's Prometheus metrics, in a registry of its own (served by `--metrics-port`).

`SpawnerMetrics` is the one object the core reports to: instances by state, launch latency (launch
call to sandbox started), sandbox exits by reason, and output bytes read from sandboxes (logs and
messages). The core calls its methods; it never touches a metric directly.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from l4m.spawner.warm_pool import WarmPoolStats

# From a warm bubblewrap start (tens of ms) to a cold container start (seconds).
LAUNCH_LATENCY_BUCKETS_S = (0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SpawnerMetrics:
    def __init__(self, sandbox_kind: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._sandbox_kind = sandbox_kind
        self.instances = Gauge(
            "l4m_spawner_instances", "Instances alive, by state", ["state"], registry=self.registry
        )
        for state in ("starting", "running"):
            self.instances.labels(state).set(0)
        self.launch_latency = Histogram(
            "l4m_spawner_launch_latency_seconds",
            "Time from a launch request to its sandbox running",
            ["sandbox"],
            buckets=LAUNCH_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.exits = Counter(
            "l4m_spawner_sandbox_exits",
            "Sandboxes that ended, by exit reason",
            ["reason"],
            registry=self.registry,
        )
        self.launch_failures = Counter(
            "l4m_spawner_launch_failures",
            "Launches refused or failed, by cause",
            ["cause"],
            registry=self.registry,
        )
        self.warm_launches = Counter(
            "l4m_spawner_warm_launches",
            "Launches served by a warm sandbox (the rest started cold)",
            registry=self.registry,
        )
        self.output_bytes = Counter(
            "l4m_spawner_output_bytes",
            "Bytes of output and messages read from sandboxes",
            registry=self.registry,
        )

    def bind_warm_pool(self, stats: Callable[[], WarmPoolStats | None]) -> None:
        """Gauges of the warm pool, read from `stats()` at scrape time (None: the sandbox has no pool)."""
        sandboxes = Gauge(
            "l4m_spawner_warm_sandboxes",
            "Warm sandboxes in the pool, by state (ready: waiting for a launch; starting: at idle CPU priority)",
            ["state"],
            registry=self.registry,
        )
        sandboxes.labels("ready").set_function(lambda: _field(stats(), "num_ready"))
        sandboxes.labels("starting").set_function(lambda: _field(stats(), "num_starting"))
        size = Gauge("l4m_spawner_warm_pool_size", "Warm sandboxes the pool keeps ready", registry=self.registry)
        size.set_function(lambda: _field(stats(), "size"))
        waited = Gauge(
            "l4m_spawner_warm_pool_quiet_wait_seconds",
            "Seconds the pool's refills have waited, in all, for the host to have a CPU core to spare "
            "(--warm-pool-quiet-wait-s)",
            registry=self.registry,
        )
        waited.set_function(lambda: _field(stats(), "quiet_wait_s"))

    def launch_started(self) -> None:
        self.instances.labels("starting").inc()

    def launch_succeeded(self, latency_s: float, is_warm: bool = False) -> None:
        self.instances.labels("starting").dec()
        self.instances.labels("running").inc()
        self.launch_latency.labels(self._sandbox_kind).observe(latency_s)
        if is_warm:
            self.warm_launches.inc()

    def launch_failed(self, cause: str) -> None:
        self.instances.labels("starting").dec()
        self.launch_failures.labels(cause).inc()

    def instance_exited(self, reason: str) -> None:
        self.instances.labels("running").dec()
        self.exits.labels(reason).inc()

    def count_output_bytes(self, num_bytes: int) -> None:
        if num_bytes > 0:
            self.output_bytes.inc(num_bytes)


def _field(stats: WarmPoolStats | None, name: str) -> float:
    return float(getattr(stats, name)) if stats is not None else 0.0
