"""Tracing and metrics set-up shared by every l4m process, configured only by the standard variables.

Tracing is on when the environment asks for it (`OTEL_TRACES_EXPORTER`, or an `OTEL_EXPORTER_OTLP_*`
endpoint); otherwise the OpenTelemetry API stays the no-op tracer, so instrumentation costs a few
function calls and nothing is exported. Resource attributes come from `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES`, with the service's own name as the default.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry import context as otel_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from prometheus_client.core import HistogramMetricFamily

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(environ.get(name) for name in _ENDPOINT_VARS)


def configure_tracing(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Install an SDK tracer provider exporting per the environment; return whether tracing is on."""
    if not tracing_requested(environ):
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    exporter_name = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        # A `unix:` endpoint (controllers export through the spawner's socket) has no TLS.
        insecure = True if endpoint and endpoint.startswith("unix:") else None
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call before the process exits)."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


def context_from_traceparent(traceparent: str, tracestate: str = "") -> otel_context.Context:
    """The OpenTelemetry context a W3C `traceparent` (and `tracestate`) names; empty → the root context."""
    from opentelemetry import context as otel_context

    carrier = {"traceparent": traceparent} if traceparent else {}
    if traceparent and tracestate:
        carrier["tracestate"] = tracestate
    return _propagator().extract(carrier, context=otel_context.Context())


def traceparent_of(ctx: otel_context.Context | None = None) -> tuple[str, str]:
    """(`traceparent`, `tracestate`) of the current span, or of `ctx`; empty strings when not traced."""
    carrier: dict[str, str] = {}
    _propagator().inject(carrier, context=ctx)
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def start_metrics_server(port: int, registry: object | None = None, host: str = "127.0.0.1") -> None:
    """Serve Prometheus metrics on http://host:port/metrics (port 0: no server)."""
    if not port:
        return
    from prometheus_client import REGISTRY, start_http_server

    start_http_server(port, addr=host, registry=registry or REGISTRY)


@functools.cache
def _propagator() -> TraceContextTextMapPropagator:
    # Imported on first use: a process that never propagates a trace never imports OpenTelemetry.
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


# Latency buckets (seconds) for work from a sub-millisecond decode step on a GPU to a long CPU prefill.
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class DurationHistogram:
    """A Prometheus-style histogram of durations for ONE writer thread: `observe` is a bucket search and
    two additions, no lock (prometheus_client's Histogram takes one per observation); a scrape reads
    the counts from another thread, which may see an observation half-recorded (counts off by one for
    one scrape, never corrupted)."""

    __slots__ = ("bounds_s", "counts", "sum_s")

    def __init__(self, bounds_s: tuple[float, ...] = DURATION_BUCKETS_S) -> None:
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)  # the last bucket is +Inf
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.sum_s += seconds

    def cumulative_buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, +Inf last, as `HistogramMetricFamily.add_metric` takes them."""
        buckets, total = [], 0
        for bound, count in zip((*map(repr, self.bounds_s), "+Inf"), self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets


class DurationsByKind(dict[str, DurationHistogram]):
    """`DurationHistogram`s by a label value (a command kind), created on first observation; one writer
    thread, as `DurationHistogram`. `family` gives them to a prometheus_client collector at scrape time."""

    def observe(self, kind: str, seconds: float) -> None:
        histogram = self.get(kind)
        if histogram is None:
            histogram = self[kind] = DurationHistogram()
        histogram.observe(seconds)

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """One HistogramMetricFamily, labelled `kind`, of every histogram so far."""
        from prometheus_client.core import HistogramMetricFamily  # not at import: controllers never scrape

        family = HistogramMetricFamily(name, documentation, labels=["kind"])
        for kind, histogram in sorted(self.items()):
            family.add_metric([kind], histogram.cumulative_buckets(), histogram.sum_s)
        return family
