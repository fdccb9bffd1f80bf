"""Spans of the scheduler: one per L4M command, one per batch, linked both ways.

A command span (`l4m.<kind>`) starts when the command arrives, as a child of the session's
`traceparent` (gRPC metadata of the Session call: the controller's `controller.run` span), and ends
when the command is done. The `scheduler.batch` span that carries it starts when the batch fires,
with links to all its command spans; each command span then gets a link back to the batch. A span has
one parent, so the batch is the child of its FIRST command: with one controller on the cluster, each
batch sits in that launch's trace; a batch mixing instances sits in the trace of one of them and is
reached from the others through the links. The batch context travels to the executor in
`ExecuteRequest.trace_context`. With no tracer provider configured nothing is created at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, Status, StatusCode

from l4m.telemetry import tracing_enabled
from l4m.wire.tracecontext import parent_context, traceparent_of


class SchedulerTracer:
    """Wraps an OpenTelemetry tracer; `enabled` is False when no real provider is installed."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        provider = provider or trace.get_tracer_provider()
        self.enabled = tracing_enabled(provider)
        self._tracer = provider.get_tracer("l4m.scheduler")

    @staticmethod
    def extract(traceparent: str | None, tracestate: str | None = None) -> otel_context.Context | None:
        """The parent context carried by a session's `traceparent` metadata (None when absent)."""
        return parent_context(traceparent, tracestate)

    def command_span(self, kind: str, parent: otel_context.Context | None, attributes: dict[str, Any]) -> Span:
        return self._tracer.start_span(f"l4m.{kind}", context=parent, attributes=attributes)

    def batch_span(self, kind: str, executor_index: int, command_spans: Sequence[Span]) -> tuple[Span, str, str]:
        """Start the batch span linked to its commands, link them back; returns (span, traceparent, tracestate)."""
        traced = [s for s in command_spans if s is not None]
        parent = trace.set_span_in_context(traced[0]) if traced else None
        span = self._tracer.start_span(
            "scheduler.batch",
            context=parent,
            links=[Link(s.get_span_context()) for s in traced],
            attributes={"l4m.batch.kind": kind, "l4m.batch.size": len(command_spans), "l4m.executor": executor_index},
        )
        batch_context = span.get_span_context()
        for command_span in traced:
            command_span.add_link(batch_context)
        return (span, *traceparent_of(trace.set_span_in_context(span)))

    @staticmethod
    def end_with_error(span: Span | None, reason: str) -> None:
        if span is not None:
            span.set_status(Status(StatusCode.ERROR, reason))
            span.end()
