"""W3C trace context (`traceparent`, `tracestate`) in and out of OpenTelemetry contexts.

OpenTelemetry is imported on first use: a process that never propagates a trace never imports it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry import context as otel_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


def context_from_traceparent(traceparent: str, tracestate: str = "") -> otel_context.Context:
    """The OpenTelemetry context a W3C `traceparent` (and `tracestate`) names; empty → the root context."""
    from opentelemetry import context as otel_context

    carrier = {"traceparent": traceparent} if traceparent else {}
    if traceparent and tracestate:
        carrier["tracestate"] = tracestate
    return _propagator().extract(carrier, context=otel_context.Context())


def parent_context(traceparent: str | None, tracestate: str | None = None) -> otel_context.Context | None:
    """The parent a received `traceparent` names, or None when the caller sent none (start a new trace)."""
    return context_from_traceparent(traceparent, tracestate or "") if traceparent else None


def traceparent_of(ctx: otel_context.Context | None = None) -> tuple[str, str]:
    """(`traceparent`, `tracestate`) of the current span, or of `ctx`; empty strings when not traced."""
    carrier: dict[str, str] = {}
    _propagator().inject(carrier, context=ctx)
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


@functools.cache
def _propagator() -> TraceContextTextMapPropagator:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()
