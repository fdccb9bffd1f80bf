"""The spawner's warm-pool gauges, read at scrape time."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from l4m.spawner.metrics import SpawnerMetrics
from l4m.spawner.warm_pool import WarmPoolStats


def _samples(metrics: SpawnerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_warm_pool_gauges_follow_the_pool() -> None:
    stats: list[WarmPoolStats | None] = [WarmPoolStats(16, 3, 2, 5, 8, 0, 0)]
    metrics = SpawnerMetrics("process")
    metrics.bind_warm_pool(lambda: stats[0])
    samples = _samples(metrics)
    assert samples[("l4m_spawner_warm_sandboxes", (("state", "ready"),))] == 3
    assert samples[("l4m_spawner_warm_sandboxes", (("state", "starting"),))] == 2
    assert samples[("l4m_spawner_warm_pool_size", ())] == 16
    assert samples[("l4m_spawner_warm_pool_quiet_wait_seconds", ())] == 0
    stats[0] = WarmPoolStats(16, 16, 0, 5, 21, 0, 0, 12.5)
    assert _samples(metrics)[("l4m_spawner_warm_sandboxes", (("state", "ready"),))] == 16
    assert _samples(metrics)[("l4m_spawner_warm_pool_quiet_wait_seconds", ())] == 12.5


def test_without_a_pool_the_gauges_read_zero() -> None:
    metrics = SpawnerMetrics("docker")
    metrics.bind_warm_pool(lambda: None)
    samples = _samples(metrics)
    assert samples[("l4m_spawner_warm_sandboxes", (("state", "ready"),))] == 0
    assert samples[("l4m_spawner_warm_pool_size", ())] == 0
    assert samples[("l4m_spawner_warm_pool_quiet_wait_seconds", ())] == 0
