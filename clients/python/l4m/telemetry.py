"""Tracing set-up shared by every l4m process, configured only by the standard variables.

Tracing is on when the environment asks for it (`OTEL_TRACES_EXPORTER`, or an `OTEL_EXPORTER_OTLP_*`
endpoint); otherwise the OpenTelemetry API stays the no-op tracer, so instrumentation costs a few
function calls and nothing is exported. Resource attributes come from `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES`, with the service's own name as the default. Trace context on the wire is
`l4m.wire.tracecontext`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return any(environ.get(name) for name in _ENDPOINT_VARS)


def tracing_enabled(provider: object | None = None) -> bool:
    """Whether spans are recorded: a real tracer provider is installed (`configure_tracing`, or a test's),
    not the API's default proxy or no-op one. Hot paths ask this to skip building spans nobody records."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider() if provider is None else provider
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


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
