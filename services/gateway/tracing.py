"""The gateway's spans: one `gateway.request` per completion request (`/v1/chat/completions`,
`/v1/completions`), from its arrival to the end of its answer (a stream's last chunk).

The span continues the W3C `traceparent` (and `tracestate`) header the caller sent, else it starts a
trace, and it is the current span while the request runs, so what the request starts below it joins
the trace: the built-in handlers' L4M session carries it as its `traceparent` (the scheduler's command
spans are its children) and a program's Launch does too (`spawner.launch` is its child), as `l4m run`'s
`l4m.run` span is theirs. Its attributes: the route and HTTP status code, the model, whether it streams,
the instance that served it (not the user: the spawner's spans, like the metrics, leave names of users
out; the instance id leads to it), the prompt and completion tokens, and for a failed
answer `error.type` (OpenAI's error code or type) with an error status when the gateway (5xx) or the
stream failed; a 4xx leaves the status unset, as OpenTelemetry's HTTP conventions say.

With no tracer provider configured (no `OTEL_*` variable, see l4m.telemetry) the API's no-op tracer
makes this a few function calls, and a caller's `traceparent` passes through to the cluster unchanged.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from l4m.gateway.asgi import Asgi, NotingStatus
from l4m.gateway.schemas import Usage
from l4m.wire.tracecontext import context_from_traceparent

TRACED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
SPAN_NAME = "gateway.request"


_tracer = trace.get_tracer("l4m.gateway")


class RequestSpans:
    """ASGI middleware: a `gateway.request` span around each completion request, current while it runs."""

    def __init__(self, app: Asgi) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Asgi, send: Asgi) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_ROUTES:
            await self.app(scope, receive, send)
            return
        headers = {key: value.decode("latin-1") for key, value in scope["headers"]
                   if key in (b"traceparent", b"tracestate")}
        parent = context_from_traceparent(headers.get(b"traceparent", ""), headers.get(b"tracestate", ""))
        span = _tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, attributes={
            "http.request.method": scope["method"], "http.route": scope["path"]})
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        noting = NotingStatus(send)
        try:
            await self.app(scope, receive, noting)
        except BaseException as error:
            span.record_exception(error)
            raise
        finally:
            span.set_attribute("http.response.status_code", noting.status)
            if noting.status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {noting.status}"))
            otel_context.detach(token)
            span.end()


def note_request(model: str, stream: bool) -> None:
    """What the request asks, on its span."""
    trace.get_current_span().set_attributes({"l4m.model": model, "l4m.stream": stream})


def note_instance(instance_id: str) -> None:
    """The instance that serves the request (the scheduler's and spawner's spans name it too)."""
    trace.get_current_span().set_attribute("l4m.instance_id", instance_id)


def note_usage(usage: Usage) -> None:
    trace.get_current_span().set_attributes({"l4m.prompt_tokens": usage.prompt_tokens,
                                             "l4m.completion_tokens": usage.completion_tokens})


def note_error(status: int, error_type: str, message: str, after_answer_began: bool = False) -> None:
    """A failed answer: an error status for the gateway's own failures (5xx) and for a stream that failed
    after its 200 (whose HTTP status says nothing of it)."""
    span = trace.get_current_span()
    span.set_attribute("error.type", error_type)
    if status >= 500 or after_answer_began:
        span.set_status(Status(StatusCode.ERROR, message))
