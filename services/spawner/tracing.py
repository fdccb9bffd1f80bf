"""The spawner's spans: `spawner.launch` (the root of a launch's trace) and `spawner.instance` (the
instance's run, ended at its exit with the exit reason).

`spawner.launch` continues the `traceparent` the user sent on Launch (or the parent controller on
SpawnChild), and its context is what the controller gets as `TRACEPARENT`, so the controller's own
`controller.run` span is its child. With no tracer provider configured the API's no-op tracer makes
these calls nearly free; the incoming `traceparent` is then passed through unchanged.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from l4m.spawner.sandbox import ExitInfo, ExitReason
from l4m.wire.tracecontext import context_from_traceparent, traceparent_of

_tracer = trace.get_tracer("l4m.spawner")
_CLEAN_EXITS = (ExitReason.EXITED, ExitReason.TERMINATED)


def start_launch_span(traceparent: str, attributes: dict[str, str]) -> Span:
    return _tracer.start_span(
        "spawner.launch", context=context_from_traceparent(traceparent), attributes=attributes
    )


def start_instance_span(launch_span: Span, attributes: dict[str, str]) -> Span:
    return _tracer.start_span(
        "spawner.instance", context=trace.set_span_in_context(launch_span), attributes=attributes
    )


def end_instance_span(span: Span, info: ExitInfo) -> None:
    span.set_attribute("l4m.exit_reason", info.reason.value)
    if info.exit_code is not None:
        span.set_attribute("l4m.exit_code", info.exit_code)
    if info.reason not in _CLEAN_EXITS:
        span.set_status(Status(StatusCode.ERROR, f"{info.reason.value}: {info.message}"))
    span.end()


def traceparent_for_controller(launch_span: Span, incoming_traceparent: str) -> str:
    """The launch span's W3C context; the caller's own when the spawner is not tracing."""
    traceparent, _ = traceparent_of(trace.set_span_in_context(launch_span))
    return traceparent or incoming_traceparent
