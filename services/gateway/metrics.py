"""The gateway's Prometheus metrics, in a registry of its own (served by `--metrics-port`).

`GatewayMetrics` is what the app reports to: HTTP requests by endpoint and status code and their latency
(`RequestMetrics`, an ASGI middleware: a streamed answer is timed to its last chunk, not to its headers),
the tokens of the completions the built-in handlers answered (as their `usage` says), and the prefix
cache's counts, read at scrape time. A request costs milliseconds at least, so prometheus_client's own
families (a lock per update) are cheap enough here, unlike on the scheduler's per-step path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from l4m.gateway.asgi import Asgi, NotingStatus
from l4m.gateway.schemas import Usage

# The routes the gateway serves; any other path is counted as "other" (a label value per path a caller
# makes up would let anyone grow the metrics without bound).
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"})
OTHER_ENDPOINT = "other"
# From a refused request (ms) to a long completion on a CPU (minutes).
REQUEST_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)



class _PrefixCacheCollector(Collector):
    """The prefix cache's `stats()` as counters (hits, misses, evictions) and gauges (entries, pages)."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        yield CounterMetricFamily("l4m_gateway_prefix_cache_hits",
                                  "Prompts that reused cached prefix pages (automatic prefix caching)",
                                  value=stats["hits"])
        yield CounterMetricFamily("l4m_gateway_prefix_cache_misses",
                                  "Prompts the prefix cache had no page of (looked up with the cache on)",
                                  value=stats["misses"])
        yield CounterMetricFamily("l4m_gateway_prefix_cache_evictions",
                                  "Cached prefixes unexported to keep the cache within its pages",
                                  value=stats["evictions"])
        yield GaugeMetricFamily("l4m_gateway_prefix_cache_pages", "KV pages the cached prefixes hold now",
                                value=stats["pages"])
        yield GaugeMetricFamily("l4m_gateway_prefix_cache_entries", "Cached prefixes (exports) now",
                                value=stats["entries"])


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "l4m_gateway_requests",
            "HTTP requests answered, by endpoint (the route; `other`: a path the gateway does not serve) and "
            "status code (a stream that failed after its 200 counts as 200)",
            ["endpoint", "code"], registry=self.registry)
        self.request_seconds = Histogram(
            "l4m_gateway_request_seconds",
            "An HTTP request's arrival to the end of its answer (a stream's last chunk), by endpoint",
            ["endpoint"], buckets=REQUEST_BUCKETS_S, registry=self.registry)
        self.prompt_tokens = Counter(
            "l4m_gateway_prompt_tokens",
            "Prompt tokens of the completions the gateway answered (their usage.prompt_tokens)", registry=self.registry)
        self.cached_prompt_tokens = Counter(
            "l4m_gateway_cached_prompt_tokens",
            "Of those, prompt tokens read from the prefix cache (usage.prompt_tokens_details.cached_tokens)",
            registry=self.registry)
        self.generated_tokens = Counter(
            "l4m_gateway_generated_tokens",
            "Completion tokens of the completions the gateway answered, every choice (their "
            "usage.completion_tokens)", registry=self.registry)

    def bind_prefix_cache(self, stats: Callable[[], dict[str, int]]) -> None:
        """The prefix cache's counts, read from `stats()` (PrefixCache.stats) at scrape time."""
        self.registry.register(_PrefixCacheCollector(stats))

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        endpoint = path if path in ENDPOINTS else OTHER_ENDPOINT
        self.requests.labels(endpoint, str(status)).inc()
        self.request_seconds.labels(endpoint).observe(seconds)

    def observe_usage(self, usage: Usage) -> None:
        """A completion was answered (whole, or its stream ended without error)."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        self.cached_prompt_tokens.inc((usage.prompt_tokens_details or {}).get("cached_tokens", 0))


class RequestMetrics:
    """ASGI middleware: every HTTP request's endpoint, status code and time to the end of its answer."""

    def __init__(self, app: Asgi, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict[str, Any], receive: Asgi, send: Asgi) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        noting = NotingStatus(send)
        try:
            await self.app(scope, receive, noting)
        finally:
            self.metrics.observe_request(scope["path"], noting.status, time.monotonic() - started)
