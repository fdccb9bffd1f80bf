"""Prometheus metrics of an executor, read from the engine's counters at scrape time (no hot-path cost)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from l4m.executor.engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self):  # type: ignore[no-untyped-def]
        engine, cache = self._engine, self._engine.cache
        yield CounterMetricFamily("l4m_executor_batches", "Batches executed", value=engine._num_batches)
        yield CounterMetricFamily(
            "l4m_executor_forward_tokens", "Tokens through forward passes (rate() gives tokens/s)",
            value=engine._num_forward_tokens,
        )
        yield engine.batch_seconds.family(
            "l4m_executor_batch_seconds", "Time one batch took on the executor, by command kind"
        )
        yield GaugeMetricFamily("l4m_executor_kv_pages", "Physical KV pages", value=cache.num_pages)
        yield GaugeMetricFamily(
            "l4m_executor_kv_pages_used", "KV pages allocated", value=cache.num_pages - cache.num_free_pages
        )
        yield GaugeMetricFamily(
            "l4m_executor_embed_slots_used", "Embedding slots allocated",
            value=cache.num_embed_slots - cache.num_free_slots,
        )


def executor_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    return registry
